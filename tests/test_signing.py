"""Signed entries: an attacker who can write the shared store, without the site's private key, gets no node to load
bytes the site did not sign for that key.

Keys are made with the real ``openssl`` CLI, as docs/guarantees.md tells an operator.
Entries are real NVRTC cubins uploaded by write-back with the site's key. The
attacker then has full write access to the store: it rewrites manifests, swaps
blobs, replays other keys' signed manifests, signs with a key of its own, strips
signatures and plants a pack. A node trusting the site's key must return, for every
key, the site's bytes for that key or a miss: never anything else.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import SAXPY, compile_program
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_cluster import SCALE

from cuda_program_cas import CacheStore, ContentAddressedProgramCache, digest_of, verify
from cuda_program_cas._base import frame
from cuda_program_cas._base.signing import Signer
from cuda_program_cas._disk.layout import url_path
from cuda_program_cas.index import Manifest, key_id

#: Kernels whose cubins the site uploads (each with its own key).
SOURCES = {
    "saxpy": SAXPY,
    "scale": SCALE,
    "neg": 'extern "C" __global__ void neg(float *x) { x[threadIdx.x] = -x[threadIdx.x]; }',
}


def openssl_key(path: Path) -> tuple[Path, Path]:
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    subprocess.run(["openssl", "genpkey", "-algorithm", "ed25519", "-out", str(path)], check=True, capture_output=True)
    pub = path.with_suffix(".pub")
    subprocess.run(["openssl", "pkey", "-in", str(path), "-pubout", "-out", str(pub)], check=True, capture_output=True)
    return path, pub


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """A shared store filled by write-back with the site's key: key name -> (key id, the true cubin)."""
    base = tmp_path_factory.mktemp("site")
    private, public = openssl_key(base / "site.key")
    attacker_private, _ = openssl_key(base / "attacker.key")
    store = base / "store"
    CacheStore(store).close()
    mp = pytest.MonkeyPatch()
    mp.setenv("CUDA_PROGRAM_CAS_SIGNING_KEY", str(private))
    try:
        truth = {}
        with ContentAddressedProgramCache(base / "writer", shared=[f"{store}|write"]) as cache:
            for name, src in SOURCES.items():
                truth[name] = bytes(compile_program(src, cache=cache).code)
            cache.close()
            assert cache.stats().uploads == len(SOURCES)
    finally:
        mp.undo()
    kids = {}
    for shard in (store / "index").iterdir():
        for f in shard.iterdir():
            data = f.read_bytes()
            assert data.count(b"\n") == 2 and b"\ned25519 " in data  # signed: the line, then the signature
            digest = data.split()[2].decode()
            blob = frame.decode((store / url_path("blobs", digest)).read_bytes(), 1 << 30)  # stored compressed
            name = next(n for n, code in truth.items() if code == blob)
            kids[name] = shard.name + f.name
    return {"store": store, "public": public, "attacker": attacker_private, "truth": truth, "kids": kids}


def _copy(site: dict[str, object], tmp_path: Path) -> Path:
    dst = tmp_path / "store"
    shutil.copytree(site["store"], dst)  # type: ignore[arg-type]
    return dst


def _manifest_path(store: Path, kid: str) -> Path:
    return store / url_path("index", kid)


def _lookup_all(
    store: Path, site: dict[str, object], tmp_path: Path, trusted: str
) -> tuple[dict[str, bytes | None], dict[str, int]]:
    """Each key's bytes as a fresh node trusting ``trusted`` sees them through the shared store."""
    os.environ["CUDA_PROGRAM_CAS_TRUSTED_KEYS"] = trusted
    try:
        node = CacheStore(tmp_path / f"node{len(list(tmp_path.iterdir()))}", shared=[store])
        got = {}
        for name, kid in site["kids"].items():  # type: ignore[attr-defined]
            found = node.inner.find(kid)
            got[name] = None if found is None else found[0]
        return got, node.counters()
    finally:
        del os.environ["CUDA_PROGRAM_CAS_TRUSTED_KEYS"]


