"""Publishing over HTTP: WebDAV PUT into a real nginx; the directory it serves is then a valid store, read by nodes.

The sources are local caches filled by real NVRTC compiles. What was sent, and in which order,
is read from nginx's access log: one JSON line per request, in the order nginx answered them.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import SAXPY, compile_program, run_python
from testkit.faults import refused_url
from testkit.nginx import LogEntry, Nginx, nginx_or_skip

from cuda_program_cas import ContentAddressedProgramCache, LayoutError, collect
from cuda_program_cas._base import frame
from cuda_program_cas._cli.main import main as cli_main
from cuda_program_cas._disk.packset import parse_listing

TOKEN = "tok-3f9a1c-publish"  # noqa: S105 - a test's token, searched for in every output
N_KERNELS = 4


def kernel(i: int) -> str:
    """A kernel whose cubin differs for each ``i``."""
    return SAXPY.replace("a * x[i] + y[i]", f"a * x[i] + y[i] + {i}.0f")


class Sources:
    """Two local caches: ``a`` with N_KERNELS kernels and a fifth key whose cubin is the first's; ``b`` one more."""

    def __init__(self, root: Path) -> None:
        self.a, self.b = root / "a", root / "b"
        self.cubins: dict[tuple[str, str], bytes] = {}  # (source, name) -> the cubin
        with ContentAddressedProgramCache(self.a) as cache:
            for i in range(N_KERNELS):
                self._compile(cache, kernel(i), "default_program")
            self._compile(cache, kernel(0), "renamed")  # another key, the same bytes
        self.in_a = list(self.cubins)
        with ContentAddressedProgramCache(self.b) as cache:
            self._compile(cache, kernel(N_KERNELS), "default_program")
        self.in_b = [k for k in self.cubins if k not in self.in_a]

    def _compile(self, cache: ContentAddressedProgramCache, source: str, name: str) -> None:
        self.cubins[(source, name)] = bytes(compile_program(source, cache=cache, name=name).code)

    def read_back(self, store: Path | str, local: Path, which: list[tuple[str, str]]) -> int:
        """Compile ``which`` on a node whose shared store is ``store`` (a directory or a URL): the shared hits."""
        with ContentAddressedProgramCache(local, shared=[str(store)]) as cache:
            for source, name in which:
                assert bytes(compile_program(source, cache=cache, name=name).code) == self.cubins[(source, name)]
            return cache.stats().shared_hits


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> Sources:
    return Sources(tmp_path_factory.mktemp("http-publish-sources"))


@pytest.fixture(autouse=True)
def _no_token(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """This process sends no token (the client keeps a host's token for the process): token tests run children."""
    monkeypatch.delenv("CUDA_PROGRAM_CAS_HTTP_TOKEN", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))


@pytest.fixture
def nginx(tmp_path: Path) -> Iterator[Nginx]:
    with nginx_or_skip(tmp_path / "nginx") as server:
        yield server


def settled(server: Nginx) -> list[LogEntry]:
    """The access log since the last reset, complete: a marker request is logged after every earlier one.

    nginx logs a request after its response went out, so a client can be ahead of the log; its one
    worker answers the marker only after it logged what came before.
    """
    mark = f"/store/.mark-{uuid.uuid4().hex}"
    try:
        urllib.request.urlopen(server.base_url + mark, timeout=5).close()  # noqa: S310 - our loopback nginx
    except urllib.error.HTTPError as exc:
        exc.close()
    deadline = time.monotonic() + 10
    while True:
        entries = server.requests()
        if any(e.uri == mark for e in entries):
            server.reset_log()
            return [e for e in entries if e.uri != mark]
        assert time.monotonic() < deadline, "the marker request never reached the access log"
        time.sleep(0.01)


def puts(entries: list[LogEntry]) -> list[str]:
    """The paths below the store that were written, in order."""
    return [e.uri.split("/dav/store/", 1)[1] for e in entries if e.method == "PUT" and e.status in (200, 201, 204)]


def publish_json(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, dict[str, object]]:
    capsys.readouterr()
    status = cli_main(["publish", *args, "--json"])
    return status, json.loads(capsys.readouterr().out)


