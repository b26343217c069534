"""Real HTTP servers on loopback for the tests of the HTTP store: nginx, and a server of faults.

from _http import Fault, FaultServer, nginx_or_skip

def test_reads_through_nginx(tmp_path):
    with nginx_or_skip(tmp_path / "nginx") as server:      # skips where nginx cannot run
        (server.root / "layout.json").write_text("{}")     # publish by hand, or through dav_url()
        ...  # read server.read_url("layout.json"); check server.requests() for Range and keep-alive

def test_retries_a_503(tmp_path):
    with FaultServer(tmp_path / "store") as server:
        server.set("/blobs/", Fault.status(503, times=1))  # one 503, then the file
        ...  # read server.url("blobs/ab/..."); assert server.hits("/blobs/ab/...") == 2
"""

from .faults import Fault, FaultServer, Request, refused_url
from .nginx import LogEntry, Nginx, NginxError, find_nginx, nginx_or_skip

__all__ = [
    "Fault",
    "FaultServer",
    "LogEntry",
    "Nginx",
    "NginxError",
    "Request",
    "find_nginx",
    "nginx_or_skip",
    "refused_url",
]
