"""What every scenario uses: content fixed by the key, the report, hit checks, one collection."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import random
import traceback
from dataclasses import asdict, dataclass, field
from typing import Any

from blake3 import blake3

from cuda_program_cas import CollectorBusyError, collect
from cuda_program_cas.index import key_id

#: Keys ``k0 .. k{N_KEYS-1}``; key ``i`` holds the content of seed ``i % N_SEEDS``,
#: so some keys share a blob (deduplication is exercised too).
N_KEYS = 400
N_SEEDS = 250
#: A cap small enough that the mixed load evicts all the time (about 40 average blobs).
DEFAULT_CAP = 256 * 1024
HEX = frozenset("0123456789abcdef")


# -- deterministic content ------------------------------------------------------


def key_name(i: int) -> str:
    return f"torture-key-{i}"


def seed_of(i: int) -> int:
    return i % N_SEEDS


def content_of_seed(seed: int) -> bytes:
    """The bytes of one seed: blake3 of its name, expanded to 64 .. 16,447 bytes."""
    name = b"torture-content-%d" % seed
    size = 64 + int.from_bytes(hashlib.sha256(name).digest()[:4], "little") % 16384
    return blake3(name).digest(length=size)


_CONTENT: dict[int, bytes] = {}


def content(i: int) -> bytes:
    seed = seed_of(i)
    data = _CONTENT.get(seed)
    if data is None:
        data = _CONTENT[seed] = content_of_seed(seed)
    return data


def expected_digests() -> dict[str, str]:
    """key id -> the digest its manifest must name, for every torture key."""
    return {key_id(key_name(i)): blake3(content(i)).hexdigest() for i in range(N_KEYS)}


def pick(rng: random.Random) -> int:
    """A key index, skewed towards low numbers: a hot set that fits under the cap, so hits are common."""
    return min(N_KEYS - 1, int(N_KEYS * rng.random() ** 3))


def as_key(i: int, rng: random.Random) -> str | bytes:
    """``str`` and ``bytes`` keys are the same key: use both."""
    name = key_name(i)
    return name.encode() if rng.random() < 0.5 else name


# -- reports --------------------------------------------------------------------


@dataclass
class Report:
    """Figures of one scenario; ``failures`` lists what makes it fail."""

    scenario: str
    processes: int = 0
    seconds: float = 0.0
    operations: int = 0
    hits: int = 0
    misses: int = 0
    writes: int = 0
    dropped_writes: int = 0
    collections: int = 0
    kills: int = 0
    faults: int = 0
    wrong_bytes: int = 0
    exceptions: int = 0
    checks: int = 0
    notes: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    skipped: str | None = None

    @property
    def ok(self) -> bool:
        return not self.failures and self.wrong_bytes == 0 and self.exceptions == 0

    def fail(self, message: str) -> None:
        if len(self.failures) < 50 and message not in self.failures:
            self.failures.append(message)

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["ok"] = self.ok
        return out


def check_hit(i: int, data: bytes | None, rep: Report, where: str) -> None:
    """Count a lookup; a hit must be exactly the key's content."""
    rep.operations += 1
    if data is None:
        rep.misses += 1
        return
    rep.hits += 1
    want = content(i)
    if data != want:
        rep.wrong_bytes += 1
        first = next((n for n, (a, b) in enumerate(zip(data, want, strict=False)) if a != b), min(len(data), len(want)))
        rep.fail(
            f"{where}: WRONG BYTES for {key_name(i)}: got {len(data)} bytes, want {len(want)}; first diff at {first}"
        )


def unexpected(rep: Report, where: str, exc: BaseException) -> None:
    rep.exceptions += 1
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)[-3:]).strip()
    rep.fail(f"{where}: unexpected {type(exc).__name__}: {exc} | {tb}")


# -- the collector ------------------------------------------------------------------


def collect_once(root: str, cap: int | None, rng: random.Random, *, shared_store: bool = False) -> None:
    """One collection with ``cuda_program_cas.collect``, with a short grace.

    A shared store is collected half the time as its operator should (shared
    mode, the long grace it demands) and half the time as a careless one would
    (as a plain cache, with a grace of seconds): readers must never get wrong
    bytes either way, only misses.
    """
    kwargs: dict[str, Any] = {"max_size": cap, "verify": rng.random() < 0.2}
    if not shared_store:
        kwargs["grace_s"] = rng.choice((0.0, 0.5, 5.0))
    elif rng.random() < 0.5:
        kwargs.update(grace_s=rng.choice((0.0, 0.5, 5.0)), shared=False)
    else:
        kwargs["grace_s"] = 3600.0
    with contextlib.suppress(CollectorBusyError):  # another collector or an evictor holds the lock
        collect(root, **kwargs)


def quiet() -> None:
    """Corruption is logged as warnings by design; a torture run makes thousands."""
    logging.getLogger("cuda_program_cas").setLevel(logging.ERROR)
