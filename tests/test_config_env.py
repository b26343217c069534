"""``cuda-program-cas config`` lists every environment variable the package reads, from one registry.

Each variable is :data:`cuda_program_cas._base.config.VARIABLES`'s, read by the
parser its readers use: what ``config`` says accepted is what a job uses, and
anything refused (a bad size, a store URL with credentials or a query, a bad
duration) is a problem line and exit 1. Tokens are never printed.
"""

from __future__ import annotations

import json
import logging
import random
import re
import subprocess
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import cuda_program_cas
from cuda_program_cas._base import config as cfg
from cuda_program_cas._base.urls import STORE_SCHEMES
from cuda_program_cas._cli.main import main

PACKAGE = Path(cuda_program_cas.__file__).resolve().parent
TOKEN = "tok-3f9a1c-never-printed"  # noqa: S105 - a made-up token the test looks for in the output


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def bare_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """No variable of the registry set, whatever the operator's environment holds."""
    for var in cfg.VARIABLES:
        monkeypatch.delenv(var.name, raising=False)
    return monkeypatch


def test_every_name_the_package_spells_is_in_the_registry() -> None:
    """A reader added without its registry entry fails here: config would not list it."""
    spelled: set[str] = set()
    for path in PACKAGE.rglob("*.py"):
        spelled |= set(re.findall(r"[\"'](CUDA_PROGRAM_CAS(?:_[A-Z]+)*)[\"'=]", path.read_text()))
    names = [v.name for v in cfg.VARIABLES]
    assert len(names) == len(set(names))
    assert spelled and spelled <= set(names), sorted(spelled - set(names))
    from cuda_program_cas._remote import client

    assert {client.ENV_HTTP_TIMEOUT, client.ENV_HTTP_TOKEN, client.ENV_CA_BUNDLE} <= set(names)
    # The readers read through the registry's parsers: the verdict config gives is the job's.
    assert cfg.env_max_size.__code__.co_names.count("VAR_MAX_SIZE") == 1
    assert cfg.env_shared.__code__.co_names.count("VAR_SHARED") == 1


