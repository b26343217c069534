"""Shared stores over HTTP, read through a real nginx on loopback: loose and packed, request by request.

Every hit is checked byte for byte against what was published; the requests a
process made are counted in nginx's own access log. The failure side (outages,
bad answers, TLS, tokens) is tests/test_http_faults.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import SAXPY, compile_program
from testkit.nginx import nginx_or_skip

from cuda_program_cas import CacheStore, ContentAddressedProgramCache, publish, repack
from cuda_program_cas.index import is_local_id, key_id

N = 40


def value(i: int, gen: str = "g") -> bytes:
    return (f"{gen}:{i}:".encode() * 300)[: 700 + 13 * (i % 40)]


def fill(path: Path, gen: str = "g", n: int = N) -> Path:
    store = CacheStore(path)
    for i in range(n):
        store.put(f"{gen}{i}", value(i, gen))
    return path


@pytest.fixture
def server(tmp_path: Path):
    with nginx_or_skip(tmp_path / "nginx", tmp_path / "served") as n:
        yield n


#: Looks up keys in a fresh process through an HTTP store and reports the bytes' check and counts.
_NODE = textwrap.dedent(
    """
    import json, sys
    from cuda_program_cas import CacheStore
    spec = json.loads(sys.argv[1])
    node = CacheStore(spec["local"], shared=[spec["url"]])
    got = {k: node.get(k) for k in spec["keys"]}
    print(json.dumps({
        "found": {k: None if v is None else v.hex() for k, v in got.items()},
        "requests": node.inner.shared[0].engine.requests,
        "counters": node.counters(),
    }))
    """
)


def node(local: Path, url: str, keys: list[str]) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", _NODE, json.dumps({"local": str(local), "url": url, "keys": keys})],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "WARNING" not in done.stderr, done.stderr
    out: dict = json.loads(done.stdout.strip().splitlines()[-1])
    out["found"] = {k: None if v is None else bytes.fromhex(v) for k, v in out["found"].items()}
    return out


def test_a_loose_store_costs_two_gets_per_first_hit_and_nothing_once_copied(server, tmp_path: Path) -> None:
    publish([fill(tmp_path / "src")], server.root)
    keys = [f"g{i}" for i in range(N)]
    server.reset_log()
    first = node(tmp_path / "node", server.read_url(""), keys)
    assert first["found"] == {f"g{i}": value(i) for i in range(N)}
    assert first["counters"]["shared_hits"] == N
    # layout.json, packs/list (404: no packs), the key list publish wrote, then a manifest and a blob per key
    # (docs/http.md carries these counts to a cluster).
    assert first["requests"] == 3 + 2 * N
    log = server.requests(wait_for=first["requests"])
    assert len(log) == first["requests"]
    assert sorted(e.status for e in log).count(200) == 2 + 2 * N
    assert len({e.connection for e in log}) == 1  # one connection, kept alive for every request
    # The hits were copied into the node's cache: a later process makes no request at all.
    again = node(tmp_path / "node", server.read_url(""), keys)
    assert again["found"] == first["found"] and again["requests"] == 0


def test_a_packed_store_costs_one_range_get_per_hit_and_its_index_once_per_node(server, tmp_path: Path) -> None:
    publish([fill(tmp_path / "src")], server.root, pack=True)
    url = server.read_url("")
    half = [f"g{i}" for i in range(N // 2)]
    rest = [f"g{i}" for i in range(N // 2, N)]
    server.reset_log()
    first = node(tmp_path / "node", url, half)
    assert first["found"] == {k: value(int(k[1:])) for k in half}
    # layout.json, packs/list, the pack's trailer and index (two Range GETs), one Range GET per hit.
    assert first["requests"] == 4 + len(half)
    ranged = [e for e in server.requests(wait_for=first["requests"]) if e.status == 206]
    assert len(ranged) == 2 + len(half) and all(e.range.startswith("bytes=") for e in ranged)
    # Another process of the node: the pack's index is kept in the local cache, so no request for it.
    second = node(tmp_path / "node", url, rest)
    assert second["found"] == {k: value(int(k[1:])) for k in rest}
    assert second["requests"] == 2 + len(rest)


def test_misses_the_key_list_answers_cost_no_request_and_no_exception(server, tmp_path: Path) -> None:
    publish([fill(tmp_path / "src", n=3)], server.root, pack=True)
    out = node(tmp_path / "node", server.read_url(""), ["absent1", "absent2"])
    assert out["found"] == {"absent1": None, "absent2": None}
    assert out["counters"]["misses"] == 2 and out["counters"]["errors"] == 0
    # layout, list, the pack's index (2), the key list (which publish wrote); no request per key: not listed.
    assert out["requests"] == 4 + 1 and out["counters"]["listed_misses"] == 2


@pytest.mark.parametrize("packed", [False, True], ids=["loose", "packed"])
def test_an_entry_larger_than_held_in_memory_is_staged_verified_and_hits(server, tmp_path: Path, packed: bool) -> None:
    """24 MiB (over the 1 MiB a body may take in memory): staged in the node's tmp/, read back once verified."""
    big = os.urandom(24 << 20)
    src = CacheStore(tmp_path / "src")
    src.put("big", big)
    src.put("small", b"a small one")
    publish([tmp_path / "src"], server.root, pack=packed)
    node_store = CacheStore(tmp_path / "node", shared=[server.read_url("")])
    assert node_store.get("big") == big
    assert node_store.get("small") == b"a small one"
    assert node_store.counters()["errors"] == 0
    assert list((tmp_path / "node" / "tmp").iterdir()) == []  # the staging file went with the lookup
    assert CacheStore(tmp_path / "node").get("big") == big  # copied in, through the write protocol


