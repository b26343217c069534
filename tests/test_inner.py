"""``store.inner``, what the CUDA layer asks of a store beyond its public API: the store's own
methods (or its local cache's) with nothing in between, and never kept by the store (so that it
still goes with its last reference, recording its counts)."""

from __future__ import annotations

import gc
from contextlib import ExitStack
from pathlib import Path

from test_counters import ZERO, counters_of

from cuda_program_cas import CacheStore
from cuda_program_cas._store.store import Inner
from cuda_program_cas.index import key_id


def test_its_methods_are_the_store_s_own_bound_with_nothing_in_between(tmp_path: Path) -> None:
    store = CacheStore(tmp_path / "c")
    inner = store.inner
    methods = [n for n in Inner.__slots__ if n not in ("layout", "shared", "shared_paths", "store", "warm")]
    assert methods
    for name in methods:
        bound = getattr(inner, name)
        owner = bound.__self__  # the store (what it composes: find, claim, put) or its local cache (the rest)
        assert owner is store or owner is store._local, name
        assert bound.__func__ is getattr(type(owner), "_" + name if owner is store else name), name
    assert inner.store is store and inner.layout.root == store.root and inner.shared == ()
    assert inner.shared_paths() == ()


def test_what_it_counts_is_the_store_s(tmp_path: Path) -> None:
    store = CacheStore(tmp_path / "c")
    inner = store.inner
    kid = key_id(b"k")
    assert inner.put_id(kid, b"v")
    with ExitStack() as claims:
        found = inner.find_or_claim(kid, claims)
    assert found == (b"v", None)
    assert store.get(b"k") == b"v"
    assert inner.find(key_id(b"other")) is None  # counts nothing
    inner.note_switched()
    assert {k: store.counters()[k] for k in ("hits", "misses", "writes", "switched")} == {
        "hits": 2,
        "misses": 0,
        "writes": 1,
        "switched": 1,
    }
    assert inner.delete_id(kid) and store.get(b"k") is None


def test_the_store_keeps_none_so_it_still_goes_with_its_last_reference(tmp_path: Path) -> None:
    root = tmp_path / "c"
    gc.disable()  # the store goes with its last reference, not with a garbage collection
    try:
        store = CacheStore(root)
        inner = store.inner
        inner.put_id(key_id(b"k"), b"v")
        assert store.inner.find(key_id(b"k")) is not None
        assert store.get(b"k") == b"v"
        del inner
        del store
        assert counters_of(root) == {**ZERO, "hits": 1, "writes": 1}
    finally:
        gc.enable()
