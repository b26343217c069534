"""The S3 engine against a real S3 server (SeaweedFS's ``weed``, with credentials): objects, bounds, leases, stores.

One ``weed server -s3`` serves the module (``tools/testkit/weed.py``); each test works under a prefix
of its own (its tmp directory's name) in the bucket ``cas``. The client's environment is set
per test (``AWS_ENDPOINT_URL_S3``, the keys, the region; the user's AWS files ignored). What
the bucket holds is read back by the server helper's own botocore client, never by the engine
under test.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path

import pytest
from conftest import Compiles, compile_program
from testkit.weed import SECRET_KEY, WeedServer, weed_or_skip

from cuda_program_cas import CacheStore, ContentAddressedProgramCache, digest_of, publish
from cuda_program_cas._base.engine import LEASE_MARK, StoreFailure
from cuda_program_cas._base.urls import normalize_store_url
from cuda_program_cas._disk.layout import BLOBS, url_path
from cuda_program_cas._disk.packset import parse_listing
from cuda_program_cas._remote import client
from cuda_program_cas._remote.s3 import S3Engine


@pytest.fixture(scope="module")
def weed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WeedServer]:
    server = weed_or_skip(tmp_path_factory.mktemp("weed"))
    yield server
    server.stop()


@pytest.fixture(autouse=True)
def aws(weed: WeedServer, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[dict[str, str]]:
    """The server's environment for this test, a fresh pool, and long-enough timeouts."""
    env = weed.env()
    for name in [k for k in os.environ if k.startswith("AWS_")]:
        monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv(client.ENV_HTTP_TIMEOUT, "2,5")
    client.close_connections()
    yield env
    client.close_connections()


@pytest.fixture
def prefix(tmp_path: Path) -> str:
    return tmp_path.name.lower().replace("_", "-")


def test_addresses_are_checked_and_shown_without_secrets() -> None:
    assert normalize_store_url("s3://cas/a/b/") == "s3://cas/a/b"
    assert normalize_store_url("s3://cas") == "s3://cas"
    for bad in ("s3://Bad_Bucket/x", "s3://key:secret@cas/x", "s3://cas:9000/x", "s3://cas/x?y=1", "s3://cas/a//b"):
        with pytest.raises(ValueError):
            normalize_store_url(bad)
    e = S3Engine("s3://cas/p")
    assert e.shown == "s3://cas/p"
    assert e.root.endswith("/cas/p") and e.root.startswith("http://127.0.0.1:")  # an IP endpoint: path-style
    assert SECRET_KEY not in repr(e) and SECRET_KEY not in e.shown


