"""Child process of test_offload_threads: one thread trains an offloaded model while another
runs inference on it (a crash there must not take pytest down). Prints "ok" and exits 0 when
every training step and every inference output is bitwise plain PyTorch's."""

from __future__ import annotations

import sys
import threading
import warnings

import torch
import torch.nn as nn

import headroom as hr

STEPS = 12
X = torch.randn(8, 32, generator=torch.Generator().manual_seed(7))


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(6)],
                         nn.Linear(32, 4))


def batches():
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(16, 32, generator=g), torch.randn(16, 4, generator=g))
            for _ in range(STEPS)]


def step(model, opt, batch) -> None:
    x, y = batch
    (model(x) - y).square().mean().backward()


def main(store_kind: str, folder: str) -> int:
    torch.set_num_threads(1)
    ref = make_model()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    expected = []  # inference output after k steps
    with torch.no_grad():
        expected.append(ref(X))
    for b in batches():
        step(ref, ref_opt, b)
        ref_opt.step()
        ref_opt.zero_grad()
        with torch.no_grad():
            expected.append(ref(X))

    model = make_model()
    store = "cpu" if store_kind == "cpu" else hr.DiskStore(folder)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # device=cpu with store=cpu: mechanics only
        hr.offload(model, device="cpu", store=store)
    opt = hr.HostOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2)
    # An optimizer step is not ordered against another thread's forward (in plain PyTorch
    # neither): an inference output is checked when no step ran during its forward.
    started, finished = [0], [0]
    done = threading.Event()
    seen: list[tuple[int, torch.Tensor]] = []
    skipped = [0]
    errors: list[str] = []

    def train() -> None:
        try:
            for b in batches():
                step(model, opt, b)
                started[0] += 1
                opt.step()
                finished[0] += 1
                opt.zero_grad()
        except BaseException as e:
            errors.append(f"train: {e!r}")
        finally:
            done.set()

    def infer() -> None:
        try:
            while not done.is_set() and len(seen) < 5000:
                before = (started[0], finished[0])
                with torch.no_grad():
                    out = model(X)
                if before == (started[0], finished[0]) == (before[1], before[1]):
                    seen.append((before[1], out))
                else:
                    skipped[0] += 1
        except BaseException as e:
            errors.append(f"infer: {e!r}")

    threads = [threading.Thread(target=train), threading.Thread(target=infer)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    if any(t.is_alive() for t in threads):
        print("a thread did not finish within 120 s")
        return 1
    if errors:
        print("; ".join(errors))
        return 1
    wrong = [k for k, out in seen if not torch.equal(out, expected[k])]
    if wrong:
        print(f"{len(wrong)} of {len(seen)} inference outputs differ (after steps {wrong[:5]})")
        return 1
    sd = model.state_dict()
    for name, p in ref.named_parameters():
        if not torch.equal(sd[name], p):
            print(f"parameter {name} differs from plain training")
            return 1
    n_steps = len({k for k, _ in seen})
    print(f"ok ({store_kind}): {len(seen)} inference outputs checked over {n_steps} steps,"
          f" {skipped[0]} overlapping a step")
    return 0


if __name__ == "__main__":
    # each store kind given, in this one process (the import is most of its time)
    sys.exit(max(main(kind, f"{sys.argv[1]}-{kind}") for kind in sys.argv[2:]))