def test_signed_entries_are_served_to_a_trusting_node(site, tmp_path: Path) -> None:
    got, counts = _lookup_all(_copy(site, tmp_path), site, tmp_path, str(site["public"]))
    assert got == site["truth"]
    assert counts["untrusted"] == 0
    # verify and gc take a signed manifest as well-formed: nothing in the store is damaged.
    report = verify(site["store"])
    assert report.unfixed == 0 and not report.problems, report.problems


def test_an_unsigned_store_is_untrusted_and_without_keys_nothing_changes(tmp_path: Path, site) -> None:
    plain = tmp_path / "plain"
    with ContentAddressedProgramCache(plain) as cache:
        code = bytes(compile_program(SAXPY, cache=cache).code)
    kid = next(shard.name + f.name for shard in (plain / "index").iterdir() for f in shard.iterdir())
    os.environ["CUDA_PROGRAM_CAS_TRUSTED_KEYS"] = str(site["public"])
    try:
        node = CacheStore(tmp_path / "n1", shared=[plain])
        assert node.inner.find(kid) is None
        assert node.counters()["untrusted"] == 1
    finally:
        del os.environ["CUDA_PROGRAM_CAS_TRUSTED_KEYS"]
    node = CacheStore(tmp_path / "n2", shared=[plain])  # no keys configured: as before
    assert node.inner.find(kid) == (code, str(plain))


# -- the attacker ---------------------------------------------------------------------------------------------------


def _plant(store: Path, site, name: str, evil: bytes) -> bytes:
    """The attacker's blob stored under its (correct) digest; the manifest line mapping the key to it."""
    digest = digest_of(evil)
    blob = store / url_path("blobs", digest)
    blob.parent.mkdir(parents=True, exist_ok=True)
    blob.write_bytes(evil)
    return Manifest(digest, len(evil), site["kids"][name]).encode()


def _rewrite_to_own_blob(store: Path, site, name: str) -> None:
    """Point the key at a blob of the attacker's (correctly hashed), keeping the site's signature line."""
    path = _manifest_path(store, site["kids"][name])
    sig = path.read_bytes().split(b"\n")[1] + b"\n"
    path.write_bytes(_plant(store, site, name, b"\x7fELF evil" * 100) + sig)


def _strip_signature(store: Path, site, name: str) -> None:
    path = _manifest_path(store, site["kids"][name])
    path.write_bytes(path.read_bytes().split(b"\n")[0] + b"\n")


def _sign_with_own_key(store: Path, site, name: str) -> None:
    line = _plant(store, site, name, b"\x7fELF signed by someone else" * 50)
    _manifest_path(store, site["kids"][name]).write_bytes(line + Signer.from_file(str(site["attacker"])).sign(line))


def _swap_blob(store: Path, site, name: str) -> None:
    """Replace the bytes of the key's blob file (its name, the site's digest, unchanged)."""
    digest = _manifest_path(store, site["kids"][name]).read_bytes().split()[2].decode()
    (store / url_path("blobs", digest)).write_bytes(b"\x7fELF swapped")


def _replay_other(store: Path, site, name: str) -> None:
    """Copy another key's signed manifest (a valid signature, by the site) onto this key's path."""
    other = next(n for n in site["kids"] if n != name)
    _manifest_path(store, site["kids"][name]).write_bytes(_manifest_path(store, site["kids"][other]).read_bytes())


def _plant_pack(store: Path, site, name: str) -> None:
    """A pack of the attacker's mapping the key to its bytes (packs carry no signature)."""
    from cuda_program_cas._disk.layout import Layout
    from cuda_program_cas._disk.pack import write_pack
    from cuda_program_cas._disk.writer import Writer

    evil = b"\x7fELF packed" * 40
    lay = Layout(str(store))
    write_pack(lay, [(site["kids"][name], digest_of(evil), evil, 1)], Writer(lay).write_file)


ATTACKS = {
    "rewrite": _rewrite_to_own_blob,
    "strip": _strip_signature,
    "own-key": _sign_with_own_key,
    "swap-blob": _swap_blob,
    "replay": _replay_other,
    "pack": _plant_pack,
}