@pytest.mark.parametrize("where", ["environment", "profile's services section"])
def test_a_configured_endpoint_is_read_as_botocore_reads_it_without_making_a_client(
    weed: WeedServer, prefix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """A client loads S3's model (0.1 to 0.2 s, each AWS environment: a cold node's warm set from weed cost that
    much more than from nginx); the endpoint a configuration names is read without one, and is the client's."""
    import botocore.session

    if where != "environment":
        monkeypatch.delenv("AWS_ENDPOINT_URL_S3")
        config = tmp_path / "config"
        config.write_text(f"[default]\nservices = here\n[services here]\ns3 =\n  endpoint_url = {weed.endpoint}/\n")
        monkeypatch.setenv("AWS_CONFIG_FILE", str(config))
    monkeypatch.setenv("AWS_DEFAULT_REGION", "eu-west-3")
    made = botocore.session.Session().create_client("s3")
    expected = (made.meta.endpoint_url.rstrip("/"), made.meta.region_name)

    def no_client(*args: object, **kwargs: object) -> None:
        raise AssertionError("an S3 client was made")

    monkeypatch.setattr(botocore.session.Session, "create_client", no_client)
    engine = S3Engine(f"s3://cas/{prefix}")
    assert engine.broken is None and engine.aws is not None
    assert (engine.aws.endpoint, engine.aws.region) == expected == (weed.endpoint, "eu-west-3")
    engine.put("blobs/ab/x", b"signed with it")
    assert engine.get("blobs/ab/x", limit=100) == b"signed with it"


@pytest.mark.parametrize("endpoint", ["127.0.0.1:9000", "http://exa mple"])
def test_an_endpoint_a_client_refuses_makes_the_store_broken_as_before(
    monkeypatch: pytest.MonkeyPatch, endpoint: str
) -> None:
    """A configured endpoint without a scheme, or with a host no URL has: botocore's client refuses it (``Invalid
    endpoint``); read without a client it was taken as it is, and requests (signed) went to it over plain HTTP."""
    import botocore.session

    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", endpoint)
    with pytest.raises(ValueError, match="Invalid endpoint") as refused:
        botocore.session.Session().create_client("s3")
    engine = S3Engine("s3://cas/p")
    assert engine.aws is None and engine.broken is not None
    assert str(refused.value) in str(engine.broken)
    with pytest.raises(StoreFailure, match="aws configuration"):
        engine.get("index/ab/cdef", limit=100)


@pytest.mark.parametrize("region", ["eu west", "-bad", "../x"])
def test_a_region_a_client_refuses_makes_the_store_broken_with_a_configured_endpoint(
    monkeypatch: pytest.MonkeyPatch, region: str
) -> None:
    """botocore's client refuses a region that is not a host label (``InvalidRegionError``) before it resolves an
    endpoint; read without a client, it was taken as it is and signed into every request's scope."""
    import botocore.exceptions
    import botocore.session

    monkeypatch.setenv("AWS_DEFAULT_REGION", region)
    with pytest.raises(botocore.exceptions.InvalidRegionError) as refused:
        botocore.session.Session().create_client("s3")
    engine = S3Engine("s3://cas/p")
    assert engine.aws is None and engine.broken is not None
    assert str(refused.value) in str(engine.broken)


def test_without_an_endpoint_it_is_aws_own_for_the_region_addressed_by_virtual_host(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "eu-west-3")
    engine = S3Engine("s3://cas/p")
    assert engine.root == "https://cas.s3.eu-west-3.amazonaws.com/p"
    assert S3Engine("s3://c.a.s/p").root == "https://s3.eu-west-3.amazonaws.com/c.a.s/p"  # a dot: path-style


def test_objects_round_trip_under_the_prefix_with_the_names_a_directory_uses(weed: WeedServer, prefix: str) -> None:
    e = S3Engine(f"s3://cas/{prefix}")
    assert e.get("index/ab/cdef", limit=100) is None
    assert e.put("index/ab/cdef", b"manifest") == "200 to PUT"
    assert e.put("blobs/12/3456", b"b" * 70_000).endswith("to PUT")
    assert e.get("index/ab/cdef", limit=100) == b"manifest"
    assert e.get_many(["index/ab/cdef", "index/no/ne", "blobs/12/3456"], limit=[100, 100, 70_000]) == [
        b"manifest",
        None,
        b"b" * 70_000,
    ]
    assert (e.size("blobs/12/3456"), e.size("blobs/no/ne")) == (70_000, None)
    assert weed.keys(prefix + "/") == {f"{prefix}/index/ab/cdef": 8, f"{prefix}/blobs/12/3456": 70_000}
    e.remove("index/ab/cdef")
    e.remove("index/ab/cdef")  # none: nothing
    assert e.get("index/ab/cdef", limit=100) is None


def test_an_object_over_the_limit_or_not_its_digest_is_refused_not_an_outage(prefix: str) -> None:
    e = S3Engine(f"s3://cas/{prefix}")
    e.put("blobs/aa/bb", b"x" * 1000)
    with pytest.raises(StoreFailure) as too_large:
        e.get("blobs/aa/bb", limit=999)
    assert (too_large.value.kind, too_large.value.outage) == ("too large", False)
    with pytest.raises(StoreFailure) as damaged:
        e.get("blobs/aa/bb", limit=1000, digest="0" * 64)
    assert (damaged.value.kind, damaged.value.outage) == ("damaged", False)


def test_a_conditional_read_of_an_unchanged_object_is_a_304(prefix: str) -> None:
    e = S3Engine(f"s3://cas/{prefix}")
    e.put("keys", b"list-1")
    got = e.get_changed("keys", limit=100, tag=None)
    assert got is not None and bytes(got[0] or b"") == b"list-1" and got[1]
    assert e.get_changed("keys", limit=100, tag=got[1]) is None  # 304: no body
    e.put("keys", b"list-2")
    again = e.get_changed("keys", limit=100, tag=got[1])
    assert again is not None and bytes(again[0] or b"") == b"list-2" and again[1] != got[1]
    assert e.get_changed("none", limit=100, tag=None) == (None, None)


# -- leases -------------------------------------------------------------------------------------


def _lease(weed: WeedServer, prefix: str, name: str) -> dict[str, object] | None:
    raw = weed.get(f"{prefix}/leases/{name}")
    return None if raw is None else json.loads(raw)


def test_a_lease_is_one_holders_until_released_renewed_only_by_it(weed: WeedServer, prefix: str) -> None:
    e = S3Engine(f"s3://cas/{prefix}")
    token = e.lease("k1", 30)
    assert token
    held = _lease(weed, prefix, "k1")
    assert held is not None and held["token"] == token and "pid" in str(held["holder"])
    assert e.lease("k1", 30) is None  # held by another
    assert e.lease("k1", 30, take=False) is None
    assert e.renew("k1", token, 30) is True
    assert e.renew("k1", "not-the-token", 30) is False
    e.release("k1", "not-the-token")
    assert _lease(weed, prefix, "k1") is not None  # only the holder releases
    e.release("k1", token)
    assert _lease(weed, prefix, "k1") is None
    assert e.lease("k1", 30, take=False) == ""  # free


def test_an_expired_lease_is_taken_over_once_and_its_old_holder_cannot_renew(prefix: str) -> None:
    e = S3Engine(f"s3://cas/{prefix}")
    old = e.lease("k2", 0.3)
    assert old
    assert e.lease("k2", 30) is None  # not before its time
    time.sleep(0.4)
    assert e.lease("k2", 30, take=False) == ""  # expired: free
    new = e.lease("k2", 30)
    assert new and new != old
    assert e.lease("k2", 30) is None
    assert e.renew("k2", old, 30) is False
    e.release("k2", old)  # the old holder's release leaves the new holder's lease alone
    assert e.renew("k2", new, 30) is True


def test_a_lease_deleted_by_hand_is_free_and_its_holder_knows_it_lost_it(weed: WeedServer, prefix: str) -> None:
    e = S3Engine(f"s3://cas/{prefix}")
    token = e.lease("k3", 30)
    assert token
    weed.delete(f"{prefix}/leases/k3")
    assert e.renew("k3", token, 30) is False
    other = e.lease("k3", 30)
    assert other and other != token


def test_a_holder_that_gives_up_leaves_the_mark_for_its_time(prefix: str) -> None:
    e = S3Engine(f"s3://cas/{prefix}")
    token = e.lease("k4", 30)
    assert token
    e.release("k4", token, mark_s=0.3)
    assert e.lease("k4", 30) == LEASE_MARK
    assert e.lease("k4", 30, take=False) == LEASE_MARK
    time.sleep(0.4)
    assert e.lease("k4", 30)  # the mark expired: taken


_CONTENDER = textwrap.dedent(
    """
    import sys
    from cuda_program_cas._remote.s3 import S3Engine
    e = S3Engine(sys.argv[1])
    sys.stdin.read()  # the gate: every contender is ready, then the pipe closes
    sys.exit(0 if e.lease("race", 30) else 1)
    """
)


def test_processes_contending_for_a_lease_exactly_one_holds_it(prefix: str, aws: dict[str, str]) -> None:
    """Eight processes released together by one pipe's end: one takes the lease, seven find it held."""
    env = {**os.environ, **aws}
    procs = [
        subprocess.Popen([sys.executable, "-c", _CONTENDER, f"s3://cas/{prefix}"], stdin=subprocess.PIPE, env=env)
        for _ in range(8)
    ]
    for proc in procs:
        assert proc.stdin is not None
        proc.stdin.close()
    codes = sorted(proc.wait(timeout=60) for proc in procs)
    assert codes == [0] + [1] * 7


_HOLDER = textwrap.dedent(
    """
    import sys, time
    from cuda_program_cas._remote.s3 import S3Engine
    e = S3Engine(sys.argv[1])
    token = e.lease("held", float(sys.argv[2]))
    print(token, flush=True)
    while True:  # renews a third of its time to live, as a compiling holder does
        time.sleep(float(sys.argv[2]) / 3)
        print("renewed" if e.renew("held", token, float(sys.argv[2])) else "lost", flush=True)
    """
)


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "stopped"])
def test_a_dead_or_stopped_holders_lease_is_free_after_its_ttl_not_before(
    prefix: str, aws: dict[str, str], how: signal.Signals
) -> None:
    ttl = 1.5
    env = {**os.environ, **aws}
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, f"s3://cas/{prefix}", str(ttl)], stdout=subprocess.PIPE, text=True, env=env
    )
    assert holder.stdout is not None
    try:
        token = holder.stdout.readline().strip()
        assert len(token) == 32
        assert holder.stdout.readline() == "renewed\n"  # it holds and renews
        holder.send_signal(how)
        stopped_at = time.monotonic()
        e = S3Engine(f"s3://cas/{prefix}")
        while (taken := e.lease("held", 30)) is None:
            time.sleep(0.05)
        waited = time.monotonic() - stopped_at
        assert taken != LEASE_MARK
        assert 0.2 < waited < ttl + 2.0, waited  # not before (it renewed a moment ago), and within its time to live
        if how == signal.SIGSTOP:
            holder.send_signal(signal.SIGCONT)
            assert holder.stdout.readline() == "lost\n"  # it knows, and the new holder keeps the lease
            assert e.renew("held", taken, 30) is True
    finally:
        holder.kill()
        holder.wait()
        holder.stdout.close()


