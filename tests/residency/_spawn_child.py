"""Child of test_offload_lifetime's spawn test: imports torch only (not headroom), so what it
receives must load as plain PyTorch. Reports through ``conn``, one line per check."""

from __future__ import annotations

import sys

import torch
import torch.nn as nn


def check(models: dict[str, nn.Module], params: list[torch.Tensor],
          expected: dict[str, dict[str, torch.Tensor]], conn) -> None:
    try:
        out = []
        for name, model in models.items():
            sd = model.state_dict()
            same = set(sd) == set(expected[name]) and all(
                torch.equal(sd[k], v) for k, v in expected[name].items())
            plain = type(model) is nn.Sequential and not any(
                k.startswith("_headroom") for m in model.modules() for k in vars(m))
            out.append(f"{name}: equal={same} plain={plain}")
        kinds = {type(p).__name__ for p in params}
        same = all(torch.equal(p, v) for p, v in zip(params, expected["disk"].values(),
                                                     strict=True))
        out.append(f"params: {sorted(kinds)} equal={same}")
        out.append(f"headroom imported={'headroom' in sys.modules}")
        conn.send(out)
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        conn.send([f"{type(e).__name__}: {e}"])
