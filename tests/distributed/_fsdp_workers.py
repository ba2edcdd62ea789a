"""Code the spawned ranks of tests/distributed/test_fsdp.py run: FSDP2 (fully_shard) with
headroom, against the same FSDP2 model without headroom."""

from __future__ import annotations

import contextlib
import copy
import os
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import headroom as hr
from headroom.store import DiskStore, HostStore
from headroom.transfer import binding

D = 16
STEPS = 3


class Block(nn.Module):
    def __init__(self, d: int = D) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, 2 * d)
        self.fc2 = nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.tanh(self.fc1(x)))


class Net(nn.Module):
    """Blocks and a head; every dimension divides by 4 (no padding of the shards) unless
    ``out`` does not (5: padded shards of 3 + 2 rows on 2 ranks, 2 + 2 + 1 + 0 on 4)."""

    def __init__(self, d: int = D, n: int = 3, out: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block(d) for _ in range(n))
        self.head = nn.Linear(d, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.layers:
            x = b(x)
        return self.head(x)


def batch(rank: int, step: int, micro: int = 0):
    g = torch.Generator().manual_seed(1000 * rank + 10 * step + micro)
    return torch.randn(8, D, generator=g), torch.randint(0, 4, (8,), generator=g)


def shard(model: nn.Module, **kw) -> nn.Module:
    for b in model.layers:
        fully_shard(b, **kw)
    fully_shard(model, **kw)
    return model


def _pair(*, seed: int = 0, out: int = 4, **kw) -> tuple[nn.Module, nn.Module]:
    """The model and a reference with the same weights, both sharded the same way."""
    warnings.simplefilter("ignore")
    torch.manual_seed(seed)
    model = Net(out=out)
    ref = Net(out=out)
    ref.load_state_dict(model.state_dict())
    return shard(model, **kw), shard(ref, **kw)


def _error(fn) -> str:
    """The error ``fn()`` raises, as ``Type: message`` ("no error" if none)."""
    try:
        fn()
    except Exception as e:  # the test checks type and message
        return f"{type(e).__name__}: {e}"
    return "no error"


def fsdp_modules(model: nn.Module):
    from headroom.residency._dtensor import fsdp_modules

    return fsdp_modules(model)


def _fsdp_params(m: nn.Module):
    from headroom.residency._dtensor import _fsdp_params

    return _fsdp_params(m)


def sharded_state_of(model: nn.Module):
    from headroom.residency._dtensor import sharded_state_of

    return sharded_state_of(model)


def _record_early(opt) -> list[int]:
    """The sizes of the batches ``opt`` (a HostOptimizer) steps inside a final backward."""
    early: list[int] = []
    step_entries = opt._step_entries

    def recorded(batch, **kw):
        if kw.get("early"):
            early.append(len(batch))
        return step_entries(batch, **kw)

    opt._step_entries = recorded
    return early


def _at_rest(fp) -> bool:
    """A shard on disk between uses: no memory of its own (a StoreTensor over the store, its
    padded shard a placeholder)."""
    from headroom.transfer import StoreTensor

    return (isinstance(fp.sharded_param.to_local(), StoreTensor)
            and fp._sharded_param_data.untyped_storage().nbytes() == 0)


def _local(model: nn.Module) -> dict[str, torch.Tensor]:
    """Each parameter's local shard, as ``state_dict()`` gives it (read from a DiskStore)."""
    return {n: (p.to_local() if hasattr(p, "to_local") else p).detach().clone()
            for n, p in model.state_dict().items()}


def _store(store: str, tmp: str, rank: int, name: str = "shards"):
    return "cpu" if store == "cpu" else DiskStore(os.path.join(tmp, f"{name}{rank}"), threads=2)


# ------------------------------------------------------------------ wrong orders, refused
def refusals(rank: int, world: int, tmp: str) -> dict:
    warnings.simplefilter("ignore")
    out = {}
    x, _ = batch(rank, 0)

    # hr.offload of a sharded model onto a DiskStore that holds an earlier run's shards
    # (reopened after that process stopped): refused, naming an empty folder or a checkpoint.
    st = DiskStore(os.path.join(tmp, f"a{rank}"))
    hr.offload(shard(Net()), device="cpu", store=st)
    st.close()
    m = shard(Net())
    out["offload_disk_reopened"] = _error(lambda: hr.offload(
        m, device="cpu", store=DiskStore(os.path.join(tmp, f"a{rank}"))))
    m(x).sum().backward()  # the refusal changed nothing
    out["reopened_untouched"] = int(sharded_state_of(m) is None and not any(
        fp.offload_to_cpu for _, u in fsdp_modules(m) for fp in _fsdp_params(u)))
    # gradients summed on the device: FSDP2 reduce-scatters every backward's, refused
    out["held_sums"] = _error(lambda: hr.offload(
        m, device="cpu", store="cpu", grad_accumulation="device"))
    out["held_untouched"] = int(sharded_state_of(m) is None)

    # fully_shard over an offloaded model (host memory and disk): refused at the call.
    for name, store in (("cpu", "cpu"), ("disk", DiskStore(os.path.join(tmp, f"b{rank}")))):
        m = Net()
        hr.offload(m, device="cpu", store=store)
        out[f"shard_offloaded_{name}_block"] = _error(lambda m=m: fully_shard(m.layers[0]))
        out[f"shard_offloaded_{name}_root"] = _error(lambda m=m: fully_shard(m))
    # ... and over a module holding an offloaded model (fully_shard lists its modules' own
    # parameters, the offloaded root's among them)
    for name, store in (("cpu", "cpu"), ("disk", DiskStore(os.path.join(tmp, f"parent{rank}")))):
        m = Net()
        hr.offload(m, device="cpu", store=store)
        out[f"shard_offloaded_{name}_parent"] = _error(
            lambda m=m: fully_shard(torch.nn.Sequential(m)))
    # A layer inside an offloaded block: fully_shard lists nothing of headroom's; refused at
    # the next forward.
    m = Net()
    hr.offload(m, device="cpu", store="cpu")
    fully_shard(m.layers[0].fc1)
    out["shard_offloaded_inner"] = _error(lambda: m(x))
    # ... and the order it names works: unoffload, shard, offload.
    m = Net()
    hr.offload(m, device="cpu", store="cpu")
    out["refused_then"] = _error(lambda: shard(m))
    hr.unoffload(m)
    m2 = Net()  # fully_shard marks a module it saw; the right order starts from a fresh one
    m2.load_state_dict(m.state_dict())
    hr.offload(shard(m2), device="cpu", store="cpu")
    F.cross_entropy(m2(x), batch(rank, 0)[1]).backward()
    out["right_order_grads"] = sum(p.grad is not None for p in m2.parameters())

    # hr.data_parallel of a sharded model (offloaded or not).
    m = shard(Net())
    out["data_parallel"] = _error(lambda: hr.data_parallel(m))
    hr.offload(m, device="cpu", store="cpu")
    out["data_parallel_offloaded"] = _error(lambda: hr.data_parallel(m))

    # DDP over an offloaded model stays refused.
    m = Net()
    hr.offload(m, device="cpu", store="cpu")
    out["ddp_offloaded"] = _error(lambda: torch.nn.parallel.DistributedDataParallel(m))

    # A DTensor handed to a store whole: an error naming the local shard (was a segfault).
    p = shard(Net()).head.weight
    disk = DiskStore(os.path.join(tmp, f"c{rank}"))
    out["disk_put_dtensor"] = _error(lambda: disk.put("w", p))
    out["disk_keys_after"] = len(disk.keys())
    h = disk.put("w", p.to_local())
    out["disk_write_dtensor"] = _error(lambda: disk.write(h, p).result())
    out["host_put_dtensor"] = _error(lambda: HostStore().put("w", p))

    # Shards on a DiskStore: torch.optim cannot step them (their values are on disk), and
    # HostOptimizer.clip_grad_norm_ would see only this rank's shards.
    m = hr.offload(shard(Net()), device="cpu", store=DiskStore(os.path.join(tmp, f"e{rank}")))
    F.cross_entropy(m(x), batch(rank, 0)[1]).backward()
    out["torch_opt_disk"] = _error(torch.optim.AdamW(m.parameters()).step)
    out["host_clip_disk"] = _error(lambda: hr.HostOptimizer(
        m.parameters(), torch.optim.AdamW).clip_grad_norm_(1.0))

    # HostOptimizer keeping the state of shards in host memory on disk: refused when built.
    m = hr.offload(shard(Net()), device="cpu", store="cpu")
    out["host_opt_state_disk"] = _error(lambda: hr.HostOptimizer(
        m.parameters(), torch.optim.AdamW, state_store=DiskStore(os.path.join(tmp, f"d{rank}"))))

    # DTensor parameters that FSDP2 does not manage (tensor parallel, distribute_tensor).
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    lin = nn.Linear(D, D)
    lin.weight = nn.Parameter(distribute_tensor(lin.weight.detach(), mesh, [Shard(0)]))
    out["offload_tp"] = _error(lambda: hr.offload(lin, device="cpu", store="cpu"))

    # HostOptimizer over bf16 shards that hr.offload did not offload (a unit left on the
    # device): it would have copied the DTensor into a host master (torch's mixed-types error)
    m = shard(Net()).to(torch.bfloat16)
    out["host_opt_unoffloaded_bf16"] = _error(
        lambda: hr.HostOptimizer(m.parameters(), torch.optim.AdamW))
    return out


# ------------------------------------------------------------------ the contract
def _step_pair(rank, model, ref, opt, ref_opt, *, micro: int, clip: float | None, step: int,
               final: bool = False) -> None:
    for m, o in ((model, opt), (ref, ref_opt)):
        for k in range(micro):
            last = k == micro - 1
            if micro > 1:
                m.set_requires_gradient_sync(last)
            x, y = batch(rank, step, k)
            # final: the host optimizer steps each shard as its gradient arrives in backward
            within = o.final_backward(last) if final and o is opt else contextlib.nullcontext()
            with within:
                (F.cross_entropy(m(x).float(), y) / micro).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(m.parameters(), clip)
        o.step()
        o.zero_grad()


def train(rank: int, world: int, *, host: bool = True, micro: int = 1, bf16: bool = False,
          partial: bool = False, clip: float | None = 0.05, store: str = "cpu",
          state_disk: bool = False, tmp: str = "", classes: int = 4, prefetch: int = 1,
          final: bool = False, no_reset: bool = False) -> dict:
    """FSDP2 + hr.offload(store="cpu" or a DiskStore) + (Host)AdamW vs the same FSDP2 model
    alone."""
    kw = {}
    if bf16:
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                               reduce_dtype=torch.float32)
    model, ref = _pair(out=classes, **kw)
    blocks = [model.layers[0], model.layers[2]] if partial else None
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    saved = FSDPParamGroup.__dict__.get("_reset_iter_state")  # torch 2.11 and older have none
    if no_reset and saved is not None:  # as those, which have no reset after an error
        del FSDPParamGroup._reset_iter_state
    try:
        hr.offload(model, device="cpu", store=_store(store, tmp, rank), blocks=blocks,
                   prefetch=prefetch)
    finally:
        if saved is not None:
            FSDPParamGroup._reset_iter_state = saved
    state = sharded_state_of(model)
    wrapped = [sorted(k for k in ("unshard", "wait_for_unshard", "_reset_iter_state")
                      if k in g.__dict__) for g in getattr(state.disk, "groups", [])]
    okw = dict(lr=1e-2, weight_decay=0.1)
    if host:
        st = _store("disk", tmp, rank, "state") if state_disk else "cpu"
        opt = hr.HostOptimizer(model.parameters(), torch.optim.AdamW, fused=False,
                               state_store=st, **okw)
    else:
        opt = torch.optim.AdamW(model.parameters(), foreach=False, **okw)
    ref_opt = torch.optim.AdamW(ref.parameters(), foreach=False, **okw)
    early = _record_early(opt) if final else []
    peak = 0
    for step in range(STEPS):
        _step_pair(rank, model, ref, opt, ref_opt, micro=micro, clip=clip, step=step,
                   final=final)
    out = {"stored_bytes": state.stored_bytes, "store_used": state.store.used_bytes,
           "units": len(state.units), "early": sum(early), "wrapped": wrapped}
    if store == "cpu":
        # Where the shards rest: inside the store's own tensors, and nowhere else.
        in_store = {}
        for key, h in state.handles.items():
            flat = state.store.host_tensor(h)
            lo, hi = flat.data_ptr(), flat.data_ptr() + flat.nbytes
            in_store[key] = int(lo <= state.params[key].sharded_param.to_local().data_ptr() < hi)
    else:
        # On disk: between uses no shard holds host memory.
        in_store = {key: int(_at_rest(state.params[key])) for key in state.handles}
        peak = state.disk.peak_resident_bytes
        out.update(resident=state.resident_bytes, peak_resident=peak,
                   reads=state.disk.reads, ahead_used=state.disk.ahead_used,
                   iterations=STEPS * micro, on_disk=sum(
                       os.path.getsize(state.store.file_of(h)) for h in state.handles.values()),
                   opt_state_bytes=sum(
                       (v.to_local() if hasattr(v, "to_local") else v).nbytes
                       for s in opt.state.values() for v in s.values()
                       if isinstance(v, torch.Tensor) and v.dim() > 0))
    local_bytes = sum(p.to_local().nbytes for n, p in model.named_parameters()
                      if not partial or n.startswith(("layers.0.", "layers.2.")))
    out["all_local_bytes"] = sum(p.to_local().nbytes for p in model.parameters())
    out["unit_bytes"] = max(  # the largest unit's local shards (the root: head only)
        sum(p.to_local().nbytes for p in m.parameters()) for m in model.layers)
    out.update(got=_local(model), ref=_local(ref), in_store=in_store, local_bytes=local_bytes)
    return out


