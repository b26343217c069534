"""One compile per key per cluster without Redis: node processes sharing an S3 bucket, whose leases are objects.

The nodes of tests/test_cluster_leases.py (each its own interpreter and local cache, started
together, compiling the same new CUB kernel through the front door with real NVRTC), pointed
at ``s3://cas/<test>|write`` on a real ``weed`` server: a lease is ``leases/<key id>``,
created with ``If-None-Match: *``. Exactly one node compiles; the others get its bytes.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_cluster_leases import Node, _new_kernel
from testkit.weed import WeedServer, weed_or_skip


@pytest.fixture(scope="module")
def weed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WeedServer]:
    server = weed_or_skip(tmp_path_factory.mktemp("weed"))
    yield server
    server.stop()


def _prefix(tmp_path: Path) -> str:
    return tmp_path.name.lower().replace("_", "-")


def test_eight_nodes_one_compile_with_s3_leases(tmp_path: Path, weed: WeedServer) -> None:
    source = _new_kernel()
    prefix = _prefix(tmp_path)
    nodes = [Node(tmp_path, n, source, f"s3://cas/{prefix}", "30", env=weed.env()) for n in range(8)]
    for node in nodes:
        node.go()
    results = [node.result() for node in nodes]
    compiled = [r for r in results if r["compiled"]]
    assert len(compiled) == 1, [(r["compiled"], r["shared_hits"], r["waits"]) for r in results]
    assert sum(r["hits"] for r in results) == len(nodes) - 1
    assert len({r["code"] for r in results}) == 1  # every node has the holder's bytes
    assert (compiled[0]["uploads"], compiled[0]["dropped"]) == (2, 0)  # the binary, then the front door's record
    assert not weed.keys(f"{prefix}/leases/")  # released once the result was uploaded
    holder = compiled[0]
    last = max(r["done"] for r in results)
    print(f"\n8 nodes on S3: 1 compile of {holder['done'] - holder['t0']:.2f} s; last done {last - holder['t0']:.2f} s")


@pytest.mark.slow
def test_a_holder_killed_mid_compile_loses_its_s3_lease_and_another_node_compiles(
    tmp_path: Path, weed: WeedServer
) -> None:
    source = _new_kernel()
    prefix = _prefix(tmp_path)
    ttl = 2.0
    holder = Node(tmp_path, 0, source, f"s3://cas/{prefix}", str(ttl), env=weed.env())
    others = [Node(tmp_path, n, source, f"s3://cas/{prefix}", str(ttl), env=weed.env()) for n in range(1, 5)]
    holder.go()
    deadline = time.monotonic() + 60
    while not weed.keys(f"{prefix}/leases/"):  # the holder took its lease and is compiling
        assert time.monotonic() < deadline, "no node took a lease"
        time.sleep(0.01)
    for node in others:
        node.go()
    holder.proc.send_signal(signal.SIGKILL)
    holder.proc.communicate(timeout=30)
    results = [node.result() for node in others]
    compiled = [r for r in results if r["compiled"]]
    assert len(compiled) == 1, [(r["compiled"], r["shared_hits"], r["waits"]) for r in results]
    assert sum(r["hits"] for r in results) == len(others) - 1
    assert len({r["code"] for r in results}) == 1
