"""The memory tracker gets its report's advice from the provider `headroom.fit` registers."""

from __future__ import annotations

import io

import torch
from torch import nn

import headroom as hr
from headroom import _providers


def test_report_advice_comes_from_the_registered_provider():
    model = nn.Linear(8, 8)
    seen = {}

    def provider(model_, args, **kwargs):
        seen.update(kwargs, model=model_, args=args)
        return ["advice from the provider"]

    try:
        _providers.set_advice_provider(provider)
        with hr.track_memory() as mem:
            model(torch.randn(4, 8)).sum().backward()
        assert "advice from the provider" in mem.report(file=io.StringIO())
        assert seen["model"] is model and seen["args"][0].device.type == "meta"
    finally:
        _providers.set_advice_provider(None)


def test_the_default_provider_is_fits():
    from headroom.fit._advice import advise

    _providers.set_advice_provider(None)
    assert _providers.advice_provider() is advise


def test_offload_loads_the_integrations_that_subscribe_to_its_events():
    # residency/ never imports integrations/ (above it): the first hr.offload loads it through
    # the loader the package root set, and its subscribers are in place for that model
    import subprocess
    import sys

    code = """
import sys, warnings
import torch.nn as nn
from headroom.residency import events, offload
assert "headroom.integrations" not in sys.modules
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    model = offload(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), device="cpu", store="cpu")
from headroom.integrations import _ddp, _peft
print("headroom.integrations" in sys.modules, _ddp._under_ddp in events.before_forward,
      _peft.sync_merges.__module__, sorted(events.guard_members),
      "_ddp_params_and_buffers_to_ignore" in type(model).__dict__)
"""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True)
    assert run.stdout.split() == ["True", "True", "headroom.integrations._peft",
                                  "['_ddp_params_and_buffers_to_ignore']", "True"], run.stderr
