"""``nn.Linear`` (whose node saves the input only if the weight trains, already) reporting that
to the ReLU before it, which can then keep a 1-bit mask instead of its output."""

from __future__ import annotations

import torch
from torch import nn

from headroom.nn._common import note_consumer, records_graph, settle_pending, trains


class Linear(nn.Linear):
    """``nn.Linear``, unchanged, that tells the ReLU before it whether it keeps its input."""

    def _hr_saves_input(self) -> bool:
        return trains(self)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if records_graph():
            settle_pending()
            if input.requires_grad:
                note_consumer(self, input)
        return super().forward(input)
