"""`claimed_keys`: which keys of a store are in use by a live owner (a model, a head)."""

from __future__ import annotations

from headroom.store._store import Store

__all__ = ["claimed_keys"]

_ATTR = "_headroom_claimed"


def claimed_keys(store: Store) -> set[str]:
    """The mutable set (not a copy) of ``store``'s keys that a live owner uses, kept on the
    store object so that it lives and dies with the store.

    [Note: one writer per key] A store key has one live owner (an offloaded model or a huge
    classifier head); a second one is refused: two owners binding one key would silently share
    (and both train) one set of values. Owners add their keys here when they bind them, refuse
    a key already in the set, and discard theirs when they let go (``hr.unoffload``, a
    `HugeClassifier` collected). Keys stay in the store, so a new owner can resume their values.
    """
    return vars(store).setdefault(_ATTR, set())