# -- stores over the engine --------------------------------------------------------------------


def test_a_write_node_fills_an_empty_prefix_and_a_cold_node_reads_it(
    tmp_path: Path, weed: WeedServer, prefix: str, compiles: Compiles
) -> None:
    store = f"s3://cas/{prefix}"
    with ContentAddressedProgramCache(tmp_path / "writer", shared=[f"{store}|write"]) as cache:
        code = bytes(compile_program(cache=cache).code)  # an empty prefix: a miss, not an unusable store
        cache.close()  # flushes the upload queue
        counts = cache.stats()
    assert (counts.uploads, counts.uploads_dropped, counts.errors) == (1, 0, 0)
    names = weed.keys(prefix + "/")
    assert f"{prefix}/blobs/{url_path(BLOBS, digest_of(code))[len('blobs/') :]}" in names
    assert any(n.startswith(f"{prefix}/index/") for n in names) and f"{prefix}/keys" in names
    with ContentAddressedProgramCache(tmp_path / "cold", shared=[store]) as cold:
        assert bytes(compile_program(cache=cold).code) == code
        assert cold.stats().shared_hits == 1
    assert compiles.count == 1


@pytest.mark.parametrize("pack", [False, True], ids=["loose", "packed"])
def test_a_store_published_into_a_bucket_is_read_by_a_cold_node(
    tmp_path: Path, weed: WeedServer, prefix: str, pack: bool
) -> None:
    values = {f"k{i}": f"value {i} ".encode() * (i * 1000 + 1) for i in range(5)}
    with closing(CacheStore(tmp_path / "src")) as src:
        for key, value in values.items():
            assert src.put(key, value)
    store = f"s3://cas/{prefix}"
    report = publish([tmp_path / "src"], store, pack=pack)
    assert not report.problems
    names = weed.keys(prefix + "/")
    assert f"{prefix}/layout.json" in names
    packs = [n for n in names if n.startswith(f"{prefix}/packs/") and n.endswith(".cpk")]
    manifests = [n for n in names if n.startswith(f"{prefix}/index/")]
    assert (len(packs), len(manifests)) == ((1, 0) if pack else (0, len(values)))
    if pack:  # its entries framed: the pack holds a fraction of the raw bytes
        assert names[packs[0]] < sum(map(len, values.values())) // 10
    with closing(CacheStore(tmp_path / "cold", shared=[store])) as cold:
        for key, value in values.items():
            assert cold.get(key) == value
        counts = cold.counters()
        assert (counts["shared_hits"], counts["errors"], counts["corrupt"]) == (len(values), 0, 0)
    assert publish([tmp_path / "src"], store, pack=pack).published == 0  # published already: nothing again


