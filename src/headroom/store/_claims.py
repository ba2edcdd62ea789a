"""`claimed_keys`: which keys of a store are in use by a live owner (a model, a head)."""

from __future__ import annotations

from headroom.store._store import Store

__all__ = ["claimed_keys"]

_ATTR = "_headroom_claimed"


def claimed_keys(store: Store) -> set[str]:
    """The mutable set of ``store``'s keys that a live owner uses.

    [Note: one writer per key] A store key has one live owner (an offloaded model or a huge
    classifier head); a second one is refused.

    A store key holds one tensor; two owners that both bind it would silently share (and both
    train) one set of values. Owners add their keys here when they bind them and discard them
    when they let go (``hr.unoffload``, or a `HugeClassifier` being garbage-collected), and
    refuse a key that is already in the set. Keys stay in the store after their owner is gone,
    so a new owner can resume their values (a reopened `DiskStore`).

    Args:
        store: any store.

    Returns:
        The set itself (not a copy), kept on the store object.

    Example:
        >>> from headroom.store import HostStore
        >>> claimed_keys(HostStore())
        set()
    """
    # Kept on the store object (not in a global registry) so it lives and dies with the
    # store, and under the attribute name hr.offload's own registry has always used, so claims
    # made by hr.offload and by HugeClassifier see each other.
    keys = getattr(store, _ATTR, None)
    if keys is None:
        keys = set()
        setattr(store, _ATTR, keys)
    return keys