@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_each_attack_loads_no_wrong_binary(site, tmp_path: Path, attack: str) -> None:
    store = _copy(site, tmp_path)
    ATTACKS[attack](store, site, "saxpy")
    got, counts = _lookup_all(store, site, tmp_path, str(site["public"]))
    assert got["saxpy"] in (None, site["truth"]["saxpy"]), f"{attack}: a wrong binary was loaded"
    assert {n: got[n] for n in ("scale", "neg")} == {n: site["truth"][n] for n in ("scale", "neg")}
    if attack != "pack":  # a planted pack is not read at all by a trusting node: saxpy stays a hit
        assert got["saxpy"] is None
        assert counts["untrusted"] + counts["corrupt"] >= 1
    else:
        assert got["saxpy"] == site["truth"]["saxpy"]


def test_without_keys_the_same_attacks_do_load_the_attackers_bytes(site, tmp_path: Path) -> None:
    """The threat that signatures remove is real: a node trusting no key takes a rewritten entry."""
    store = _copy(site, tmp_path)
    _rewrite_to_own_blob(store, site, "saxpy")
    node = CacheStore(tmp_path / "node", shared=[store])
    found = node.inner.find(site["kids"]["saxpy"])
    assert found is not None and found[0].startswith(b"\x7fELF evil")


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.sampled_from(sorted(ATTACKS)), st.sampled_from(sorted(SOURCES))), max_size=6))
def test_any_sequence_of_attacks_loads_only_the_sites_bytes(site, tmp_path_factory, attacks) -> None:
    tmp = tmp_path_factory.mktemp("prop")
    store = _copy(site, tmp)
    for attack, name in attacks:
        ATTACKS[attack](store, site, name)
    got, _counts = _lookup_all(store, site, tmp, str(site["public"]))
    for name, data in got.items():
        assert data in (None, site["truth"][name]), f"{attacks}: {name} got bytes the site did not sign for it"


def test_a_bad_trusted_key_fails_closed_and_a_bad_signing_key_drops_uploads(site, tmp_path: Path, caplog) -> None:
    caplog.set_level(logging.WARNING, logger="cuda_program_cas")
    bogus = tmp_path / "bogus.pub"
    bogus.write_text("not a key\n")
    got, counts = _lookup_all(_copy(site, tmp_path), site, tmp_path, str(bogus))
    assert got == dict.fromkeys(site["truth"])  # nothing trusted
    assert counts["untrusted"] == len(site["truth"])
    assert any("no usable key" in r.getMessage() for r in caplog.records)
    caplog.clear()
    store = tmp_path / "wb"
    CacheStore(store).close()
    os.environ["CUDA_PROGRAM_CAS_SIGNING_KEY"] = str(bogus)
    try:
        writer = CacheStore(tmp_path / "writer", shared=[f"{store}|write"])
        writer.put("k", b"x" * 10)
        writer.close()
    finally:
        del os.environ["CUDA_PROGRAM_CAS_SIGNING_KEY"]
    assert writer.counters()["uploads_dropped"] == 1 and writer.counters()["uploads"] == 0
    assert not any((store / "index").iterdir())
    assert [r.getMessage() for r in caplog.records if "uploads to shared store" in r.getMessage()][0].count(
        "bogus.pub"
    ) == 1
    assert key_id("k")  # the local write landed regardless
    assert writer.get("k") == b"x" * 10


# -- publish signs ---------------------------------------------------------------------------------------------------


def _unsigned_node(tmp_path: Path) -> tuple[Path, dict[str, bytes]]:
    """A node's local cache with the three kernels (its manifests unsigned, as every local cache's are)."""
    node = tmp_path / "node"
    with ContentAddressedProgramCache(node) as cache:
        codes = {name: bytes(compile_program(src, cache=cache).code) for name, src in SOURCES.items()}
    return node, codes


def test_publish_signs_and_signs_again_what_the_store_holds_unsigned(site, tmp_path: Path, monkeypatch) -> None:
    from cuda_program_cas import publish

    node, codes = _unsigned_node(tmp_path)
    store = tmp_path / "pub"
    publish([node], store)  # no key: unsigned, as before
    got, counts = _lookup_all(store, site, tmp_path, str(site["public"]))
    assert got == dict.fromkeys(SOURCES) and counts["untrusted"] == 3
    monkeypatch.setenv("CUDA_PROGRAM_CAS_SIGNING_KEY", str(site["store"].parent / "site.key"))
    report = publish([node], store)
    assert report.replaced == 3  # signed in place
    assert publish([node], store).replaced == 0  # and then left alone
    monkeypatch.delenv("CUDA_PROGRAM_CAS_SIGNING_KEY")
    got, counts = _lookup_all(store, site, tmp_path, str(site["public"]))
    assert got == codes and counts["untrusted"] == 0