def checkpoint(rank: int, world: int, tmp: str, store: str = "cpu") -> dict:
    """DCP save of a trained offloaded sharded model, load into a fresh one (also offloaded)."""
    import torch.distributed.checkpoint as dcp

    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    model = hr.offload(shard(Net()), device="cpu", store=_store(store, tmp, rank, "a"))
    opt = hr.HostOptimizer(model.parameters(), torch.optim.AdamW, fused=False, lr=1e-2)
    for step in range(2):
        x, y = batch(rank, step)
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    dcp.save(model.state_dict(), checkpoint_id=os.path.join(tmp, "dcp"))
    torch.manual_seed(1)
    fresh = hr.offload(shard(Net()), device="cpu", store=_store(store, tmp, rank, "b"))
    sd = fresh.state_dict()
    dcp.load(sd, checkpoint_id=os.path.join(tmp, "dcp"))
    fresh.load_state_dict(sd)
    state = sharded_state_of(fresh)
    in_store = []
    for key, h in state.handles.items():
        local = state.params[key].sharded_param.to_local()
        if store == "cpu":
            flat = state.store.host_tensor(h)
            lo, hi = flat.data_ptr(), flat.data_ptr() + flat.nbytes
            in_store.append(int(lo <= local.data_ptr() < hi))
        else:  # on disk: nothing left in host memory after the load
            in_store.append(int(_at_rest(state.params[key])))
    x, _ = batch(rank, 9)
    return {"got": _local(fresh), "ref": _local(model), "in_store": torch.tensor(in_store),
            "out": fresh(x).detach(), "out_ref": model(x).detach()}