def test_an_entry_over_the_ceiling_is_never_asked_of_nginx(
    server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = CacheStore(tmp_path / "src")
    src.put("big", b"b" * 5000)
    src.put("small", b"s" * 100)
    publish([tmp_path / "src"], server.root)
    monkeypatch.setenv("CUDA_PROGRAM_CAS_MAX_ENTRY_SIZE", "4k")
    server.reset_log()
    node_store = CacheStore(tmp_path / "node", shared=[server.read_url("")])
    assert node_store.get("big") is None
    assert node_store.get("small") == b"s" * 100
    blobs = [e.uri for e in server.requests(wait_for=5) if "/blobs/" in e.uri]
    assert len(blobs) == 1  # the small one's: the big one's manifest said 5,000 bytes, and that was enough


def test_a_repack_on_the_server_keeps_every_key_readable(server, tmp_path: Path) -> None:
    # Two publishes, two packs; a reader learns them, then the store is repacked under it
    # (the old packs move to packs/retired/): its next lookups still hit, from the retired
    # packs first and from the new listing after.
    publish([fill(tmp_path / "a", "a")], server.root, pack=True)
    publish([fill(tmp_path / "b", "b")], server.root, pack=True)
    url = server.read_url("")
    reader = CacheStore(tmp_path / "node", shared=[url], copy_shared_hits=False)
    assert reader.get("a0") == value(0, "a") and reader.get("b0") == value(0, "b")
    report = repack(server.root)
    assert len(report.retired) == 2
    assert all(reader.get(f"a{i}") == value(i, "a") for i in range(N))
    assert all(reader.get(f"b{i}") == value(i, "b") for i in range(N))
    fresh = CacheStore(tmp_path / "node2", shared=[url])
    assert all(fresh.get(f"b{i}") == value(i, "b") for i in range(N))
    assert fresh.inner.shared[0].engine.requests == 4 + N  # the new listing names one pack


def test_program_compile_hits_a_store_served_over_http_with_identical_bytes(server, tmp_path: Path) -> None:
    kernels = [SAXPY.replace("saxpy", f"k{i}") for i in range(3)]
    with ContentAddressedProgramCache(tmp_path / "builder") as builder:
        built = [bytes(compile_program(k, cache=builder).code) for k in kernels]
    publish([tmp_path / "builder"], server.root, pack=True)
    with ContentAddressedProgramCache(tmp_path / "node", shared=[server.read_url("")]) as cache:
        got = [bytes(compile_program(k, cache=cache).code) for k in kernels]
        counts = cache.counters()
    assert got == built
    assert counts["shared_hits"] == 3 and counts["misses"] == 0


_READER = textwrap.dedent(
    """
    import json, os, signal, sys
    from cuda_program_cas import CacheStore
    spec = json.loads(sys.argv[1])
    want = {k: bytes.fromhex(v) for k, v in spec["want"].items()}
    seen = wrong = rounds = 0
    stop = []
    signal.signal(signal.SIGTERM, lambda *a: stop.append(1))
    print("ready", flush=True)
    while not stop or rounds < 2:
        node = CacheStore(spec["local"] + str(rounds), shared=[spec["url"]], copy_shared_hits=False)
        for k, v in want.items():
            got = node.get(k)
            if got is not None:
                seen += 1
                wrong += got != v
        node.close()
        rounds += 1
        if rounds > 400:
            break
    print(json.dumps({"seen": seen, "wrong": wrong, "rounds": rounds}))
    """
)


@pytest.mark.slow
def test_nodes_reading_while_a_publish_runs_see_only_whole_entries(server, tmp_path: Path) -> None:
    # Readers in other processes loop over every key while the store is published into (loose,
    # then packed) under them: each lookup is a miss or the published bytes, never other bytes.
    src = fill(tmp_path / "src", n=N)
    want = {f"g{i}": value(i).hex() for i in range(N)}
    url = server.read_url("")
    readers = [
        subprocess.Popen(
            [sys.executable, "-c", _READER, json.dumps({"local": str(tmp_path / f"r{j}-"), "url": url, "want": want})],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for j in range(3)
    ]
    # Each says it is ready on its pipe (signals from several children can merge into one: a wait on
    # a count of them could wait forever).
    for r in readers:
        assert r.stdout is not None
        assert r.stdout.readline() == "ready\n", r.communicate()[1]
    publish([src], server.root)
    publish([fill(tmp_path / "more", "h")], server.root, pack=True)
    for r in readers:
        r.send_signal(signal.SIGTERM)
    outs = [r.communicate(timeout=120) for r in readers]
    results = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    assert all(r["wrong"] == 0 for r in results), results
    assert sum(r["seen"] for r in results) > 0, results
    assert all("Traceback" not in err for _, err in outs)


def test_the_kept_pack_index_is_a_node_local_entry(server, tmp_path: Path) -> None:
    publish([fill(tmp_path / "src", n=3)], server.root, pack=True)
    reader = CacheStore(tmp_path / "node", shared=[server.read_url("")])
    assert reader.get("g0") == value(0)
    kids = sorted(p.parent.name + p.name for p in (tmp_path / "node" / "index").rglob("*") if p.is_file())
    assert key_id("g0") in kids
    local = [k for k in kids if is_local_id(k)]
    assert len(local) == 1  # the one pack's index
    report = publish([tmp_path / "node"], tmp_path / "elsewhere")
    assert report.published == 1 and report.scanned == 1  # g0 only: the kept index stays on the node


def _docs_server_block(root: Path, body_temp: Path, token: str) -> str:
    """docs/http.md's nginx server block, pointed at this test's directories, address and certificate."""
    text = (Path(__file__).resolve().parent.parent / "docs" / "http.md").read_text()
    block = text.split("```nginx\n", 1)[1].split("```", 1)[0]
    for old, new in (
        ("listen 443 ssl;", "listen LISTEN;"),
        ("/etc/ssl/cache.example.org.pem", "CERT"),
        ("/etc/ssl/cache.example.org.key", "KEY"),
        ("/srv/cuda-cas-tmp", str(body_temp)),
        ("/srv/cuda-cas/", f"{root}/"),
        ("CHANGE-ME", token),
    ):
        assert old in block, old
        block = block.replace(old, new)
    return block


_CLIENT = textwrap.dedent(
    """
    import json, sys
    from cuda_program_cas._remote.client import request
    spec = json.loads(sys.argv[1])
    out = []
    for method, url, body, headers in spec:
        reply = request(method, url, body=None if body is None else body.encode(), headers=headers)
        out.append([reply.status, reply.body.decode("latin-1")])
    print(json.dumps(out))
    """
)


def test_the_nginx_server_of_docs_http_md_serves_reads_and_takes_writes_only_with_the_token(tmp_path: Path) -> None:
    from testkit.nginx import Nginx, NginxError, find_nginx

    if find_nginx() is None:
        pytest.skip("nginx is not installed")
    root, body = tmp_path / "srv", tmp_path / "body"
    root.mkdir()
    body.mkdir()
    server = Nginx(tmp_path / "ngx", root, tls=True, server_block=_docs_server_block(root, body, "s3cret"))
    try:
        server.start()
    except NginxError as exc:
        server.stop()
        pytest.skip(f"nginx did not start: {exc}")
    with server:
        base = f"https://127.0.0.1:{server.port}"
        auth = {"Authorization": "Bearer s3cret"}
        spec = [
            ["PUT", f"{base}/cuda-cas-dav/a/b/file", "hello", auth],
            ["PUT", f"{base}/cuda-cas-dav/a/b/other", "no token", {}],
            ["GET", f"{base}/cuda-cas/a/b/file", None, {}],
            ["PUT", f"{base}/cuda-cas/a/b/file", "through the read location", auth],
        ]
        env = dict(os.environ, CUDA_PROGRAM_CAS_CA_BUNDLE=str(server.cert))
        done = subprocess.run(
            [sys.executable, "-c", _CLIENT, json.dumps(spec)], capture_output=True, text=True, env=env, check=False
        )
        assert done.returncode == 0, done.stderr
        (put, status_put), (denied, _), (got, text), (read_only, _) = json.loads(done.stdout.strip().splitlines()[-1])
        assert put in (201, 204) and denied == 401 and got == 200 and text == "hello" and read_only == 403
        assert (root / "a" / "b" / "file").read_text() == "hello"
        assert not (root / "a" / "b" / "other").exists()
        # As the page says: publish through the WebDAV location, nodes read through the other.
        src = fill(tmp_path / "src", n=5)
        env["CUDA_PROGRAM_CAS_HTTP_TOKEN"] = "s3cret"
        done = subprocess.run(
            [sys.executable, "-m", "cuda_program_cas", "publish", str(src), f"{base}/cuda-cas-dav", "--pack"],
            capture_output=True,
            text=True,
            env=env,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        del env["CUDA_PROGRAM_CAS_HTTP_TOKEN"]  # reads need none
        read = subprocess.run(
            [
                sys.executable,
                "-c",
                _NODE,
                json.dumps({"local": str(tmp_path / "node"), "url": f"{base}/cuda-cas", "keys": ["g0", "g4"]}),
            ],
            capture_output=True,
            text=True,
            env=env,
            check=False,
        )
        assert read.returncode == 0, read.stderr
        found = json.loads(read.stdout.strip().splitlines()[-1])["found"]
        assert found == {"g0": value(0).hex(), "g4": value(4).hex()}