def manifest_digest(store: Path, relative: str) -> str:
    """The digest a published manifest (``index/xx/yyy...``) names."""
    return (store / relative).read_text().split()[2]


def check_order(store: Path, written: list[str]) -> None:
    """Every manifest PUT comes after its blob's PUT (when this run uploaded that blob), all after layout.json."""
    where = {path: n for n, path in enumerate(written)}
    assert where["layout.json"] < min(n for p, n in where.items() if p.startswith(("blobs/", "index/", "packs/")))
    for path, n in where.items():
        if path.startswith("index/"):
            digest = manifest_digest(store, path)
            blob = f"blobs/{digest[:2]}/{digest[2:]}"
            assert blob in where, f"{path} names {blob}, never uploaded"
            assert where[blob] < n, f"{path} was uploaded before its blob"


def test_loose_publish_over_http_gives_a_store_that_nodes_hit(
    sources: Sources, nginx: Nginx, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url, store = nginx.dav_url("store"), nginx.root / "store"
    status, report = publish_json(capsys, "--dry-run", str(sources.a), url)
    assert status == 0 and report["created"] and report["published"] == N_KERNELS + 1
    assert puts(settled(nginx)) == [] and not store.exists()

    status, report = publish_json(capsys, str(sources.a), url)
    assert status == 0, report
    assert (report["dest"], report["created"], report["published"]) == (url, True, N_KERNELS + 1)
    assert (report["blobs_published"], report["problem_count"]) == (N_KERNELS, 0)
    written = puts(settled(nginx))
    assert sorted(p.split("/")[0] for p in written) == sorted(
        ["CACHEDIR.TAG", "layout.json"] + ["blobs"] * N_KERNELS + ["index"] * (N_KERNELS + 1) + ["keys"]
    )
    assert written[-1] == "keys"  # the key list last, after the entries it names
    check_order(store, written)
    assert json.loads((store / "layout.json").read_text())["shared"] is True
    assert cli_main(["verify", str(store)]) == 0
    assert sources.read_back(store, tmp_path / "node", sources.in_a) == N_KERNELS + 1
    assert sources.read_back(nginx.read_url("store"), tmp_path / "http-node", sources.in_a) == N_KERNELS + 1
    settled(nginx)

    # Again: nothing new, nothing uploaded.
    status, report = publish_json(capsys, str(sources.a), url)
    assert (status, report["published"], report["unchanged"], report["blobs_published"]) == (0, 0, N_KERNELS + 1, 0)
    assert puts(settled(nginx)) == []


def test_pack_publish_over_http_uploads_the_pack_before_its_listing(
    sources: Sources, nginx: Nginx, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url, store = nginx.dav_url("store"), nginx.root / "store"
    status, report = publish_json(capsys, "--pack", str(sources.a), url)
    assert status == 0 and report["published"] == N_KERNELS + 1 and len(report["packs"]) == 1
    written = puts(settled(nginx))
    pack = report["packs"][0].rsplit("/", 1)[1]
    assert written == ["CACHEDIR.TAG", "layout.json", f"packs/{pack}", "packs/list", "keys"]
    assert parse_listing((store / "packs" / "list").read_bytes()) == [pack]
    assert cli_main(["verify", str(store)]) == 0
    assert sources.read_back(store, tmp_path / "node1", sources.in_a) == N_KERNELS + 1

    # Again, packed or loose: the pack's index (two Range GETs) says the store has it all.
    for args in (["--pack"], []):
        status, report = publish_json(capsys, *args, str(sources.a), url)
        assert (status, report["published"], report["unchanged"]) == (0, 0, N_KERNELS + 1)
        entries = settled(nginx)
        assert puts(entries) == []
        assert sum(1 for e in entries if e.range and e.uri.endswith(pack) and e.status == 206) == 2

    # Another source: a second pack, both listed, only what is new in it.
    status, report = publish_json(capsys, "--pack", str(sources.a), str(sources.b), url)
    assert (status, report["published"], report["unchanged"]) == (0, 1, N_KERNELS + 1)
    newer = report["packs"][0].rsplit("/", 1)[1]
    assert puts(settled(nginx)) == [f"packs/{newer}", "packs/list", "keys"]
    assert parse_listing((store / "packs" / "list").read_bytes()) == sorted([pack, newer], reverse=True)
    assert cli_main(["verify", str(store)]) == 0
    assert sources.read_back(store, tmp_path / "node2", sources.in_a + sources.in_b) == N_KERNELS + 2
    http_node = sources.read_back(nginx.read_url("store"), tmp_path / "http-node", sources.in_a + sources.in_b)
    assert http_node == N_KERNELS + 2


# The publisher, killed by a signal right after its first blob upload (as a crash or an OOM kill would).
KILLED_AFTER_FIRST_BLOB = r"""
import os, signal, sys
from cuda_program_cas._verbs import pubtarget as verb
real = verb.Target.put_blob
def put_blob(self, digest, blob):
    real(self, digest, blob)
    os.kill(os.getpid(), signal.SIGKILL)
verb.Target.put_blob = put_blob
from cuda_program_cas._cli.main import main
sys.exit(main(["publish", sys.argv[1], sys.argv[2]]))
"""


def test_an_interrupted_publish_is_finished_by_the_next_run(
    sources: Sources, nginx: Nginx, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url, store = nginx.dav_url("store"), nginx.root / "store"
    done = run_python(KILLED_AFTER_FIRST_BLOB, str(sources.a), url, env={"NETRC": str(tmp_path / "no-netrc")})
    assert done.returncode == -signal.SIGKILL, done.stderr
    first = puts(settled(nginx))
    assert [p.split("/")[0] for p in first] == ["CACHEDIR.TAG", "layout.json", "blobs"]
    assert [p for p in store.rglob("*") if p.is_file() and "index" in p.parts] == []  # no manifest yet

    status, report = publish_json(capsys, str(sources.a), url)
    assert (status, report["published"], report["blobs_published"]) == (0, N_KERNELS + 1, N_KERNELS - 1)
    written = puts(settled(nginx))
    assert first[2] not in written  # the blob already there is not sent again
    assert cli_main(["verify", str(store)]) == 0
    assert sources.read_back(store, tmp_path / "node", sources.in_a) == N_KERNELS + 1


class StrictDav(Nginx):
    """nginx as a strict WebDAV server: a PUT below a missing collection gets 409 Conflict (RFC 4918 9.7.1).

    Without ``create_full_put_path`` nginx itself answers 500 there; the rule answers 409 first.
    """

    def _config(self) -> str:
        rule = (
            '        set $parent "";\n'
            '        set $put_missing "";\n'
            '        if ($uri ~ "^/dav/(.*/)?[^/]+$") { set $parent $1; }\n'
            '        if ($request_method = PUT) { set $put_missing "put"; }\n'
            f'        if (!-d "{self.root}/$parent") {{ set $put_missing "${{put_missing}}-missing"; }}\n'
            '        if ($put_missing = "put-missing") { return 409; }\n'
        )
        conf = super()._config().replace("create_full_put_path on;", "")
        return conf.replace("        location /store/", rule + "        location /store/", 1)


def test_a_server_that_wants_collections_made_gets_them(
    sources: Sources, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    server = StrictDav(tmp_path / "nginx")
    nginx_or_skip(tmp_path / "probe").stop()  # skips where nginx cannot run at all
    with server:
        status, report = publish_json(capsys, str(sources.a), server.dav_url("store"))
        assert status == 0 and report["published"] == N_KERNELS + 1
        entries = settled(server)
    conflicts = [n for n, e in enumerate(entries) if e.status == 409]
    assert entries[conflicts[0]].uri == "/dav/store/CACHEDIR.TAG" and len(conflicts) > 1  # and each new folder's first
    for n in conflicts:  # each sent again once its folders were made
        assert any(e.method == "PUT" and e.uri == entries[n].uri and e.status == 201 for e in entries[n + 1 :])
    assert any(e.method == "MKCOL" and e.uri == "/dav/store/" and e.status == 201 for e in entries)
    check_order(server.root / "store", puts(entries))
    assert cli_main(["verify", str(server.root / "store")]) == 0


def test_the_store_keeps_what_it_has_and_gets_back_a_lost_blob(
    nginx: Nginx, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url, store = nginx.dav_url("store"), nginx.root / "store"
    first, second = tmp_path / "first", tmp_path / "second"
    with ContentAddressedProgramCache(first) as cache:
        cache["k"] = b"first bytes"
    with ContentAddressedProgramCache(second) as cache:
        cache["k"] = b"other bytes"
    assert publish_json(capsys, str(first), url)[1]["published"] == 1
    status, report = publish_json(capsys, str(second), url)
    assert (status, report["conflicts"], report["published"]) == (0, 1, 0)  # the first published wins
    assert puts(settled(nginx)) == ["CACHEDIR.TAG", "layout.json", *puts_of_one_entry(store), "keys"]
    blob = next(p for p in (store / "blobs").rglob("*") if p.is_file())
    blob.unlink()  # lost on the server (a collector, an operator)
    status, report = publish_json(capsys, str(first), url)
    assert (status, report["unchanged"], report["blobs_published"]) == (0, 1, 1)
    assert blob.read_bytes() == b"first bytes"
    assert cli_main(["verify", str(store)]) == 0


def puts_of_one_entry(store: Path) -> list[str]:
    blob = next(p for p in (store / "blobs").rglob("*") if p.is_file())
    manifest = next(p for p in (store / "index").rglob("*") if p.is_file())
    return [str(p.relative_to(store)) for p in (blob, manifest)]


def _cli(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cuda_program_cas", *args],
        capture_output=True, text=True, timeout=60, check=False, env={**os.environ, **env},
    )  # fmt: skip


@pytest.mark.slow
def test_a_server_that_wants_a_token_gets_it_and_it_is_never_shown(sources: Sources, tmp_path: Path) -> None:
    log = tmp_path / "cas.log"
    netrc = tmp_path / "netrc"
    netrc.write_text(f"machine 127.0.0.1 login cas password {TOKEN}\n")
    netrc.chmod(0o600)
    base = {"CUDA_PROGRAM_CAS_LOG": str(log), "NETRC": str(tmp_path / "no-netrc")}
    with nginx_or_skip(tmp_path / "nginx", token=TOKEN) as server:
        url, store = server.dav_url("store"), server.root / "store"
        refused = _cli(["publish", str(sources.a), url], base)
        assert refused.returncode == 1, refused.stderr
        assert refused.stdout == "" and len(refused.stderr.splitlines()) == 1 and "Traceback" not in refused.stderr
        assert "401" in refused.stderr and "CUDA_PROGRAM_CAS_HTTP_TOKEN" in refused.stderr
        assert not store.exists()
        by_env = _cli(["publish", str(sources.a), url], {**base, "CUDA_PROGRAM_CAS_HTTP_TOKEN": TOKEN})
        assert by_env.returncode == 0, by_env.stderr
        assert "published 5 entries" in by_env.stdout
        by_netrc = _cli(["publish", "--pack", str(sources.b), url], {**base, "NETRC": str(netrc)})
        assert by_netrc.returncode == 0, by_netrc.stderr
        assert "published 1 entry" in by_netrc.stdout
        logs = [server.access_log, server.error_log]
    assert cli_main(["verify", str(store)]) == 0
    said = [r.stdout + r.stderr for r in (refused, by_env, by_netrc)]
    said += [p.read_text(errors="replace") for p in [*logs, log] if p.exists()]
    assert all(TOKEN not in text for text in said)


def test_a_server_that_is_down_is_one_line_and_exit_1(sources: Sources, capsys: pytest.CaptureFixture[str]) -> None:
    url = refused_url("store")
    capsys.readouterr()
    assert cli_main(["publish", str(sources.a), url]) == 1
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1
    assert err.startswith("cuda-program-cas publish: error: ") and "refused" in err and url in err


@pytest.mark.parametrize("command", [["gc"], ["repack"], ["verify"], ["gc", "--grace", "1d", "--dry-run"]])
def test_maintenance_given_a_url_is_bad_usage(command: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    capsys.readouterr()
    assert cli_main([*command, "https://cache.example/store"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1
    assert "is a store URL" in err and "where the store's files are" in err


def test_bad_store_urls_and_options_are_bad_usage(
    sources: Sources, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(LayoutError, match="store URL"):
        collect("http://cache.example/store")
    for args, said in (
        ([str(sources.a), "http://user:pw@cache.example/store"], "carries credentials"),
        (["--group-shared", str(sources.a), "http://cache.example/store"], "--group-shared"),
        ([str(sources.a), "http://cache.example/store?x=1"], "query"),
    ):
        capsys.readouterr()
        assert cli_main(["publish", *args]) == 2
        err = capsys.readouterr().err
        assert len(err.splitlines()) == 1 and said in err and "pw" not in err


def test_a_pack_dropped_from_the_listing_by_another_publisher_is_listed_again(
    sources: Sources, nginx: Nginx, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from cuda_program_cas._disk.packset import encode_listing
    from cuda_program_cas._remote.http import HttpEngine

    url, store = nginx.dav_url("store"), nginx.root / "store"
    assert publish_json(capsys, "--pack", str(sources.a), url)[0] == 0
    settled(nginx)
    older = parse_listing((store / "packs" / "list").read_bytes())
    assert older is not None
    real_put = HttpEngine.put

    def put_then_lose_it(engine: HttpEngine, name: str, data: bytes) -> str:
        status = real_put(engine, name, data)
        if name == "packs/list" and not lost:
            # Another publisher read the listing before this PUT and writes it now, with its own pack only.
            lost.append(True)
            (store / "tmp-list").write_bytes(encode_listing([*older, "pack-0000000000000001-00000000.cpk"]))
            os.replace(store / "tmp-list", store / "packs" / "list")
        return status

    lost: list[bool] = []
    monkeypatch.setattr(HttpEngine, "put", put_then_lose_it)
    status, report = publish_json(capsys, "--pack", str(sources.b), url)
    assert status == 0 and lost
    ours = report["packs"][0].rsplit("/", 1)[1]
    names = parse_listing((store / "packs" / "list").read_bytes())
    assert names is not None and ours in names and set(older) <= set(names)
    assert [p for p in puts(settled(nginx)) if p == "packs/list"] == ["packs/list"] * 2


@pytest.mark.slow
def test_publish_over_https_trusts_the_ca_bundle_it_is_given(sources: Sources, tmp_path: Path) -> None:
    base = {"NETRC": str(tmp_path / "no-netrc")}
    with nginx_or_skip(tmp_path / "nginx", tls=True) as server:
        url, store = server.dav_url("store"), server.root / "store"
        assert url.startswith("https://") and server.cert is not None
        untrusted = _cli(["publish", str(sources.b), url], base)
        assert untrusted.returncode == 1 and len(untrusted.stderr.splitlines()) == 1, untrusted.stderr
        assert "tls" in untrusted.stderr and not store.exists()
        trusted = _cli(["publish", str(sources.b), url], {**base, "CUDA_PROGRAM_CAS_CA_BUNDLE": str(server.cert)})
        assert trusted.returncode == 0, trusted.stderr
    assert cli_main(["verify", str(store)]) == 0


# -- What the server holds, not what it answered -------------------------------------------------


def publish_fails(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    """Run publish that must fail: exit 1, nothing on stdout, one line on stderr; that line."""
    capsys.readouterr()
    assert cli_main(["publish", *args]) == 1
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1 and "Traceback" not in err, (out, err)
    assert err.startswith("cuda-program-cas publish: error: ")
    return err.strip()


def blob_sizes(source: Path) -> set[int]:
    """The sizes of the blobs of ``source`` as a shared store holds them (compressed)."""
    return {len(frame.encode(p.read_bytes())) for p in (source / "blobs").rglob("*") if p.is_file()}


@pytest.mark.parametrize(
    "case",
    [
        # Every file: the first upload (CACHEDIR.TAG) is read back, and the run stops there.
        ({"/": "nothing"}, False, r"/store/CACHEDIR\.TAG: not stored: the server answered 201 to PUT but holds 0 of"),
        ({"/": "half"}, True, r"/store/CACHEDIR\.TAG: not stored: .* but holds [\d,]+ of its [\d,]+ bytes"),
        ({"/store/layout.json": "half"}, False, r"/store/layout\.json: not stored: .* holds [\d,]+ of its"),
        # Blobs only: no manifest is sent that names a blob the server does not hold.
        ({"/store/blobs/": "nothing"}, False, r"/store/blobs/[0-9a-f]{2}/[0-9a-f]{62}: not stored: .* holds 0 of"),
        ({"/store/blobs/": "half"}, False, r"/store/blobs/[0-9a-f]{2}/[0-9a-f]{62}: not stored: .* holds [\d,]+ of"),
        ({"/store/index/": "half"}, False, r"/store/index/[0-9a-f]{2}/[0-9a-f]{62}: not stored: .* holds [\d,]+ of"),
        ({"/store/packs/pack-": "half"}, True, r"/store/packs/pack-[0-9a-f-]+\.cpk: not stored: .* holds [\d,]+ of"),
        # The listing: a server that dropped it is not "other publishers kept replacing it".
        ({"/store/packs/list": "nothing"}, True, r"/store/packs/list: not stored: .* holds 0 of its [\d,]+ bytes"),
        ({"/store/packs/list": "half"}, True, r"/store/packs/list: not stored: .* holds [\d,]+ of its [\d,]+ bytes"),
    ],
    ids=lambda case: "-".join([*(f"{k.strip('/') or 'all'}={v}" for k, v in case[0].items()), *(["pack"] * case[1])]),
)
def test_a_server_that_answers_201_and_keeps_less_fails_the_publish(
    sources: Sources, tmp_path: Path, capsys: pytest.CaptureFixture[str], case: tuple[dict[str, str], bool, str]
) -> None:
    import re

    from testkit.faults import Fault, FaultServer

    lies, pack, said = case
    with FaultServer(tmp_path / "dav", writable=True) as server:
        for prefix, lie in lies.items():
            server.set(prefix, Fault.keep_nothing() if lie == "nothing" else Fault.keep_half())
        err = publish_fails(capsys, *(["--pack"] if pack else []), str(sources.a), server.url("store"))
        log = [(r.method, r.path) for r in server.log]
    assert re.search(said, err), err
    assert err.endswith("is it a real WebDAV store?") and "other publishers" not in err
    if "/blobs/" in err:
        found = re.search(r"holds ([\d,]+) of its ([\d,]+) bytes", err)
        assert found is not None
        held, whole = (int(n.replace(",", "")) for n in found.groups())
        assert whole in blob_sizes(sources.a) and held == (0 if lies["/store/blobs/"] == "nothing" else whole // 2)
        assert not [p for m, p in log if m == "PUT" and "/index/" in p]  # nothing names what it lacks
    # Each upload was read back once, at once: the failing one is the last request.
    assert log[-1][0] in ("GET", "HEAD") and log[-2][0] == "PUT"


def test_the_check_costs_one_request_per_upload(
    sources: Sources, nginx: Nginx, capsys: pytest.CaptureFixture[str]
) -> None:
    from collections import Counter

    def counted() -> Counter[str]:
        return Counter(f"{e.method} {e.uri.split('/dav/store/', 1)[1].split('/')[0]}" for e in settled(nginx))

    # Loose, 5 entries and 4 blobs into a new store: 22 requests without the check, 33 with it; then the key list:
    # read (none), written, read back.
    assert publish_json(capsys, str(sources.a), nginx.dav_url("store"))[0] == 0
    assert counted() == {
        "GET layout.json": 2, "PUT layout.json": 1, "HEAD CACHEDIR.TAG": 1, "PUT CACHEDIR.TAG": 1,
        "GET CACHEDIR.TAG": 1,  # read back
        "GET index": 5 + 5,  # absent before, then each read back
        "HEAD blobs": 4 + 4,  # absent before, then each read back
        "PUT blobs": 4, "PUT index": 5, "GET keys": 2, "PUT keys": 1,
    }  # fmt: skip
    # Packed, into a new store: 13 requests without the check, 16 with it (the listing was read back before).
    assert publish_json(capsys, "--pack", str(sources.a), nginx.dav_url("packed"))[0] == 0
    entries = settled(nginx)
    kinds = Counter(f"{e.method} {e.uri.split('/dav/packed/', 1)[1].split('/')[0]}" for e in entries)
    assert kinds == {
        "GET layout.json": 2, "PUT layout.json": 1, "HEAD CACHEDIR.TAG": 1, "PUT CACHEDIR.TAG": 1,
        "GET CACHEDIR.TAG": 1, "GET index": 5, "PUT packs": 2, "GET packs": 3, "GET keys": 2, "PUT keys": 1,
    }  # fmt: skip
    ranged = [e.range for e in entries if e.method == "GET" and ".cpk" in e.uri]
    assert ranged == ["bytes=-64"]  # the pack's size and its last 64 bytes, trailer included


class WorkerNginx(Nginx):
    """nginx whose worker runs as ``nobody``, as a root-started nginx does by default, with its own body folder."""

    def __init__(self, prefix: Path, root: Path, body: Path) -> None:
        super().__init__(prefix, root)
        self.body = body

    def _config(self) -> str:
        return super()._config().replace("user root root;", "user nobody nogroup;")

    def _body_temp(self) -> Path:
        return self.body


@pytest.fixture
def open_dir() -> Iterator[Path]:
    """A folder outside pytest's owner-only ones, that nginx's worker (``nobody``) can enter."""
    import shutil
    import tempfile

    path = Path(tempfile.mkdtemp(prefix="cpcas-ngx-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_nginx_that_cannot_write_the_store_names_the_likely_causes(
    sources: Sources, open_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from conftest import is_root

    if not is_root():
        pytest.skip("nginx's worker runs as another user only when its master is root")
    nginx_or_skip(open_dir / "probe").stop()  # skips where nginx cannot run at all
    root, body = open_dir / "root", open_dir / "body"
    (root / "store").mkdir(parents=True)  # root's, mode 0755: nobody may not write it
    body.mkdir()
    os.chown(body, 65534, 65534)
    with WorkerNginx(open_dir / "nginx", root, body) as server:
        err = publish_fails(capsys, str(sources.a), server.dav_url("store"))
        logged = server.log_tail()
    assert "/store/CACHEDIR.TAG: HTTP 500: PUT answered 500" in err
    for cause in ("not writable by nginx's worker user", "create_full_put_path is off", "full", "error log"):
        assert cause in err, err
    assert "Permission denied" in logged  # what nginx itself says
    assert os.listdir(root / "store") == []


# The publisher, in a child whose address space is bounded: a read that follows what a server claims fails there.
BOUNDED_PUBLISH = r"""
import resource, sys
resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))
from cuda_program_cas._cli.main import main
sys.exit(main(["publish", sys.argv[1], sys.argv[2], "--json"]))
"""


def test_a_pack_trailer_that_claims_a_huge_index_is_not_fetched(
    sources: Sources, nginx: Nginx, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import struct

    from cuda_program_cas._base.config import DEFAULT_MAX_ENTRY_BYTES
    from cuda_program_cas._disk.packset import encode_listing

    url, store = nginx.dav_url("store"), nginx.root / "store"
    assert publish_json(capsys, str(sources.b), url)[0] == 0
    # A pack whose trailer claims 2^32 - 1 entries, and whose size (412 GB, sparse) agrees.
    count = 2**32 - 1
    size = 8 + 1024 + count * 96 + 56  # header, fan-out, entries, trailer
    name = "pack-00000000000000ff-00000000.cpk"
    (store / "packs").mkdir()
    with open(store / "packs" / name, "wb") as f:
        f.write(b"cpcaspk\x01")
        f.truncate(size)
        f.seek(size - 56)
        f.write(struct.pack("<32sQII8s", bytes(32), 8, count, 1, b"cpcasidx"))
    (store / "packs" / "list").write_bytes(encode_listing([name]))
    settled(nginx)
    done = run_python(BOUNDED_PUBLISH, str(sources.a), url, env={"NETRC": str(tmp_path / "no-netrc")}, timeout=60)
    asked = [e.range for e in settled(nginx) if e.uri.endswith(name)]
    assert done.returncode == 0, done.stderr[-2000:]
    assert asked == ["bytes=-56"]  # the trailer; its index (412 GB > 256 MiB) never
    assert size - 56 - 8 > DEFAULT_MAX_ENTRY_BYTES
    report = json.loads(done.stdout)
    assert (report["published"], report["unchanged"]) == (N_KERNELS + 1, 0)  # an unusable pack holds nothing
    assert len([p for p in (store / "index").rglob("*") if p.is_file()]) == N_KERNELS + 2  # a's entries, and b's
