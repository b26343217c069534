"""The front door's two source and flag scans, against the regular expressions they replaced.

``may_include_quoted`` decides whether the main source's directory is searched (and
so part of the key); ``_names_dir`` whether the working directory is. Each is a plain
byte scan (a regular expression costs a fresh process's first hit its compile); the
expressions below are the reference, checked on generated text made of the pieces
that matter (``include``, ``_next``, blanks, brackets, quotes, line ends).
"""

from __future__ import annotations

import re

from hypothesis import given
from hypothesis import strategies as st

from cuda_program_cas._cuda.search import _names_dir, may_include_quoted

QUOTED = re.compile(rb"include(?:_next)?[ \t]*\(?[ \t]*(?![<\s])")
DEBUG = re.compile(rb"debug|line-?info|^-G$")

_PIECES = [b"include", b"_next", b"#", b" ", b"\t", b"\n", b"\r", b"\v", b"\f", b"(", b"<", b">", b'"', b"x", b"__has_"]
_FLAG_PIECES = [b"-", b"G", b"debug", b"line", b"info", b"-line-info", b"\n", b"-lineinfo", b"x", b"="]


@given(st.lists(st.sampled_from(_PIECES), max_size=12))
def test_may_include_quoted_matches_the_expression(pieces: list[bytes]) -> None:
    source = b"".join(pieces)
    want = QUOTED.search(source) is not None
    may_include_quoted.cache_clear()
    assert may_include_quoted(source) is want
    assert may_include_quoted(source.decode("latin-1")) is want


@given(st.lists(st.sampled_from(_FLAG_PIECES), max_size=6))
def test_names_dir_matches_the_expression(pieces: list[bytes]) -> None:
    flag = b"".join(pieces)
    assert _names_dir(flag) is (DEBUG.search(flag) is not None)


def test_the_usual_sources() -> None:
    assert not may_include_quoted(b"#include <cub/cub.cuh>\n#include\t<x>\n")
    assert may_include_quoted(b'#include "mine.h"\n')
    assert may_include_quoted(b"#include HEADER\n")
    assert may_include_quoted(b"#if __has_include(<x>)\n")  # conservative, as the expression was
    assert _names_dir(b"-G") and _names_dir(b"--generate-line-info") and not _names_dir(b"-arch=sm_80")