def _full(model: nn.Module, opt) -> dict[str, torch.Tensor]:
    """Every parameter and optimizer state tensor whole (a collective: all ranks call it)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    out = {f"model.{k}": v.full_tensor().clone() for k, v in msd.items()}
    for name, st in osd["state"].items():
        for k, v in st.items():
            v = v.full_tensor() if hasattr(v, "full_tensor") else v
            out[f"optim.{name}.{k}"] = v.detach().clone()
    return out


def resharded(rank: int, world: int, *, tmp: str, load_from: str | None = None,
              save_to: str | None = None, first: int = 0, store: str = "cpu") -> dict:
    """FSDP2 + hr.offload + HostOptimizer and FSDP2 + AdamW alone, each through the same DCP
    round trip (get_state_dict / set_state_dict): load what a job of another world size saved
    (``load_from``), train two steps (batches ``first``, ``first + 1``), save (``save_to``).
    Padded, uneven shards (a head of 5 rows)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    # A fresh job starts from other weights than the saved ones: only the load makes them equal.
    model, ref = _pair(seed=1 if load_from else 0, out=5)
    hr.offload(model, device="cpu",
               store=_store(store, tmp, rank, f"shards-{load_from}-{save_to}-"))
    okw = dict(lr=1e-2, weight_decay=0.1)
    opt = hr.HostOptimizer(model.parameters(), torch.optim.AdamW, fused=False, **okw)
    ref_opt = torch.optim.AdamW(ref.parameters(), foreach=False, **okw)
    pairs = (("hr", model, opt), ("ref", ref, ref_opt))
    out = {}
    if load_from:
        for tag, m, o in pairs:
            msd, osd = get_state_dict(m, o)
            sd = {"model": msd, "optim": osd}
            dcp.load(sd, checkpoint_id=os.path.join(tmp, f"{load_from}-{tag}"))
            set_state_dict(m, o, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
            out[f"loaded_{tag}"] = _full(m, o)
    for step in range(first, first + 2):
        _step_pair(rank, model, ref, opt, ref_opt, micro=1, clip=0.05, step=step)
    if save_to:
        for tag, m, o in pairs:
            msd, osd = get_state_dict(m, o)
            dcp.save({"model": msd, "optim": osd},
                     checkpoint_id=os.path.join(tmp, f"{save_to}-{tag}"))
            out[f"saved_{tag}"] = _full(m, o)
    state = sharded_state_of(model)
    in_store = []
    for key, h in state.handles.items():
        flat = state.store.host_tensor(h)
        if flat is None:  # on disk
            in_store.append(int(h.key in state.store))
            continue
        ptr = state.params[key].sharded_param.to_local().data_ptr()
        in_store.append(int(flat.data_ptr() <= ptr < flat.data_ptr() + flat.nbytes
                            or state.params[key].sharded_param.to_local().numel() == 0))
    return {"got": _local(model), "ref": _local(ref), "in_store": torch.tensor(in_store),
            "rows": torch.tensor(model.head.weight.to_local().shape[0]), **out}


# ------------------------------------------------------------------ tracking and convert
def tracking(rank: int, world: int, *, offloaded: bool = False, store: str = "cpu",
             tmp: str = "") -> dict:
    import io

    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    model = shard(Net())
    if offloaded:
        hr.offload(model, device="cpu", store=_store(store, tmp, rank))
    opt = (torch.optim.AdamW(model.parameters(), lr=1e-2) if store == "cpu" else
           hr.HostOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2))
    x, y = batch(rank, 0)
    F.cross_entropy(model(x), y).backward()
    opt.step()
    with hr.track_memory(model=model, optimizer=opt) as mem:
        F.cross_entropy(model(x), y).backward()
        opt.step()
    buf = io.StringIO()
    mem.report(file=buf)
    return {
        "tracked": {k: mem.current_by_category[k]
                    for k in ("parameters", "gradients", "optimizer_state")},
        "max_parameters": mem.max_by_category["parameters"],
        "local": {
            "parameters": sum(p.to_local().nbytes for p in model.parameters()),
            "gradients": sum(p.grad.to_local().nbytes for p in model.parameters()),
            "optimizer_state": sum(
                (v.to_local() if hasattr(v, "to_local") else v).nbytes
                for s in opt.state.values() for v in s.values()),
        },
        "report": buf.getvalue(),
    }