# -- what a wrong setup is: a miss, one clear line, no secret -------------------------------------


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "cuda_program_cas" and r.levelno >= logging.WARNING]


@pytest.mark.parametrize(
    "setup",
    [
        ({"AWS_SECRET_ACCESS_KEY": "wrong-secret-value"}, "s3://cas/{prefix}", "denied: status 403"),
        ({"AWS_ACCESS_KEY_ID": "no-such-key-id"}, "s3://cas/{prefix}", "denied: status 403"),
        ({}, "s3://no-such-bucket/{prefix}", "no such bucket"),
        ({"AWS_PROFILE": "no-such-profile"}, "s3://cas/{prefix}", "aws configuration: ProfileNotFound"),
    ],
    ids=["wrong-secret", "unknown-key", "missing-bucket", "missing-profile"],
)
def test_a_wrong_setup_is_a_miss_with_one_warning_and_no_secret(
    tmp_path: Path,
    prefix: str,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    setup: tuple[dict[str, str], str, str],
) -> None:
    change, address, said = setup
    with ContentAddressedProgramCache(tmp_path / "seed", shared=[f"s3://cas/{prefix}|write"]) as seed:
        code = bytes(compile_program(cache=seed).code)  # the right setup stores it
    for name, value in change.items():
        monkeypatch.setenv(name, value)
    caplog.set_level(logging.DEBUG, logger="cuda_program_cas")
    store = address.format(prefix=prefix)
    with ContentAddressedProgramCache(tmp_path / "node", shared=[store + "|write"]) as node:
        assert bytes(compile_program(cache=node).code) == code  # compiled: a miss
        assert node.get("other") is None  # paused: no request
        node.close()
        counts = node.stats()
    assert (counts.shared_hits, counts.errors, counts.uploads) == (0, 1, 0)
    warnings = _warnings(caplog)
    assert said in warnings[0] and store in warnings[0], warnings
    assert all(store in w for w in warnings) and len(warnings) <= 2, warnings  # the store's, and the upload dropped
    everything = caplog.text + "".join(r.getMessage() for r in caplog.records)
    assert SECRET_KEY not in everything and "wrong-secret-value" not in everything


