"""Uploads into a store over its engine, written once: each object read back before anything names it.

Publish and write-back both send through here, to any engine
(:mod:`cuda_program_cas._base.engine`: a directory, WebDAV, Redis):

- :func:`put_checked` stores one object and reads it back at once (not on a
  directory, where the write protocol itself wrote and renamed the file: a read
  could only meet a collector that took it since, which publish's re-check after
  each manifest handles). An engine's
  answer (``201 to PUT``, ``OK to SET``) is a claim, not a proof: a server may
  answer 201 and keep nothing or a part (a stub, a proxy that drops bodies, a full
  disk behind a cache). A blob is read back by its size (HEAD, ``STRLEN``, a
  stat: downloading it again would double the bytes); a small file (a manifest,
  ``layout.json``) by every byte. A store that holds something else raises a
  :class:`~cuda_program_cas._base.engine.StoreFailure` of kind ``not stored``
  naming the object, and nothing is sent that would name it.
- :func:`upload_entry` sends one entry: its blob, read back, then the manifest
  that names it. Where the engine's ``put_many`` is one transaction (Redis), blob
  and manifest go in it, blob first: a reader sees both or neither, and one round
  trip carries the entry. Publish sends the same two puts, in phases (every blob
  of a run, one ``syncfs`` on a directory, then every manifest), with the
  manifest read back too, since its report says what the store holds.
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
