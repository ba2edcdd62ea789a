"""``headroom estimate`` and ``headroom plan``: a Hugging Face model from its config, a batch
shape, and the estimate (and plan) of one training step, without downloading any weights."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

_OPTIMIZERS = {"adamw": "AdamW", "adam": "Adam", "sgd": "SGD", "adagrad": "Adagrad",
               "rmsprop": "RMSprop", "none": None}
_DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
           "float16": "float16", "fp16": "float16"}


def add_parsers(sub: Any) -> None:
    """Add ``estimate`` and ``plan`` to the ``headroom`` command's subparsers."""
    for name, help_text in (
        ("estimate", "estimate the memory of one training step of a Hugging Face model from its"
                     " config (a dry run: no weights, no memory); with --budget, also a plan"),
        ("plan", "choose what to turn on so a training step fits --budget; print the plan and"
                 " the Python that applies it"),
    ):
        p = sub.add_parser(name, help=help_text, description=help_text)
        src = p.add_mutually_exclusive_group(required=True)
        src.add_argument("--config", help="a config.json file (or a folder holding one)")
        src.add_argument("--model", help="a Hugging Face model id whose config is in the local"
                                         " cache (nothing is downloaded)")
        p.add_argument("--batch", type=int, default=1, help="batch size (default 1)")
        p.add_argument("--seq", type=int, default=512, help="sequence length (default 512)")
        p.add_argument("--device", default="cuda", help="device to estimate for (default cuda)")
        p.add_argument("--optimizer", default="adamw", choices=sorted(_OPTIMIZERS),
                       help="optimizer (default adamw)")
        p.add_argument("--dtype", default="float32", choices=sorted(_DTYPES),
                       help="dtype of the parameters (default float32)")
        p.add_argument("--budget", required=name == "plan",
                       help="device memory for the step, e.g. 8GiB" +
                            (" (with estimate: also print a plan)" if name == "estimate" else ""))
        p.add_argument("--disk", help="a folder the plan may put stores in")
        p.add_argument("--world-size", type=int, default=None,
                       help="one rank of FSDP2 over this many ranks (fully_shard of each block"
                            " and the root); the budget is each rank's")
        p.add_argument("--fp32-masters", action=argparse.BooleanOptionalAction, default=None,
                       help="with --dtype bfloat16/float16: only plans training from fp32"
                            " masters (hr.HostOptimizer), or only plans bitwise the plain step"
                            " (default: either)")
        p.add_argument("--lm-loss", action=argparse.BooleanOptionalAction, default=None,
                       help="only plans with a causal LM's loss without logits"
                            " (hr.patch_causal_lm, equal to rounding), or only without"
                            " (default: with it only where nothing without it fits)")
        p.add_argument("--json", dest="json_out", help="also write the estimate as JSON here")
        if name == "estimate":
            p.add_argument("--no-advice", action="store_true",
                           help="skip the advice (a few more dry runs) at the end of the table")
        p.set_defaults(func=_run, command_name=name)


def _run(args: argparse.Namespace) -> int:
    def fail(message: Any, code: int) -> int:
        print(f"headroom {args.command_name}: {message}", file=sys.stderr)
        return code

    if args.batch < 1 or args.seq < 1:
        return fail("--batch and --seq must be at least 1", 2)
    if args.world_size is not None and args.world_size < 1:
        return fail("--world-size must be at least 1", 2)
    try:
        model, config, how = _model(args)
    except (OSError, ValueError, ImportError) as e:
        return fail(e, 2)
    import torch

    import headroom as hr
    from headroom.memory import format_bytes

    opt_name = _OPTIMIZERS[args.optimizer]
    optimizer = getattr(torch.optim, opt_name) if opt_name else None
    vocab = int(getattr(config, "vocab_size", 0) or 0)
    # NOTE: real (all-zero) ids: the dry run reads integer inputs' values, as the loss does
    ids = torch.zeros(args.batch, args.seq, dtype=torch.long)
    kwargs = {"input_ids": ids, "labels": ids} if vocab else {"input_ids": ids}
    try:
        est = hr.estimate(model, (), example_kwargs=kwargs, optimizer=optimizer,
                          device=args.device, world_size=args.world_size)
    except (RuntimeError, TypeError, ValueError) as e:
        return fail(f"the dry run failed: {e}", 1)
    print(f"{type(model).__name__} from {how}: {_count(model)} parameters ({args.dtype}),"
          f" batch {args.batch} x {args.seq} tokens, optimizer {args.optimizer},"
          f" device {est.device}"
          + (f", one of {args.world_size} FSDP2 ranks" if args.world_size else ""))
    if args.command_name == "estimate":
        est.report(advice=not args.no_advice)
    else:
        print(f"estimated peak of the plain step: {format_bytes(est.peak)}"
              + (f" (allocator model: reserved {format_bytes(est.peak_reserved)})"
                 if est.allocator else ""))
    if args.json_out:
        est.to_json(args.json_out)
    if args.budget is None:
        return 0
    if optimizer is None:
        return fail("a plan needs an optimizer (--optimizer adamw, sgd, ...)", 2)
    from headroom.fit import PlanError, plan

    try:
        p = plan(model, (), example_kwargs=kwargs, budget=args.budget, device=args.device,
                 optimizer=optimizer, disk=args.disk, world_size=args.world_size,
                 fp32_masters=args.fp32_masters, lm_loss=args.lm_loss)
    except ValueError as e:  # a PlanError (nothing fits) or bad input
        return fail(e, 1 if isinstance(e, PlanError) else 2)
    print()
    print(p)
    if args.command_name == "plan":
        print()
        print("# apply it:")
        print(_build_code(args, how, type(model).__name__))
        print(p.code())
    return 0


