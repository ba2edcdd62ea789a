"""Planner tests: dry runs of tiny models, run on one intra-op thread (see `one_thread`);
measured speeds (when a test does not declare them) go to a temporary cache."""

import pytest


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


@pytest.fixture(autouse=True)
def _speeds_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.getbasetemp() / "cache"))
    yield
