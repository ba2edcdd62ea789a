"""A process for the activation-offload kill test: it keeps a tensor in a DiskStore, then
trains with activations offloaded to the same store and stops in the middle of a forward
(printing ``mid-forward``) for the parent to SIGKILL it.

Run as ``python _kill_child.py FOLDER``.
"""

from __future__ import annotations

import sys
import time

import torch
import torch.nn as nn

import headroom as hr
from headroom.store import DiskStore


def main() -> None:
    torch.manual_seed(0)
    store = DiskStore(sys.argv[1], threads=2)
    store.put("keep", torch.arange(1024.0))
    store.flush()
    model = nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.Tanh()) for _ in range(8)])
    x = torch.randn(64, 256)
    with hr.offload_activations(store=store, min_bytes=0):
        model(x).sum().backward()  # a whole step: the stash's files exist and are reused

        def stop(module, args, out):
            print("mid-forward", flush=True)
            time.sleep(600)

        model[5].register_forward_hook(stop)
        model(x).sum().backward()


if __name__ == "__main__":
    main()