def convert(rank: int, world: int) -> dict:
    model, ref = _pair()
    before = [type(m) for m in model.modules()]
    conv = hr.convert(model)  # inplace=False: a new tree, the same parameters
    opt = torch.optim.AdamW(conv.parameters(), lr=1e-2, foreach=False)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
    for step in range(2):
        for m, o in ((conv, opt), (ref, ref_opt)):
            x, y = batch(rank, step)
            F.cross_entropy(m(x), y).backward()
            o.step()
            o.zero_grad()
    return {"got": _local(conv), "ref": _local(ref),
            "converted": int(type(conv.layers[0].fc1).__module__.startswith("headroom.")),
            "unchanged": int(before == [type(m) for m in model.modules()])}


def compiled(rank: int, world: int, store: str = "cpu", tmp: str = "",
             backend: str = "aot_eager") -> dict:
    """``torch.compile`` of the whole FSDP2 + headroom model, as FSDP2 users compile theirs,
    against the same compiled FSDP2 model alone (AdamW, clipping)."""
    model, ref = _pair()
    hr.offload(model, device="cpu", store=_store(store, tmp, rank))
    okw = dict(lr=1e-2, weight_decay=0.1)
    opt = hr.HostOptimizer(model.parameters(), torch.optim.AdamW, fused=False, **okw)
    ref_opt = torch.optim.AdamW(ref.parameters(), foreach=False, **okw)
    runs = ((torch.compile(model, backend=backend), opt),
            (torch.compile(ref, backend=backend), ref_opt))
    losses: dict = {"got": [], "ref": []}
    for step in range(STEPS):
        x, y = batch(rank, step)
        for (m, o), key in zip(runs, ("got", "ref"), strict=True):
            loss = F.cross_entropy(m(x), y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05)
            o.step()
            o.zero_grad()
            losses[key].append(loss.detach())
    return {"got": _local(model), "ref": _local(ref),
            "losses_equal": torch.equal(torch.stack(losses["got"]), torch.stack(losses["ref"]))}