def test_config_lists_every_variable_with_its_value_source_and_verdict(
    tmp_path: Path, bare_env: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    bundle = tmp_path / "ca.pem"
    bundle.write_text("-----BEGIN CERTIFICATE-----\n")
    subprocess.run(["openssl", "genpkey", "-algorithm", "ed25519", "-out", str(tmp_path / "site.key")], check=True)
    subprocess.run(
        ["openssl", "pkey", "-in", str(tmp_path / "site.key"), "-pubout", "-out", str(tmp_path / "site.pub")],
        check=True,
    )
    good = {
        "CUDA_PROGRAM_CAS": "0",
        "CUDA_PROGRAM_CAS_DIR": str(tmp_path / "cas"),
        "CUDA_PROGRAM_CAS_MAX_SIZE": "10G",
        "CUDA_PROGRAM_CAS_SHARED": f"{tmp_path / 'store'} https://cache.example/store",
        "CUDA_PROGRAM_CAS_MAX_ENTRY_SIZE": "64M",
        "CUDA_PROGRAM_CAS_CLAIM_WAIT": "90s",
        "CUDA_PROGRAM_CAS_LOG": str(tmp_path / "cas.log"),
        "CUDA_PROGRAM_CAS_HTTP_TIMEOUT": "2,5",
        "CUDA_PROGRAM_CAS_HTTP_TOKEN": TOKEN,
        "CUDA_PROGRAM_CAS_CA_BUNDLE": str(bundle),
        "CUDA_PROGRAM_CAS_LEASE_TTL": "20s",
        "CUDA_PROGRAM_CAS_KEYS_REFRESH": "1s",
        "CUDA_PROGRAM_CAS_SIGNING_KEY": str(tmp_path / "site.key"),
        "CUDA_PROGRAM_CAS_TRUSTED_KEYS": str(tmp_path / "site.pub"),
        "CUDA_PROGRAM_CAS_REDIS_PASSWORD": TOKEN,
        "CUDA_PROGRAM_CAS_REDIS_TIMEOUT": "2",
        "CUDA_PROGRAM_CAS_JOB": "train-llm",
    }
    assert set(good) == {v.name for v in cfg.VARIABLES}  # a new variable: give it a good value here
    for name, value in good.items():
        bare_env.setenv(name, value)
    code, out, err = cli(capsys, "config", "--json")
    report = json.loads(out)
    assert code == 0 and report["problem_count"] == 0, report["problems"]
    assert sorted(report["variables"]) == sorted(v.name for v in cfg.VARIABLES)
    for name, reading in report["variables"].items():
        assert reading["source"] == "environment" and reading["accepted"] and reading["used"], name
    values = {name: reading["value"] for name, reading in report["variables"].items()}
    assert values["CUDA_PROGRAM_CAS"] == "off" and values["CUDA_PROGRAM_CAS_MAX_SIZE"] == str(10 << 30)
    assert values["CUDA_PROGRAM_CAS_SHARED"] == f"{tmp_path / 'store'} https://cache.example/store"
    assert values["CUDA_PROGRAM_CAS_CLAIM_WAIT"] == "90.0" and values["CUDA_PROGRAM_CAS_HTTP_TOKEN"] == "set"
    code, text, err = cli(capsys, "config")
    listed = [line.split()[0] for line in text.splitlines() if line.startswith("  CUDA_PROGRAM_CAS")]
    assert code == 0 and listed == [v.name for v in cfg.VARIABLES]  # in the registry's order
    assert "  CUDA_PROGRAM_CAS_HTTP_TOKEN      set (environment)" in text.splitlines()
    assert TOKEN not in out + text + err

    for name in good:
        bare_env.delenv(name)
    code, out, _ = cli(capsys, "config", str(tmp_path / "cas"), "--json")
    report = json.loads(out)
    assert code == 0 and {r["source"] for r in report["variables"].values()} == {"default"}
    assert report["variables"]["CUDA_PROGRAM_CAS_MAX_ENTRY_SIZE"]["value"] == "unset: 256 MiB"


@pytest.mark.parametrize(
    ("name", "value", "needle", "used"),
    [
        ("CUDA_PROGRAM_CAS_MAX_SIZE", "12Q", "not a size: '12Q'", False),
        ("CUDA_PROGRAM_CAS_MAX_ENTRY_SIZE", "0", "size must be positive", False),
        ("CUDA_PROGRAM_CAS_SHARED", "https://ann:pw-77@cache.example/s", "carries credentials", False),
        ("CUDA_PROGRAM_CAS_SHARED", "/kept https://cache.example/s?sig=pw-77", "has a query or fragment", True),
        ("CUDA_PROGRAM_CAS_CLAIM_WAIT", "soon", "not a duration: 'soon'", False),
        ("CUDA_PROGRAM_CAS_HTTP_TIMEOUT", "0,5", "timeouts must be positive", False),
        ("CUDA_PROGRAM_CAS_CA_BUNDLE", "/nowhere/ca.pem", "no such file", False),
        ("CUDA_PROGRAM_CAS", "yes", "it is 1, read-only or 0", False),
    ],
)
def test_a_refused_value_is_a_problem_line_and_exit_1(
    tmp_path: Path,
    bare_env: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    *,
    name: str,
    value: str,
    needle: str,
    used: bool,
) -> None:
    bare_env.setenv(name, value)
    code, out, err = cli(capsys, "config", str(tmp_path / "cas"))
    assert code == 1, out
    problems = [line for line in out.splitlines() if line.startswith("problem: ")]
    assert len(problems) == 1 and name in problems[0] and needle in problems[0], out
    line = next(line for line in out.splitlines() if line.startswith(f"  {name} "))
    assert line.endswith("(environment; partly refused)" if used else "(environment; refused)"), line
    assert "pw-77" not in out + err  # a URL's credentials or query are never printed
    code, out, _ = cli(capsys, "config", str(tmp_path / "cas"), "--json")
    report = json.loads(out)
    reading = report["variables"][name]
    assert code == 1 and report["problem_count"] == 1 and needle in report["problems"][0]
    assert (reading["accepted"], reading["used"]) == (False, used)
    if used:
        assert reading["value"] == "/kept"  # the store the package keeps, as it keeps it


def test_a_secret_is_never_shown_even_when_refused(
    tmp_path: Path, bare_env: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The registry's ``secret`` flag, as CUDA_PROGRAM_CAS_REDIS_PASSWORD will have it."""

    def refuse(text: str) -> str:
        raise ValueError("too short")

    password = cfg.Variable("CUDA_PROGRAM_CAS_TEST_PASSWORD", refuse, "a test's password", "none", secret=True)
    bare_env.setattr(cfg, "VARIABLES", (*cfg.VARIABLES, password))
    bare_env.setenv(password.name, "hunter2-secret")
    code, out, err = cli(capsys, "config", str(tmp_path / "cas"))
    assert code == 1 and "hunter2" not in out + err
    assert f"problem: {password.name}=(set, not shown) is ignored: too short" in out.splitlines()
    line = next(line for line in out.splitlines() if line.startswith(f"  {password.name} "))
    assert line.split() == [password.name, "set", "(environment;", "refused)"]


def test_a_variable_added_to_the_registry_is_listed_with_nothing_else_to_change(
    tmp_path: Path, bare_env: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    lease = cfg.Variable("CUDA_PROGRAM_CAS_LEASE_TTL", cfg.parse_duration, "a lease's lifetime", "30 s")
    bare_env.setattr(cfg, "VARIABLES", (*cfg.VARIABLES, lease))
    bare_env.setenv(lease.name, "2m")
    code, out, _ = cli(capsys, "config", str(tmp_path / "cas"), "--json")
    assert code == 0 and json.loads(out)["variables"][lease.name]["value"] == "120.0"
    assert lease.value() == 120.0


def test_a_variable_is_immutable_and_compared_by_its_fields() -> None:
    # Written out rather than a dataclass (issue 31: a process reads the registry at its first cache).
    one = cfg.Variable("CUDA_PROGRAM_CAS_TEST_X", str, "a test's variable", "none")
    assert one == cfg.Variable("CUDA_PROGRAM_CAS_TEST_X", str, "a test's variable", "none")
    assert hash(one) == hash(cfg.Variable("CUDA_PROGRAM_CAS_TEST_X", str, "a test's variable", "none"))
    assert one != cfg.Variable("CUDA_PROGRAM_CAS_TEST_X", str, "a test's variable", "none", secret=True)
    assert len({one, cfg.VAR_DIR, cfg.VAR_DIR}) == 2
    with pytest.raises(AttributeError, match="immutable"):
        one.name = "CUDA_PROGRAM_CAS_OTHER"  # type: ignore[misc]
    with pytest.raises(AttributeError, match="immutable"):
        del one.secret
    assert one.name == "CUDA_PROGRAM_CAS_TEST_X" and one.secret is False
    assert "CUDA_PROGRAM_CAS_TEST_X" in repr(one)


# -- every store address of CUDA_PROGRAM_CAS_SHARED is checked ------------------------------------------------------


def _typos(host: str, tmp_path: Path) -> dict[str, str]:
    """Store addresses with a typo: each would have been a relative path, or a read-only store, unsaid."""
    return {
        "scheme": f"htp://{host}/x",
        "spaces": f"redis://{host}:6379/0 | write",
        "space after": f"redis://{host}:6380/0| write",
        "space before": f"redis://{host}:6381/0 |write",
        "in a path": f"{tmp_path}/a://{host}",
    }


def test_a_malformed_store_address_is_a_problem_in_config_and_a_warning_at_open(
    tmp_path: Path, bare_env: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    from cuda_program_cas import ContentAddressedProgramCache

    host = f"{tmp_path.name.replace('_', '-')}.example"
    typos = _typos(host, tmp_path)
    good = str(tmp_path / "store")
    bare_env.setenv("CUDA_PROGRAM_CAS_SHARED", " ".join([*typos.values(), good]))
    bare_env.setenv("CUDA_PROGRAM_CAS_DIR", str(tmp_path / "cas"))
    code, out, _ = cli(capsys, "config")
    problems = [line for line in out.splitlines() if line.startswith("problem:")]
    assert code == 1 and len(problems) == len(typos), problems
    assert any("unknown store scheme 'htp'" in p for p in problems)
    assert sum("spaces around '|'" in p for p in problems) == 3
    assert any("'://' in a path" in p for p in problems)
    assert f"shared     {good} (environment" in out
    caplog.set_level(logging.WARNING, logger="cuda_program_cas")
    caplog.clear()  # config said them too (its settings read the variable as a job does)
    bare_env.setenv("CUDA_PROGRAM_CAS_SHARED", " ".join([*_typos("other-" + host, tmp_path).values(), good]))
    with ContentAddressedProgramCache(tmp_path / "node") as cache:
        assert [s.root for s in cache.store.inner.shared] == [good]  # no relative directory, no read-only redis
    said = [r for r in caplog.records if "CUDA_PROGRAM_CAS_SHARED" in r.getMessage()]
    assert len(said) == len(typos) and all(r.levelno == logging.WARNING for r in said)


_WORD = st.from_regex(r"[A-Za-z][A-Za-z0-9+.-]{0,8}", fullmatch=True)
_NAME = st.text("abcdefghijklmnopqrstuvwxyz0123456789-_", min_size=1, max_size=8)
_GOOD = st.one_of(
    _NAME.map(lambda n: f"/srv/{n}"),
    st.tuples(st.sampled_from(["http", "https", "redis"]), _NAME).map(lambda t: f"{t[0]}://{t[1]}.example/0"),
)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(_GOOD, st.booleans()), min_size=0, max_size=4),
    st.lists(
        st.one_of(
            st.tuples(_WORD.filter(lambda w: w.lower() not in STORE_SCHEMES), _NAME).map(
                lambda t: f"{t[0]}://{t[1]}/x"
            ),
            st.tuples(_GOOD, st.sampled_from([" |", "| ", " | ", "  |  "])).map(lambda t: f"{t[0]}{t[1]}write"),
        ),
        min_size=1,
        max_size=3,
    ),
    st.randoms(use_true_random=False),
)
def test_a_typo_is_never_a_relative_path_or_a_read_only_store(
    good: list[tuple[str, bool]], bad: list[str], rng: random.Random
) -> None:
    """Whatever else the list holds, each malformed address is left out: the good ones come back as given."""
    entries = [f"{a}|write" if w else a for a, w in good]
    mixed = [*entries, *bad]
    rng.shuffle(mixed)
    with cfg.collecting() as said:
        got = cfg._parse_shared(rng.choice([" ", ";", "  ", " ; "]).join(mixed))
    assert got == [e for e in mixed if e in entries]
    assert len(said) == len(bad)
