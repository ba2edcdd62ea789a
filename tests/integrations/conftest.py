"""Tests with the training stacks people use: tiny models, one intra-op thread."""

import pytest


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield
