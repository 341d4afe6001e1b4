"""Bucket credentials: from the environment or from an env file that only its owner can read.

Looked up in this order, first hit wins:
1. `STOA_ACCESS_KEY_ID` / `STOA_SECRET_ACCESS_KEY` in the environment;
2. `AWS_ACCESS_KEY_ID` / `AWS_SECRET_ACCESS_KEY` (and `AWS_SESSION_TOKEN`) in the environment;
3. an env file: the path in `STOA_ENV_FILE`, else `~/.r2env` for `r2://` stores and
   `~/.config/stoa/credentials.env` for `s3://` stores. Lines are `KEY=VALUE` (`export` and quotes
   allowed) with the key names above (`R2_ACCESS_KEY_ID` / `R2_SECRET_ACCESS_KEY` also accepted).

Like ssh with private keys, an env file that group or others can read is refused. Secrets never
appear in a repr, a log line or an error message.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from .base import StoreConfigError

#: The names of the access key id and of the secret, in the order they are looked up.
ID_NAMES = ("STOA_ACCESS_KEY_ID", "AWS_ACCESS_KEY_ID", "R2_ACCESS_KEY_ID")
SECRET_NAMES = ("STOA_SECRET_ACCESS_KEY", "AWS_SECRET_ACCESS_KEY", "R2_SECRET_ACCESS_KEY")
SESSION_TOKEN_NAME = "AWS_SESSION_TOKEN"


@dataclass(frozen=True, slots=True)
class Credentials:
    access_key_id: str
    secret_access_key: str = field(repr=False)
    session_token: str | None = field(default=None, repr=False)
    source: str = "environment"  # where they came from, for messages (never the values)

    def __str__(self) -> str:
        return f"access key {self.access_key_id[:4]}… from {self.source}"


def parse_env_file(text: str) -> dict[str, str]:
    """Parse `KEY=VALUE` lines; `#` comments, blank lines, `export ` and quotes are allowed."""
    values: dict[str, str] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("export "):
            line = line[len("export ") :].strip()
        name, sep, value = line.partition("=")
        if not sep or not name.strip():
            raise ValueError(f"line {number}: expected KEY=VALUE")
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        values[name.strip()] = value
    return values


def read_env_file(path: Path) -> dict[str, str]:
    """Read an env file, refusing one that group or others may read or write."""
    mode = path.stat().st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise StoreConfigError(
            f"credentials file {path} is accessible by other users (mode {stat.S_IMODE(mode):o}); "
            f"run `chmod 600 {path}` and try again"
        )
    try:
        return parse_env_file(path.read_text())
    except ValueError as exc:
        raise StoreConfigError(f"credentials file {path}: {exc}") from None


def _pick(values: Mapping[str, str], names: tuple[str, ...]) -> str | None:
    for name in names:
        if values.get(name):
            return values[name]
    return None


def credentials_in(values: Mapping[str, str], source: str, *, strict: bool = False) -> Credentials | None:
    """The credentials named in env-style `values` (an environment, a parsed env file).

    The first of `ID_NAMES` and of `SECRET_NAMES` that is set wins, plus `AWS_SESSION_TOKEN`;
    `source` says where they came from in messages. None when `values` holds no complete key
    pair; with `strict`, ValueError when it holds only one half of it.
    """
    key_id, secret = _pick(values, ID_NAMES), _pick(values, SECRET_NAMES)
    if key_id and secret:
        return Credentials(key_id, secret, values.get(SESSION_TOKEN_NAME) or None, source)
    if strict and (key_id or secret):
        raise ValueError(f"{source} has only half of the key pair: give both the access key id and the secret")
    return None


def default_env_file(scheme: str, environ: Mapping[str, str]) -> Path:
    if environ.get("STOA_ENV_FILE"):
        return Path(environ["STOA_ENV_FILE"]).expanduser()
    if scheme == "r2":
        return Path("~/.r2env").expanduser()
    return Path("~/.config/stoa/credentials.env").expanduser()


def load_credentials(scheme: str, environ: Mapping[str, str] | None = None) -> Credentials | None:
    """Credentials for an `s3`/`r2` store, or None when none are configured anywhere."""
    env = os.environ if environ is None else environ
    creds = credentials_in(env, "environment")
    if creds is not None:
        return creds
    path = default_env_file(scheme, env)
    if not path.exists():
        if env.get("STOA_ENV_FILE"):
            raise StoreConfigError(f"STOA_ENV_FILE points to {path}, which does not exist")
        return None
    creds = credentials_in(read_env_file(path), str(path))
    if creds is None:
        raise StoreConfigError(
            f"credentials file {path} must set an access key id and a secret access key "
            f"(e.g. AWS_ACCESS_KEY_ID=... and AWS_SECRET_ACCESS_KEY=...)"
        )
    return creds


def require_credentials(scheme: str, url: str, environ: Mapping[str, str] | None = None) -> Credentials:
    creds = load_credentials(scheme, environ)
    if creds is None:
        where = default_env_file(scheme, os.environ if environ is None else environ)
        raise StoreConfigError(
            f"no credentials for {url}: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or write "
            f"them to {where} (chmod 600), or point STOA_ENV_FILE at such a file"
        )
    return creds