def test_publish_refuses_a_signing_key_it_cannot_use(tmp_path: Path, monkeypatch, capsys) -> None:
    from cuda_program_cas._cli.main import main

    node, _codes = _unsigned_node(tmp_path)
    bad = tmp_path / "bad.key"
    bad.write_text("-----BEGIN PRIVATE KEY-----\nnot base64\n-----END PRIVATE KEY-----\n")
    monkeypatch.setenv("CUDA_PROGRAM_CAS_SIGNING_KEY", str(bad))
    assert main(["publish", str(node), str(tmp_path / "store")]) == 2
    err = capsys.readouterr().err
    assert "bad.key" in err and "Traceback" not in err
    assert not (tmp_path / "store").exists()


def test_over_http_a_trusting_node_takes_published_entries_and_refuses_rewritten_ones(
    site, tmp_path: Path, monkeypatch
) -> None:
    from testkit.nginx import nginx_or_skip

    from cuda_program_cas import publish

    node, codes = _unsigned_node(tmp_path)
    with nginx_or_skip(tmp_path / "nginx") as server:
        monkeypatch.setenv("CUDA_PROGRAM_CAS_SIGNING_KEY", str(site["store"].parent / "site.key"))
        publish([node], server.dav_url("store"))
        monkeypatch.delenv("CUDA_PROGRAM_CAS_SIGNING_KEY")
        url = server.read_url("store")
        got, counts = _lookup_all(url, site, tmp_path, str(site["public"]))  # type: ignore[arg-type]
        assert got == codes and counts["untrusted"] == 0
        # The server's files rewritten by someone without the key: the node misses, loads nothing else.
        _rewrite_to_own_blob(server.root / "store", site, "saxpy")
        got, counts = _lookup_all(url, site, tmp_path, str(site["public"]))  # type: ignore[arg-type]
        assert got["saxpy"] is None and counts["untrusted"] == 1
        assert {n: got[n] for n in ("scale", "neg")} == {n: codes[n] for n in ("scale", "neg")}


# -- a signed cluster is hard to misconfigure ------------------------------------------------------------------------


