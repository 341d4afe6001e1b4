"""`--run-key KEY` of the reading commands: the run key a reader pins on its command line, so that
a run re-created with another key (a replaced `run.json`) cannot vouch for itself.

KEY is the run key's public text (`ed25519:<base64url>`, as `stoa keys show` prints it), its
fingerprint (`SHA256:...`) or key id (16 hex digits), or a file: the run key file itself (PEM,
private, 0600) or a file holding the public text (a worker's `trust/<run>.pub`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from slime_stoa.protocol.signing import KEY_ID_HEX, PublicKey, read_key_file

_FINGERPRINT = re.compile(r"SHA256:[A-Za-z0-9+/]{43}")
_KEY_ID = re.compile(rf"[0-9a-f]{{{KEY_ID_HEX}}}")
_PUBLIC_PREFIX = "ed25519:"


@dataclass(frozen=True, slots=True)
class RunKeyPin:
    """A pinned run key: known whole (`key`), or only by its fingerprint or key id (`names`)."""

    given: str
    key: PublicKey | None = None

    def matches(self, key: PublicKey) -> bool:
        if self.key is not None:
            return key == self.key
        return self.given in (key.fingerprint, key.key_id)

    @property
    def shown(self) -> str:
        return self.key.key_id if self.key is not None else self.given


def parse_run_key(given: str) -> RunKeyPin:
    """`given` (module doc) as a pin; ValueError in one line naming the expected forms."""
    text = given.strip()
    if text.startswith(_PUBLIC_PREFIX):
        return RunKeyPin(text, PublicKey.from_text(text))
    if _FINGERPRINT.fullmatch(text) or _KEY_ID.fullmatch(text):
        return RunKeyPin(text)
    path = Path(text).expanduser()
    if not path.is_file():
        raise ValueError(
            f"--run-key {given[:80]!r}: not a run key (ed25519:...), a fingerprint (SHA256:...), "
            f"a key id ({KEY_ID_HEX} hex digits) nor a file"
        )
    try:
        data = path.read_bytes()[:4096]
        if data.lstrip().startswith(b"-----BEGIN"):
            return RunKeyPin(str(path), read_key_file(path).public)
        return RunKeyPin(str(path), PublicKey.from_text(data.decode(errors="replace").strip()))
    except (OSError, ValueError) as exc:
        raise ValueError(f"--run-key {path}: {exc}") from None


def pinned_key(pin: RunKeyPin, run: str, found: PublicKey | None) -> tuple[PublicKey | None, str | None]:
    """The run key to judge the run's signed documents by, given the key its `run.json` names
    (`found`, None: unsigned), and why the run is not the pinned one (None when it is). A run
    that names another key is judged by the pinned key (when known whole), never by its own."""
    if found is not None and pin.matches(found):
        return found, None
    named = "is unsigned" if found is None else f"names run key {found.key_id}"
    return pin.key, f"run {run!r}: run.json {named}, --run-key pins {pin.shown}: a re-keyed or downgraded run"