def _model(args: argparse.Namespace):
    try:
        import transformers
    except ImportError as e:  # pragma: no cover - transformers is optional
        raise ImportError("this command needs the transformers package") from e
    import torch

    if args.config:
        path = Path(args.config)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise ValueError(f"no such config file: {path}")
        try:
            data = json.loads(path.read_text())
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{path} is not JSON ({_one_line(e)}): pass a Hugging Face"
                             " config.json") from None
        if not isinstance(data, dict) or "model_type" not in data:
            raise ValueError(f"{path} has no \"model_type\": is it a Hugging Face config.json?")
        how = str(path)
        try:
            config = transformers.AutoConfig.for_model(**data)
        except Exception as e:  # noqa: BLE001 - transformers/hub validation raise many kinds
            raise ValueError(f"{path} is not a valid {data['model_type']!r} config:"
                             f" {_one_line(e)}") from None
    else:
        try:
            config = transformers.AutoConfig.from_pretrained(args.model, local_files_only=True)
        except OSError as e:
            raise ValueError(
                f"no config for {args.model!r} in the local Hugging Face cache (nothing is"
                " downloaded): download its config.json and pass --config"
            ) from e
        except Exception as e:  # noqa: BLE001 - transformers/hub validation raise many kinds
            raise ValueError(f"the cached config of {args.model!r} is not valid:"
                             f" {_one_line(e)}") from None
        how = args.model
    # beyond it learned position tables index out of range: no model that runs
    limit = getattr(config, "max_position_embeddings", None)
    if isinstance(limit, int) and not isinstance(limit, bool) and args.seq > limit:
        raise ValueError(
            f"--seq {args.seq} is longer than the {limit} positions {how} allows"
            f" (max_position_embeddings / n_positions): pass --seq {limit} or less, or raise"
            " the limit in the config"
        )
    dtype = getattr(torch, _DTYPES[args.dtype])
    cls = _model_class(transformers, config)
    previous = torch.get_default_dtype()
    try:
        torch.set_default_dtype(dtype)
        with torch.device("meta"):
            model = cls.from_config(config) if hasattr(cls, "from_config") else cls(config)
    except Exception as e:  # noqa: BLE001 - a model's own checks raise many kinds
        raise ValueError(f"cannot build a model from {how}: {_one_line(e)}; fix the config") from e
    finally:
        torch.set_default_dtype(previous)
    return model, config, how


def _one_line(e: BaseException) -> str:  # hub validation errors span several lines
    return " ".join(str(e).split()) or type(e).__name__


def _model_class(transformers: Any, config: Any) -> Any:
    for arch in getattr(config, "architectures", None) or []:
        cls = getattr(transformers, arch, None)
        if cls is not None:
            return cls
    for auto in ("AutoModelForCausalLM", "AutoModelForMaskedLM", "AutoModel"):
        mapping = getattr(transformers, auto)
        try:
            mapping._model_mapping[type(config)]
            return mapping
        except KeyError:
            continue
    return transformers.AutoModel


def _build_code(args: argparse.Namespace, how: str, cls: str) -> str:
    load = (f"for_model(**json.load(open({how!r})))" if args.config
            else f"from_pretrained({how!r})")
    return (f"import json\nimport transformers\nconfig = transformers.AutoConfig.{load}\n"
            f"model = transformers.{cls}(config)  # or load your weights")


def _count(model: Any) -> str:
    n = sum(p.numel() for p in model.parameters())
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(n)
