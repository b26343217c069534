"""The README stays a front page: its two set-up commands are what CI runs, it fits on a few
screens, its links resolve (the docs' and the changelog's too), and no page names a private
module or internal history. What the docs hold is checked in tests/test_docs.py."""

from __future__ import annotations

import re

from conftest import REPO

README = (REPO / "README.md").read_text()
INSTALL = 'python3 -m venv .venv && .venv/bin/pip install -e ".[cu13,test]"'
DEMO = f"{INSTALL} && .venv/bin/python tools/demo.py"
TESTS = f"{INSTALL} && .venv/bin/python -m pytest -q"


def test_the_two_set_up_commands_are_the_readme_s_and_ci_runs_the_test_one() -> None:
    commands = [line.strip() for line in README.splitlines() if line.strip().startswith("python3 -m venv")]
    assert commands == [DEMO, TESTS]
    ci = (REPO / ".ci" / "run").read_text().splitlines()
    assert TESTS in [line.strip() for line in ci]


def test_every_local_link_resolves() -> None:
    docs = [REPO / "README.md", REPO / "CHANGELOG.md", *sorted((REPO / "docs").glob("*.md"))]
    missing = []
    for page in docs:
        for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" not in target and not (page.parent / target).exists():
                missing.append(f"{page.relative_to(REPO)} -> {target}")
    assert missing == []
    # The README sends a reader on through the index, which names every page (tests/test_docs.py).
    assert "(docs/index.md)" in README
    for name in ("install", "python-api", "variables", "everywhere", "runbook", "cli", "design", "benchmarks"):
        assert f"(docs/{name}.md)" in README, name


def test_the_front_page_is_a_front_page() -> None:
    assert len(README.splitlines()) <= 150


def test_no_private_modules_or_internal_history() -> None:
    for page in [REPO / "README.md", REPO / "CHANGELOG.md", *sorted((REPO / "docs").glob("*.md"))]:
        text = page.read_text()
        assert not re.search(r"\bcuda_program_cas\._[a-z]", text), page.name  # private modules are not the API
        assert not re.search(r"\b(from|import) cas\b|(?<![\w/-])cas\.[A-Za-z]", text), page.name  # the old import name
        assert not re.search(r"\bissue \d", text, re.IGNORECASE), page.name
        assert ".wheels" not in text and "the final code" not in text, page.name
        assert "python tools/gc.py /shared" not in text, page.name  # tools/ is not installed
