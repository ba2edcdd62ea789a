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