def llama(rank: int, world: int, mode: str, store: str = "cpu", tmp: str = "") -> dict:
    """A transformers Llama (from a config) sharded per decoder layer, with gradient
    checkpointing (``mode="ckpt"``) or PEFT LoRA on a frozen base (``mode="lora"``), then
    offloaded: AdamW over the trainable parameters with clipping, against FSDP2 alone."""
    from transformers import LlamaConfig, LlamaForCausalLM

    warnings.simplefilter("ignore")
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=128)

    def build() -> nn.Module:
        torch.manual_seed(0)
        m = LlamaForCausalLM(cfg)
        layers = m.model.layers
        if mode == "ckpt":
            m.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False})
        else:
            from peft import LoraConfig, get_peft_model

            m = get_peft_model(m, LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                             init_lora_weights="gaussian"))
        m.train()
        for layer in layers:
            fully_shard(layer)
        return fully_shard(m)

    model, ref = build(), build()
    hr.offload(model, device="cpu", store=_store(store, tmp, rank))
    trained = [[p for p in m.parameters() if p.requires_grad] for m in (model, ref)]
    opts = (hr.HostOptimizer(trained[0], torch.optim.AdamW, fused=False, lr=1e-2),
            torch.optim.AdamW(trained[1], foreach=False, lr=1e-2))
    for step in range(STEPS):
        ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(
            100 * rank + step))
        for m, o, ps in zip((model, ref), opts, trained, strict=True):
            m(input_ids=ids, labels=ids).loss.backward()
            torch.nn.utils.clip_grad_norm_(ps, 0.5)
            o.step()
            o.zero_grad()
    return {"got": _local(model), "ref": _local(ref),
            "trained": sum(p.numel() for p in trained[0]),
            "all": sum(p.numel() for p in model.parameters())}


