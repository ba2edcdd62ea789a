"""What a store says it is: code above ``transfer/`` asks these, never the class."""

import headroom as hr
from headroom.store import HostStore


def test_host_store_is_host_memory_and_not_durable():
    st = HostStore()
    assert st.holds_host_memory and not st.durable


def test_disk_store_is_durable_and_not_host_memory(tmp_path):
    st = hr.DiskStore(tmp_path / "s")
    assert st.durable and not st.holds_host_memory
