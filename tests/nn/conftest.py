"""headroom.nn tests run their tiny layers on one thread.

# NOTE: the layers here are a few kilobytes; with several intra-op threads on a busy machine the
# OpenMP barriers dominate (100x slower). Results do not depend on it: exactness is compared
# within one process under the same setting.
"""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