def moves(rank: int, world: int, store: str = "cpu", tmp: str = "") -> dict:
    """``.half()``/``.double()`` of an offloaded sharded model or of one of its blocks: refused
    before anything changes; ``.to("cpu")`` and ``.float()`` (no change to the shards) allowed,
    training on bitwise like FSDP2 alone after the same calls; after ``hr.unoffload`` the model
    converts as FSDP2 lets it."""
    model, ref = _pair()
    hr.offload(model, device="cpu", store=_store(store, tmp, rank))
    before = _local(model)
    out = {"half": _error(model.half), "block_double": _error(model.layers[1].double),
           "to_bf16": _error(lambda: model.to(torch.bfloat16))}
    out["unchanged"] = all(torch.equal(v, before[k]) for k, v in _local(model).items()) and all(
        p.dtype == torch.float32 for p in model.parameters())
    okw = dict(lr=1e-2, weight_decay=0.1)
    opt = hr.HostOptimizer(model.parameters(), torch.optim.AdamW, fused=False, **okw)
    ref_opt = torch.optim.AdamW(ref.parameters(), foreach=False, **okw)
    # after the optimizer: its gradient hooks and the shards' bindings must survive the calls
    bound = [binding(p) for p in model.parameters()]
    for m in (model, ref):
        m.to("cpu")
        m.float()
    out["bindings_kept"] = all(binding(p) is b for p, b in zip(model.parameters(), bound,
                                                                  strict=True))
    early = _record_early(opt)
    for step in range(STEPS):  # each shard steps inside backward, from its gradient hook
        _step_pair(rank, model, ref, opt, ref_opt, micro=2, clip=None, step=step, final=True)
    out["early"] = sum(early)
    out["params"] = len(list(model.parameters()))
    out.update(got=_local(model), ref=_local(ref))
    opt.close()
    hr.unoffload(model)
    model.double()
    out["after_unoffload"] = all(p.dtype == torch.float64 for p in model.parameters())
    return out


def optimizer_before(rank: int, world: int, store: str = "cpu", tmp: str = "") -> dict:
    """Optimizers built before ``hr.offload`` of the sharded model: the parameter objects stay
    (their contents move to the store), so torch.optim steps the stored shards exactly (host
    memory) or refuses (disk); a HostOptimizer, which planned for where they rested, refuses.
    Both trained silently wrong before (the optimizers held replaced parameters)."""
    model, ref = _pair()
    ids = [id(p) for p in model.parameters()]
    torch_early = torch.optim.AdamW(model.parameters(), foreach=False, lr=1e-2)
    host_early = hr.HostOptimizer(model.parameters(), torch.optim.AdamW, fused=False, lr=1e-2)
    hr.offload(model, device="cpu", store=_store(store, tmp, rank))
    out = {"same_objects": [id(p) for p in model.parameters()] == ids}
    x, y = batch(rank, 0)
    F.cross_entropy(model(x), y).backward()
    before = _local(model)
    out["host"] = _error(host_early.step)
    if store != "cpu":
        out["torch"] = _error(torch_early.step)
    out["unchanged"] = all(torch.equal(v, before[k]) for k, v in _local(model).items())
    model.zero_grad(set_to_none=True)
    ref_opt = torch.optim.AdamW(ref.parameters(), foreach=False, lr=1e-2)
    opt = torch_early if store == "cpu" else hr.HostOptimizer(
        model.parameters(), torch.optim.AdamW, fused=False, lr=1e-2)
    for step in range(STEPS):
        _step_pair(rank, model, ref, opt, ref_opt, micro=1, clip=None, step=step)
    out.update(got=_local(model), ref=_local(ref))
    return out