def test_a_cold_nodes_warm_set_costs_three_round_trips_in_sequence(
    tmp_path: Path, weed: WeedServer, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """12 kernels published packed; the job's first run leaves its warm set; a cold node of the job, through a
    forwarder of 20 ms, gets every kernel by 3 round trips in sequence (the pack's ranges sent at once)."""
    from cluster_bench import kernel
    from testkit.proxy import Proxy

    store = f"s3://cas/{prefix}"
    with ContentAddressedProgramCache(tmp_path / "builder", shared=()) as builder:
        codes = [bytes(compile_program(kernel(i), cache=builder).code) for i in range(12)]
    publish([tmp_path / "builder"], store, pack=True)
    monkeypatch.setenv("CUDA_PROGRAM_CAS_JOB", f"s3-warm-{prefix}")
    with ContentAddressedProgramCache(tmp_path / "first", shared=[f"{store}|write"]) as first:
        assert [bytes(compile_program(kernel(i), cache=first).code) for i in range(12)] == codes
        assert first.stats().shared_hits == 12
    with Proxy(("127.0.0.1", weed.port), delay_up_ms=10, delay_down_ms=10) as link:
        monkeypatch.setenv("AWS_ENDPOINT_URL_S3", f"http://127.0.0.1:{link.port}")
        with ContentAddressedProgramCache(tmp_path / "cold", shared=[store]) as cold:
            assert [bytes(compile_program(kernel(i), cache=cold).code) for i in range(12)] == codes
            counts = cold.stats()
        assert (counts.hits, counts.misses) == (12, 0)
        assert link.rounds <= 3 < link.exchanges, (link.rounds, link.exchanges)


# -- stats, verify and gc on a bucket -----------------------------------------------------------


def test_stats_verify_and_gc_on_a_bucket(
    tmp_path: Path, weed: WeedServer, prefix: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from cuda_program_cas._cli.main import main
    from cuda_program_cas._remote.bucket import bucket_gc

    store = f"s3://cas/{prefix}"
    src = CacheStore(tmp_path / "src")
    for i in range(4):
        assert src.put(f"k{i}", bytes([i]) * (1000 + i))
    src.close()
    publish([tmp_path / "src"], store)
    assert main(["stats", store, "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert (stats["objects"]["manifests"], stats["objects"]["blobs"]) == (4, 4)
    # The bytes the bucket holds: each blob compressed (4,006 raw).
    assert stats["bytes"]["blobs"] == sum(weed.keys(f"{prefix}/blobs/").values()) < 400
    assert main(["verify", store]) == 0
    assert "0 problems; 0 orphan blobs" in capsys.readouterr().out

    sizes = weed.keys(f"{prefix}/blobs/")
    blobs = sorted(sizes)
    weed.put(blobs[0], b"X" * sizes[blobs[0]])  # other bytes, the same size
    weed.delete(blobs[1])  # a manifest whose blob is gone
    weed.put(f"{prefix}/blobs/ee/{'e' * 62}", b"orphan")  # named by no manifest
    assert main(["verify", store, "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    problems = {p["object"].split("/")[0] + ": " + p["problem"].split(":")[0] for p in report["problems"]}
    assert problems == {"blobs: damaged", f"index: its blob {blobs[1][len(prefix) + 1 :]} is missing"}, problems
    assert report["orphan_blobs"] == 1

    assert main(["gc", store, "--grace", "30m"]) == 2  # a shared store: an hour at least
    assert main(["gc", store, "--max-size", "1G"]) == 2  # a directory's option
    assert main(["gc", store, "--json"]) == 0  # all written just now: nothing is old enough
    capsys.readouterr()
    before = set(weed.keys(f"{prefix}/"))
    planned = bucket_gc(store, grace_s=0, dry_run=True).removed
    assert set(weed.keys(f"{prefix}/")) == before  # a dry run changes nothing
    done = bucket_gc(store, grace_s=0)
    assert done.removed == planned
    assert sorted(n.split("/")[0] for n in done.removed) == ["blobs", "index"]  # the orphan, the dangling manifest
    assert set(weed.keys(f"{prefix}/")) == before - {f"{prefix}/{n}" for n in done.removed}
    assert main(["stats", "s3://cas/" + prefix, "--zero"]) == 2


def test_signed_write_back_is_trusted_and_a_manifest_rewritten_in_the_bucket_is_not(
    tmp_path: Path, weed: WeedServer, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A writer signs what it sends; a trusting cold node hits it. A manifest an attacker with bucket access
    replaces by one of its own (unsigned) is a miss for that node, counted untrusted, never its bytes."""
    from test_signing import openssl_key

    private, public = openssl_key(tmp_path / "site.key")
    store = f"s3://cas/{prefix}"
    monkeypatch.setenv("CUDA_PROGRAM_CAS_SIGNING_KEY", str(private))
    with ContentAddressedProgramCache(tmp_path / "writer", shared=[f"{store}|write"]) as writer:
        code = bytes(compile_program(cache=writer).code)
        writer.close()
        assert writer.stats().uploads == 1
    monkeypatch.delenv("CUDA_PROGRAM_CAS_SIGNING_KEY")
    (manifest,) = list(weed.keys(f"{prefix}/index/"))
    signed = weed.get(manifest)
    assert signed is not None and b"\ned25519 " in signed
    monkeypatch.setenv("CUDA_PROGRAM_CAS_TRUSTED_KEYS", str(public))
    with ContentAddressedProgramCache(tmp_path / "trusting", shared=[store]) as node:
        assert bytes(compile_program(cache=node).code) == code
        assert node.stats().shared_hits == 1
    weed.put(manifest, signed.split(b"\n")[0] + b"\n")  # the signature stripped: what an unsigned writer sends
    with ContentAddressedProgramCache(tmp_path / "second", shared=[store]) as node:
        assert bytes(compile_program(cache=node).code) == code  # compiled
        counts = node.counters()
    assert (counts["shared_hits"], counts["untrusted"]) == (0, 1)


def test_repack_in_a_bucket_merges_packs_and_loose_entries_into_one_pack(
    tmp_path: Path, weed: WeedServer, prefix: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from cuda_program_cas._cli.main import main

    store = f"s3://cas/{prefix}"
    values = {}
    for run in range(2):  # two publishes with --pack: two packs
        src = CacheStore(tmp_path / f"src{run}")
        for i in range(3):
            values[f"p{run}-{i}"] = f"packed {run} {i} ".encode() * (100 + i)
            assert src.put(f"p{run}-{i}", values[f"p{run}-{i}"])
        src.close()
        publish([tmp_path / f"src{run}"], store, pack=True)
    src = CacheStore(tmp_path / "loose")
    for i in range(2):
        values[f"l{i}"] = f"loose {i} ".encode() * 50
        assert src.put(f"l{i}", values[f"l{i}"])
    src.close()
    publish([tmp_path / "loose"], store)
    before = weed.keys(f"{prefix}/packs/")
    assert len([n for n in before if n.endswith(".cpk")]) == 2
    reader = CacheStore(tmp_path / "reader", shared=[store])
    assert reader.get("p0-0") == values["p0-0"]  # it listed the two packs

    assert main(["repack", store]) == 0
    assert "one new pack" in capsys.readouterr().out
    assert reader.get("p1-2") == values["p1-2"]  # its listing is old: the pack is read in packs/retired/
    reader.close()
    after = weed.keys(f"{prefix}/")
    live = [n for n in after if n.startswith(f"{prefix}/packs/") and n.endswith(".cpk") and "/retired/" not in n]
    retired = [n for n in after if "/packs/retired/" in n]
    assert len(live) == 1 and len(retired) == 2
    assert after[live[0]] < sum(map(len, values.values())) // 3  # framed entries, copied as they were
    assert not [n for n in after if n.startswith(f"{prefix}/index/")]  # the loose manifests went into the pack
    assert parse_listing(weed.get(f"{prefix}/packs/list") or b"") == [live[0].rsplit("/", 1)[1]]
    with closing(CacheStore(tmp_path / "cold", shared=[store])) as cold:
        assert all(cold.get(k) == v for k, v in values.items())
        assert cold.counters()["shared_hits"] == len(values)


def test_gc_on_a_bucket_removes_expired_leases_and_keeps_held_ones(weed: WeedServer, prefix: str) -> None:
    from cuda_program_cas._remote.bucket import bucket_gc

    e = S3Engine(f"s3://cas/{prefix}")
    expired, held = "a" * 64, "b" * 64
    assert e.lease(expired, 0.05) and e.lease(held, 30)
    time.sleep(0.1)
    done = bucket_gc(f"s3://cas/{prefix}", grace_s=0)
    assert done.removed == [f"leases/{expired}"]
    assert set(weed.keys(f"{prefix}/leases/")) == {f"{prefix}/leases/{held}"}
