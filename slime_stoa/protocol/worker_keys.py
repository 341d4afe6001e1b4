"""Worker keys: the per-worker signing key that `stoa worker add` issues and `macd join` installs.

A worker key file is a small JSON document, mode 0600, never uploaded:
`{"format": "stoa.worker-key/1", "run": <run>, "worker": <worker id>, "private_key": <PKCS#8 PEM>}`.
The worker id in it is the one the worker uploads under; the run key's registry binds that id to
the key's public half.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from slime_stoa.protocol.layout import check_name, check_worker_id
from slime_stoa.protocol.signing import KeyFileError, SigningKey, read_private_file, write_private_file
from slime_stoa.protocol.strict_json import load_json

WORKER_KEY_FORMAT = "stoa.worker-key/1"


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerKeyFile:
    run: str
    worker: str  # the worker id this key signs for
    key: SigningKey


def worker_key_bytes(entry: WorkerKeyFile) -> bytes:
    doc = {"format": WORKER_KEY_FORMAT, "run": entry.run, "worker": entry.worker, "private_key": entry.key.to_pem().decode()}
    return json.dumps(doc, indent=1, sort_keys=True).encode() + b"\n"


def write_worker_key_file(path: Path, entry: WorkerKeyFile, *, overwrite: bool = False) -> Path:
    """Write a worker key file (0600; refuses to replace one unless `overwrite`)."""
    return write_private_file(path, worker_key_bytes(entry), overwrite=overwrite)


def read_worker_key_file(path: Path) -> WorkerKeyFile:
    """Load a worker key file; KeyFileError if others can read it or it is malformed."""
    where = str(path)
    try:
        doc = load_json(read_private_file(Path(path)), max_bytes=64 << 10)
    except ValueError as exc:
        if isinstance(exc, KeyFileError):
            raise
        raise KeyFileError(f"{where}: not a worker key file ({exc})") from None
    if not isinstance(doc, dict) or doc.get("format") != WORKER_KEY_FORMAT:
        raise KeyFileError(f"{where}: not a {WORKER_KEY_FORMAT} file")
    pem = doc.get("private_key")
    if not isinstance(pem, str):
        raise KeyFileError(f"{where}: no private_key")
    try:
        run, worker = check_name("run", doc.get("run")), check_worker_id(doc.get("worker"))  # type: ignore[arg-type]
    except ValueError as exc:
        raise KeyFileError(f"{where}: {exc}") from None
    return WorkerKeyFile(run=run, worker=worker, key=SigningKey.from_pem(pem.encode(), where))