def offload_refused_swap(rank: int, world: int, store: str = "cpu", tmp: str = "") -> dict:
    """A parameter torch cannot swap (a weakref holds it): hr.offload fails with the cause and
    the fix, and leaves the model as FSDP2 had it (training on like FSDP2 alone)."""
    import weakref

    model, ref = _pair()
    held = weakref.ref(next(model.layers[1].parameters()))
    out = {"error": _error(lambda: hr.offload(model, device="cpu",
                                              store=_store(store, tmp, rank)))}
    out["not_offloaded"] = sharded_state_of(model) is None and held() is not None
    opt = torch.optim.AdamW(model.parameters(), foreach=False, lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), foreach=False, lr=1e-2)
    for step in range(STEPS):
        _step_pair(rank, model, ref, opt, ref_opt, micro=1, clip=None, step=step)
    out.update(got=_local(model), ref=_local(ref))
    return out


def direct_access(rank: int, world: int, tmp: str) -> dict:
    """Shards on disk reached between steps as users do (``p.to_local()``, ``p.norm()``,
    ``p.full_tensor()``, an EMA's ``lerp_``, in-place ``mul_`` under ``no_grad``): the stored
    values, exactly, and writes land in the store; training then goes on like FSDP2 alone."""
    model, ref = _pair()
    hr.offload(model, device="cpu", store=_store("disk", tmp, rank))
    state = sharded_state_of(model)
    out: dict = {}

    def reads(tag: str) -> None:
        pairs = list(zip(model.parameters(), ref.parameters(), strict=True))
        out[f"{tag}_local"] = all(torch.equal(p.to_local(), q.to_local()) for p, q in pairs)
        out[f"{tag}_norm"] = all(torch.equal(p.norm().full_tensor(), q.norm().full_tensor())
                                 for p, q in pairs)
        out[f"{tag}_full"] = all(torch.equal(p.full_tensor(), q.full_tensor()) for p, q in pairs)
        out[f"{tag}_data"] = all(torch.equal(p.data.to_local().sum(), q.data.to_local().sum())
                                 for p, q in pairs)
        out[f"{tag}_at_rest"] = all(_at_rest(fp) for fp in state.params.values())

    reads("fresh")
    ema = [p.detach().clone() for p in model.parameters()]
    ema_ref = [q.detach().clone() for q in ref.parameters()]
    with torch.no_grad():
        for m in (model, ref):
            for p in m.parameters():
                p.mul_(0.5)  # written into the store
    reads("written")
    opt = hr.HostOptimizer(model.parameters(), torch.optim.AdamW, fused=False, lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), foreach=False, lr=1e-2)
    for step in range(2):
        _step_pair(rank, model, ref, opt, ref_opt, micro=1, clip=0.05, step=step)
        for e, p in zip(ema, model.parameters(), strict=True):
            e.lerp_(p, 0.1)
        for e, q in zip(ema_ref, ref.parameters(), strict=True):
            e.lerp_(q, 0.1)
    reads("trained")
    out["ema"] = all(torch.equal(e.to_local(), f.to_local())
                     for e, f in zip(ema, ema_ref, strict=True))
    out.update(got=_local(model), ref=_local(ref))
    return out


def unoffload(rank: int, world: int, store: str = "cpu", tmp: str = "") -> dict:
    """A step offloaded, hr.unoffload, a step more: as two steps of FSDP2 alone."""
    model, ref = _pair()
    hr.offload(model, device="cpu", store=_store(store, tmp, rank))
    store_ = sharded_state_of(model).store
    if store == "cpu":
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    else:  # shards on disk: the host optimizer steps them there
        opt = hr.HostOptimizer(model.parameters(), torch.optim.SGD, lr=0.1, momentum=0.9,
                               fused=False)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    _step_pair(rank, model, ref, opt, ref_opt, micro=1, clip=None, step=0)
    if store != "cpu":
        opt.close()  # its undo copies in the store
    hr.unoffload(model)
    freed = store_.used_bytes
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)  # new parameter objects
    opt.load_state_dict(copy.deepcopy(ref_opt.state_dict()))  # not ref's own buffers
    _step_pair(rank, model, ref, opt, ref_opt, micro=1, clip=None, step=1)
    return {"got": _local(model), "ref": _local(ref), "store_after": freed,
            "offloaded": int(sharded_state_of(model) is not None)}


