"""Framework integration tests: tiny models, run on one intra-op thread (see `one_thread`)."""

import pytest


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield
