"""What a worker remembers of a run across restarts, in its data folder (`<data_dir>/trust/`):
the run key it trusted first (`<run>.pub`) and the highest weights it installed (`<run>.head`).

A worker joined without a pinned run key trusts the run manifest's key on first use and keeps it
here; from then on it refuses a run manifest that is unsigned or names another key, across
restarts, as if that key had been pinned at `macd join` (`run_trust.run_key_refusal`). A key
pinned in the config always wins (and replaces what is kept here). A restarted worker refuses a
pointer below the head it kept (an old genuine pointer put back: `pulse.freshness`).
"""

from __future__ import annotations

from pathlib import Path

from slime_stoa.protocol.fsutil import atomic_write
from slime_stoa.protocol.layout import check_name
from slime_stoa.protocol.pulse.freshness import Head
from slime_stoa.protocol.signing import PublicKey

MAX_PIN_BYTES = 256


def pin_path(data_dir: Path, run: str) -> Path:
    return data_dir / "trust" / f"{check_name('run', run)}.pub"


def remembered_run_key(data_dir: Path, run: str) -> str | None:
    """The run key this worker trusted first for `run` (public key text), or None. A pin file
    that does not hold a public key is ignored (the next trusted key replaces it)."""
    try:
        text = pin_path(data_dir, run).read_bytes()[:MAX_PIN_BYTES].decode().strip()
        return PublicKey.from_text(text).to_text()
    except (OSError, UnicodeDecodeError, ValueError):
        return None


def remember_run_key(data_dir: Path, run: str, key_text: str) -> None:
    """Keep `key_text` as the run key of `run` (atomic; a no-op when it is already kept)."""
    if remembered_run_key(data_dir, run) != key_text:
        atomic_write(pin_path(data_dir, run), (PublicKey.from_text(key_text).to_text() + "\n").encode(), parents_mode=0o700)


def head_path(data_dir: Path, run: str) -> Path:
    return data_dir / "trust" / f"{check_name('run', run)}.head"


def remembered_head(data_dir: Path, run: str) -> Head | None:
    """The highest (epoch, version) this worker installed for `run`, or None (nothing kept, or
    junk: ignored)."""
    try:
        epoch, version = (int(part) for part in head_path(data_dir, run).read_bytes()[:64].decode().split())
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    return Head(epoch, version) if 0 <= epoch <= version else None


def remember_head(data_dir: Path, run: str, head: Head) -> None:
    """Keep `head` when it is above the one kept (a restarted worker refuses pointers below it)."""
    kept = remembered_head(data_dir, run)
    if kept is None or head > kept:
        atomic_write(head_path(data_dir, run), f"{head.epoch} {head.version}\n".encode(), durable=False, parents_mode=0o700)