def offload_interrupted(rank: int, world: int, store: str = "cpu", tmp: str = "") -> dict:
    """hr.offload interrupted half-way through moving the shards: nothing stays moved, then
    the model trains as FSDP2 alone, and hr.offload works on it again."""
    from headroom.residency import _dtensor

    model, ref = _pair()
    rest_in = _dtensor._rest_in
    calls = []

    def interrupted(fp, flat, *, pin):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        rest_in(fp, flat, pin=pin)

    st = _store(store, tmp, rank)
    _dtensor._rest_in = interrupted
    try:
        err = "no error"
        try:
            hr.offload(model, device="cpu", store=st)
        except KeyboardInterrupt:
            err = "KeyboardInterrupt"
    finally:
        _dtensor._rest_in = rest_in
    moved = sum(int(fp.offload_to_cpu) for _, m in _dtensor.fsdp_modules(model)
                for fp in _dtensor._fsdp_params(m))
    recorded = int(sharded_state_of(model) is not None)
    left = st.used_bytes if store != "cpu" else 0
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    _step_pair(rank, model, ref, opt, ref_opt, micro=1, clip=None, step=0)
    hr.offload(model, device="cpu", store=st)
    again = sharded_state_of(model).stored_bytes
    return {"got": _local(model), "ref": _local(ref), "error": err, "moved": moved,
            "recorded": recorded, "again": again, "left": left}


class Injected(Exception):
    pass


def failures(rank: int, world: int, tmp: str) -> dict:
    """Shards on a DiskStore: an exception in forward (after some units were read) and one in
    backward, in both models (FSDP2's own state after a failed backward is its own), then one
    in the middle of the host optimizer's writes to the disk; each iteration is run again,
    and training ends bitwise as FSDP2 alone."""
    model, ref = _pair()
    okw = dict(lr=1e-2, weight_decay=0.1)
    hr.offload(model, device="cpu", store=_store("disk", tmp, rank))
    state = sharded_state_of(model)
    opt = hr.HostOptimizer(model.parameters(), torch.optim.AdamW, fused=False, **okw)
    ref_opt = torch.optim.AdamW(ref.parameters(), foreach=False, **okw)
    out = {}

    def boom(*_):
        raise Injected

    _step_pair(rank, model, ref, opt, ref_opt, micro=1, clip=0.05, step=0)
    x, y = batch(rank, 1)
    for m, o, tag in ((model, opt, ""), (ref, ref_opt, "_ref")):
        # 1. In forward, inside layers[1] (layers 0 and 1 were read and all-gathered).
        h = m.layers[1].fc2.register_forward_pre_hook(boom)
        out["forward" + tag] = _error(lambda m=m: m(x))
        h.remove()
        m.reset_iter_state()  # FSDP2's rule after an exception in forward or backward
        out["resident_after_forward" + tag] = state.resident_bytes
        # 2. In backward, in layers[1] (the gradients of the head and layers[2] were
        # reduced, layers[0] was read for its all-gather ahead).
        h = m.layers[1].fc2.register_full_backward_hook(boom)
        out["backward" + tag] = _error(lambda m=m: F.cross_entropy(m(x), y).backward())
        h.remove()
        out["resident_before_reset" + tag] = state.resident_bytes
        m.reset_iter_state()
        out["resident_after_backward" + tag] = state.resident_bytes
        o.zero_grad()
        F.cross_entropy(m(x), y).backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05)
        if m is model:
            # 3. In the step, at the 3rd write of a shard's new values to the disk (to the
            # spare exchanged into place when the step ends; two shards already written): the
            # step is undone; then step() again.
            write_rows, calls = state.store.write_rows, []

            def failing_write_rows(handle, rows, src, write_rows=write_rows, calls=calls):
                calls.append(handle.key in state.handles or "/spare/" in handle.key)
                if sum(calls) == 3:
                    raise OSError(5, "injected I/O error")
                return write_rows(handle, rows, src)

            state.store.write_rows = failing_write_rows
            try:
                out["step"] = _error(opt.step)
            finally:
                del state.store.write_rows
            out["undone"] = int(all(torch.equal(a, b) for a, b in zip(
                _local(model).values(), _local(ref).values(), strict=True)))  # ref: step 0
        o.step()
        o.zero_grad()
    _step_pair(rank, model, ref, opt, ref_opt, micro=1, clip=0.05, step=2)
    out.update(got=_local(model), ref=_local(ref), resident=state.resident_bytes,
               unit_bytes=sum(p.to_local().nbytes for p in model.layers[0].parameters()))
    return out