@pytest.mark.parametrize("signing", ["none", "attacker"])
def test_a_trusting_writer_without_the_sites_key_writes_nothing_back_and_says_so_once(
    site, tmp_path: Path, monkeypatch, caplog, signing: str
) -> None:
    """A node that trusts the site's key but cannot sign as the site would only overwrite signed entries."""
    caplog.set_level(logging.WARNING, logger="cuda_program_cas")
    store = _copy(site, tmp_path)
    before = {p: p.read_bytes() for p in store.rglob("*") if p.is_file()}
    monkeypatch.setenv("CUDA_PROGRAM_CAS_TRUSTED_KEYS", str(site["public"]))
    if signing == "attacker":
        monkeypatch.setenv("CUDA_PROGRAM_CAS_SIGNING_KEY", str(site["attacker"]))
    writer = CacheStore(tmp_path / "writer", shared=[f"{store}|write"])
    for i in range(3):
        writer.put(f"k{i}", b"x" * (10 + i))
    writer.close()
    counts = writer.counters()
    assert counts["uploads"] == 0 and counts["uploads_dropped"] == 3
    assert {p: p.read_bytes() for p in store.rglob("*") if p.is_file()} == before  # nothing overwritten
    said = [r for r in caplog.records if "uploads to shared store" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.WARNING
    assert "CUDA_PROGRAM_CAS_TRUSTED_KEYS" in said[0].getMessage()
    assert writer.get("k1") == b"x" * 11  # the local cache has them


def test_the_sites_own_key_writes_back_to_a_trusting_node(site, tmp_path: Path, monkeypatch) -> None:
    store = _copy(site, tmp_path)
    monkeypatch.setenv("CUDA_PROGRAM_CAS_TRUSTED_KEYS", str(site["public"]))
    monkeypatch.setenv("CUDA_PROGRAM_CAS_SIGNING_KEY", str(site["store"].parent / "site.key"))  # type: ignore[union-attr]
    writer = CacheStore(tmp_path / "writer", shared=[f"{store}|write"])
    writer.put("k", b"y" * 10)
    writer.close()
    assert writer.counters()["uploads"] == 1 and writer.counters()["uploads_dropped"] == 0


def test_untrusted_entries_are_said_once_per_store_at_warning_with_their_count(site, tmp_path: Path) -> None:
    """Each process that refuses entries of a store says so once, at exit, with how many it refused."""
    plain, other = tmp_path / "plain", tmp_path / "other"
    s = CacheStore(plain)
    for i in range(3):
        s.put(f"k{i}", b"z" * (20 + i))  # unsigned, as a writer without the key leaves them
    s.close()
    s = CacheStore(other)
    s.put("k0", b"w" * 20)
    s.close()
    script = (
        "import sys\n"
        "from cuda_program_cas import CacheStore\n"
        f"node = CacheStore({str(tmp_path / 'node')!r}, shared=[{str(plain)!r}, {str(other)!r}])\n"
        "for k in ('k0', 'k1', 'k2', 'k9'):\n"
        "    assert node.get(k) is None\n"
        "print(node.counters()['untrusted'], flush=True)\n"
    )
    env = {**os.environ, "CUDA_PROGRAM_CAS_TRUSTED_KEYS": str(site["public"])}
    env.pop("CUDA_PROGRAM_CAS_SHARED", None)
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["4"]  # 3 refused in plain, 1 in other (k0 of plain stops its lookup)
    lines = [line for line in done.stderr.splitlines() if "refused in this process" in line]
    assert len(lines) == 2, done.stderr
    assert f"{plain}: 3 entries refused" in lines[0] or f"{plain}: 3 entries refused" in lines[1]
    assert any(f"{other}: 1 entry refused" in line for line in lines)
    assert all("CUDA_PROGRAM_CAS_TRUSTED_KEYS" in line for line in lines)


def _config(monkeypatch, capsys, **env: str) -> tuple[int, list[str]]:
    from cuda_program_cas._cli.main import main

    for name in ("CUDA_PROGRAM_CAS_SIGNING_KEY", "CUDA_PROGRAM_CAS_TRUSTED_KEYS", "CUDA_PROGRAM_CAS_SHARED"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(f"CUDA_PROGRAM_CAS_{name}", value)
    rc = main(["config"])
    return rc, [line for line in capsys.readouterr().out.splitlines() if line.startswith("problem:")]


def test_config_checks_the_keys(site, tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("CUDA_PROGRAM_CAS_DIR", str(tmp_path / "cache"))
    private = str(site["store"].parent / "site.key")  # type: ignore[union-attr]
    public = str(site["public"])
    store = f"{tmp_path / 'store'}|write"
    assert _config(monkeypatch, capsys, SIGNING_KEY=private, TRUSTED_KEYS=public, SHARED=store) == (0, [])
    rc, problems = _config(monkeypatch, capsys, SIGNING_KEY=public, TRUSTED_KEYS=public)
    assert rc == 1 and len(problems) == 1 and "a public key" in problems[0] and "site.pub" in problems[0]
    rc, problems = _config(monkeypatch, capsys, TRUSTED_KEYS=f"{public} {tmp_path / 'missing.pub'}")
    assert rc == 1 and len(problems) == 1 and "missing.pub" in problems[0]
    rc, problems = _config(monkeypatch, capsys, SIGNING_KEY=str(site["attacker"]), TRUSTED_KEYS=public)
    assert rc == 1 and len(problems) == 1 and "is not among $CUDA_PROGRAM_CAS_TRUSTED_KEYS" in problems[0]
    rc, problems = _config(monkeypatch, capsys, TRUSTED_KEYS=public, SHARED=store)
    assert rc == 1 and len(problems) == 1 and "CUDA_PROGRAM_CAS_SIGNING_KEY is not" in problems[0]
    assert _config(monkeypatch, capsys, TRUSTED_KEYS=public, SHARED=str(tmp_path / "store")) == (0, [])
