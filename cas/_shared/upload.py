"""Uploads into a store over its engine, written once (publish and write-back): each object read back
before anything names it.

An engine's answer (201 to PUT, OK to SET) is a claim, not a proof: a server may keep nothing
or a part (a stub, a proxy that drops bodies, a full disk). So :func:`put_checked` reads back a
blob by its size (HEAD, ``STRLEN``: a download would double the bytes) and a small file by every
byte; a directory's write protocol is its own proof. What the store does not hold raises a
``StoreFailure`` of kind ``not stored``. :func:`upload_entry` sends a blob, read back, then the
manifest naming it; where ``put_many`` is one transaction (Redis), both in it, blob first.
"""

from __future__ import annotations

from collections.abc import Callable

from cuda_program_cas._base.engine import Engine, StoreFailure, not_stored
from cuda_program_cas._base.frame import encode
from cuda_program_cas._disk.layout import BLOBS, INDEX, url_path

__all__ = ["put_checked", "upload_entry", "where"]


def where(engine: Engine, name: str) -> str:
    """The object ``name`` of the store as a message may show it (no credentials)."""
    return f"{engine.shown.rstrip('/')}/{name}"


def put_checked(
    engine: Engine, name: str, data: bytes, *, whole: bool, accept: Callable[[bytes], bool] | None = None
) -> None:
    """Store ``data`` as ``name``, then read it back: every byte (``whole``), or its size.

    ``accept``: what else the object may hold (another writer's valid object, stored at the same moment).
    """
    answer = engine.put(name, data)
    if engine.can.puts_proven:
        return

    def lost(held: int | None, *, other: bool = False) -> StoreFailure:
        return not_stored(where(engine, name), answer, len(data), held, hint=engine.lost_hint, other=other)

    if not whole:
        held_size = engine.size(name)
        if held_size == -1:
            detail = f"the server answered {answer} but says no size (no Content-Length): cannot check it"
            raise StoreFailure(where(engine, name), "not stored", detail, outage=False)
        if held_size != len(data):
            raise lost(held_size)
        return
    try:
        held = engine.get(name, limit=len(data))
    except StoreFailure as exc:
        if exc.kind != "too large":
            raise
        raise lost(-1) from None
    if held == data or (held is not None and accept is not None and accept(held)):
        return
    if held is None or len(held) != len(data):
        raise lost(None if held is None else len(held))
    raise lost(len(held), other=True)


def upload_entry(engine: Engine, kid: str, digest: str, blob: bytes, manifest: bytes) -> None:
    """One entry into the store: its blob, compressed (:func:`~cuda_program_cas._base.frame.encode`) and read back
    by its size, then the manifest ``manifest`` naming it (the raw blob's digest and size)."""
    blob_name, manifest_name = url_path(BLOBS, digest), url_path(INDEX, kid)
    blob = encode(blob)  # compressed once, here, for every node that reads it
    if engine.can.atomic_batch:
        engine.put_many([(blob_name, blob), (manifest_name, manifest)])
        return
    put_checked(engine, blob_name, blob, whole=False)
    engine.put(manifest_name, manifest)
