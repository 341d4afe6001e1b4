"""The daemon's configuration: which bucket and run this Mac works for, as whom, and how hard.

`macd join` writes it once; `macd run` (and the launchd agent, which runs `macd run --config
PATH`) reads it. It is a small TOML file in the user's config folder:

- `$MACD_CONFIG` if set (or `--config PATH` on the command line), else
- `~/Library/Application Support/stoa/macd.toml` on macOS, else
- `$XDG_CONFIG_HOME/stoa/macd.toml` (`~/.config/stoa/macd.toml`).

Bucket credentials never go into the TOML: `macd join` writes the ones it was given to a
separate env file readable by its owner only (mode 0600, the format of
`slime_stoa.protocol.store.credentials`), and the TOML stores that file's path. Every file is written
atomically (temp file, fsync, rename), so a crash never leaves half a config.

The second half of this module is what joining means for this Mac: what a run asks of it
(`probe_run`) and how much memory that takes (`estimate_memory`).
"""

from __future__ import annotations

import math
import os
import re
import secrets
import socket
import sys
import textwrap
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Literal

from slime_stoa.protocol.cli_fields import Flag, help_of, setting
from slime_stoa.protocol.fsutil import atomic_write
from slime_stoa.protocol.layout import check_name, check_worker_id
from slime_stoa.protocol.run_manifest import PLANES, Plane, RunManifest, read_run_manifest
from slime_stoa.protocol.run_manifest import RunNotFound as RunNotFound  # probe_run raises it
from slime_stoa.protocol.signing import PublicKey
from slime_stoa.protocol.store import Credentials, Store, open_store, parse_store_url
from slime_stoa.protocol.store.credentials import credentials_in, read_env_file
from slime_stoa.protocol.store.split import SplitStore

from .machine import memory_bytes, tier_for

CONFIG_ENV = "MACD_CONFIG"
CONFIG_NAME = "macd.toml"
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
_WORKER_PREFIX_MAX = 41  # 48-character worker ids minus "-" and 6 hex digits


class ConfigError(ValueError):
    """The config file is missing or invalid; the message says how to fix it."""


# -- where things live --------------------------------------------------------------------------


def default_config_dir(environ: Mapping[str, str] | None = None, platform: str | None = None) -> Path:
    """The user's config folder for stoa (see the module docstring)."""
    env = os.environ if environ is None else environ
    if (platform or sys.platform) == "darwin":
        return Path("~/Library/Application Support/stoa").expanduser()
    return Path(env.get("XDG_CONFIG_HOME") or "~/.config").expanduser() / "stoa"


def default_config_path(environ: Mapping[str, str] | None = None, platform: str | None = None) -> Path:
    """`$MACD_CONFIG`, else `macd.toml` in the user's config folder."""
    env = os.environ if environ is None else environ
    if env.get(CONFIG_ENV):
        return Path(env[CONFIG_ENV]).expanduser()
    return default_config_dir(env, platform) / CONFIG_NAME


def default_data_dir(environ: Mapping[str, str] | None = None, platform: str | None = None) -> Path:
    """Anchor cache and spool: `~/Library/Application Support/stoa` on macOS, XDG data else."""
    env = os.environ if environ is None else environ
    if (platform or sys.platform) == "darwin":
        return Path("~/Library/Application Support/stoa").expanduser()
    return Path(env.get("XDG_DATA_HOME") or "~/.local/share").expanduser() / "stoa"


def credentials_path_for(config_path: Path) -> Path:
    """Where `macd join` keeps the credentials of the config at `config_path` (beside it)."""
    return config_path.with_name(f"{config_path.stem}.credentials.env")


# -- worker identity ----------------------------------------------------------------------------


def default_name() -> str:
    """This machine's short host name (`mac-mini-3` for `mac-mini-3.local`)."""
    return socket.gethostname().split(".")[0] or "mac"


def worker_prefix(text: str) -> str:
    """`text` squeezed into what a worker id allows: lowercase letters, digits and '-'."""
    prefix = re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")
    return prefix[:_WORKER_PREFIX_MAX].rstrip("-") or "mac"


def new_worker_id(name: str) -> str:
    """A fresh worker id, `<sanitised name>-<6 random hex digits>`, made once at join."""
    return check_worker_id(f"{worker_prefix(name)}-{secrets.token_hex(3)}")


def check_wandb_project(name: str) -> str:
    """A W&B project name: 1-128 printable characters, none of `/ \\ # ? % :`."""
    if (
        not isinstance(name, str) or not 0 < len(name) <= 128 or not name.isprintable()
        or name != name.strip() or any(c in name for c in "/\\#?%:")
    ):
        raise ValueError(
            f"invalid wandb_project {name!r}: use 1-128 printable characters without / \\ # ? % : or surrounding spaces"
        )
    return name


def check_label(name: str) -> str:
    """A worker's display name: 1-64 printable characters."""
    if not isinstance(name, str) or not 0 < len(name) <= 64 or not name.isprintable() or name != name.strip():
        raise ValueError(f"invalid worker name {name!r}: use 1-64 printable characters, no surrounding spaces")
    return name


# -- the config ---------------------------------------------------------------------------------


def plane_override(manifest: RunManifest, plane: str) -> Plane:
    """`plane` (a config's override) checked against the run of `manifest`: ValueError when the
    run cannot be served on it: a larger plane than the run's, or a quantized plane the run
    neither serves nor publishes (the trainer refuses records of such a plane: a claimed plane
    widens its logprob-gap bound, so only the run manifest's planes are taken)."""
    if plane not in PLANES:
        raise ValueError(f"plane must be one of {', '.join(PLANES)}, got {plane!r}")
    if PLANES.index(plane) < PLANES.index(manifest.plane):
        raise ValueError(f"plane {plane}: run {manifest.run!r} serves {manifest.plane}; serve it on that plane or a smaller one")
    if plane != manifest.plane and not manifest.offers(plane):
        offered = ", ".join(p for p in PLANES if p == manifest.plane or manifest.offers(p))
        raise ValueError(f"plane {plane}: run {manifest.run!r} does not publish the {plane} plane (serve {offered})")
    return plane


def _tier_batch() -> int:
    return tier_for(memory_bytes()).batch


@dataclass(frozen=True, kw_only=True)
class DaemonConfig:
    """Everything `macd run` needs besides what the run manifest in the bucket says.

    Each field is a `setting` (`slime_stoa.protocol.cli_fields`): its help heads its key in the
    TOML file. A field with `join=` is an option of `macd join` (`--worker-id` for `worker_id`),
    one with `run=` an option of `macd run` that overrides the file's value for that run; the
    others are edited in the file and kept when re-joining.
    """

    store: str = setting(
        "Bucket URL of the run: file:///dir, s3://bucket/prefix?endpoint=..., r2://account/bucket/prefix.",
        join=Flag(
            positional=True,
            metavar="BUCKET_URL",
            help="bucket URL: file:///dir, s3://bucket/prefix?endpoint=..., r2://account/bucket/prefix",
        ),
    )
    run: str = setting(
        "Run name: the daemon follows runs/<run>/ in that bucket.",
        join=Flag(required=True, help="run name (created by the operator with `stoa run create`)"),
    )
    name: str = setting(
        "Display name of this worker in the fleet table (default: the host name).",
        join="this worker's name in the fleet table (default: the host name)",
    )
    worker_id: str = setting(
        "Stable id in the bucket's keys (heartbeat, rollout records): made once by `macd join` and "
        "kept across restarts and re-joins of the same run. 1-48 lowercase letters, digits or '-'.",
        join="this worker's id in the bucket's keys, 1-48 lowercase letters, digits or '-' (default: "
        "kept when re-joining the same run, else made from the name); two workers must never share one",
    )
    data_dir: Path = setting(
        "Folder of the anchor cache and the upload spool (absolute; several GB for big models).",
        join="anchor cache and spool folder (default: the user's data folder)",
    )
    credentials_file: Path | None = setting(
        "Env file (mode 0600) with the bucket credentials. Absent: the usual lookup (environment, "
        "~/.r2env, ~/.config/stoa/credentials.env, $STOA_ENV_FILE).",
        join="use this existing env file (mode 0600) instead of writing one",
        default=None,
    )
    batch: int = setting(
        "Prompts generated together, each becoming a group of the run's group size. Default: this "
        "machine's memory tier (`macd doctor`).",
        join="prompts generated together (default: this machine's memory tier)",
        default_factory=_tier_batch,
    )
    max_decode: int = setting("Most sequences decoding at once; 0: batch x group size, all at once.", default=0)
    transfer_concurrency: int = setting("Parallel transfers with the bucket (record uploads, weight downloads).", default=4)
    spool_max_mb: int = setting(
        "Most megabytes of finished groups kept on disk while the bucket cannot be reached; "
        "generation pauses when the spool is full.",
        default=2048,
    )
    log_level: str = setting("Log level of the daemon: DEBUG, INFO, WARNING or ERROR.", default="INFO")
    wandb_project: str | None = setting(
        "Weights & Biases project to log this worker's heartbeats to (worker/*, one W&B run per "
        "`macd run`; needs the wandb package). Absent: no W&B. `macd run --wandb-project` overrides it.",
        run=Flag(
            metavar="NAME",
            help="log this worker's heartbeats (worker/*) to this Weights & Biases project (default: the "
            "config's wandb_project; none: no W&B). Needs the wandb package; WANDB_MODE=offline keeps the run local",
        ),
        default=None,
    )
    run_key: str = setting(
        "The run key pinned at `macd join` (public key text, ed25519:...): weights, pointers and the "
        "run manifest must be signed by it or by a key it rotated to, else they are refused. Empty: "
        "the first run key the worker sees is trusted and kept in its data folder (an unsigned run: "
        "nothing is checked, unless the worker holds a worker key: then it is refused).",
        join=Flag(
            metavar="TEXT",
            help="pin this run key (ed25519:..., from `stoa keys show`) instead of trusting the run manifest's "
            "on first use; a run whose manifest names another key is refused",
        ),
        default="",
    )
    worker_key: str = setting(
        "Path of this worker's key file (mode 0600), installed by `macd join --worker-key`; it signs "
        "this worker's rollout records. Empty: no worker key.",
        join=Flag(  # the file to install; the config keeps the installed copy's path
            type=Path,
            metavar="FILE",
            help="this worker's key file from `stoa worker add` (mode 0600): installed beside the config, "
            "it sets the worker id and signs this worker's records",
        ),
        default="",
    )
    rollouts_store: str = setting(
        "Least privilege: URL of a second bucket for this worker's rollout records and heartbeat "
        "(runs/<run>/rollouts|evals|workers/); the first (`store`) is then only read. Empty: one bucket.",
        join=Flag(
            metavar="URL",
            help="least privilege: a second bucket for this worker's records and heartbeat; the run's bucket "
            "is then only read (give the worker a read-only token for it)",
        ),
        default="",
    )
    plane: str = setting(
        "The weight plane this Mac serves the run on: bf16, int8 or int4 (a quantized one only when "
        "the run serves or publishes it), never a larger one than the run's. Empty: the largest that fits this Mac's "
        "memory (the run's plane, or a smaller one the run publishes; `macd join` shows it).",
        join=Flag(
            metavar="PLANE",
            help="serve this weight plane: bf16, int8, or int4 when the run publishes it (default: the "
            "largest that fits this Mac's memory)",
        ),
        default="",
    )
    rollouts_credentials_file: Path | None = setting(
        "Env file (mode 0600) with the credentials of `rollouts_store` (a token that may write that "
        "bucket only). Absent: the usual lookup.",
        join=Flag(metavar="FILE", help="env file (mode 0600) with the --rollouts-store token (default: the usual lookup)"),
        default=None,
    )

    def __post_init__(self) -> None:
        for name in ("store", "run", "worker_id", "log_level"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"{name} must be a string, got {getattr(self, name)!r}")
        parse_store_url(self.store)  # ValueError naming the accepted forms
        check_name("run", self.run)
        check_label(self.name)
        check_worker_id(self.worker_id)
        if not isinstance(self.data_dir, Path) or not self.data_dir.is_absolute():
            raise ValueError(f"data_dir must be an absolute path, got {self.data_dir!r}")
        if self.credentials_file is not None and (
            not isinstance(self.credentials_file, Path) or not self.credentials_file.is_absolute()
        ):
            raise ValueError(f"credentials_file must be an absolute path, got {self.credentials_file!r}")
        for name, low in (("batch", 1), ("max_decode", 0), ("transfer_concurrency", 1), ("spool_max_mb", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"log_level must be one of {LOG_LEVELS}, got {self.log_level!r}")
        if self.wandb_project is not None:
            check_wandb_project(self.wandb_project)
        if not isinstance(self.run_key, str) or not isinstance(self.worker_key, str):
            raise ValueError("run_key and worker_key must be strings")
        if self.run_key:
            PublicKey.from_text(self.run_key)  # ValueError naming the expected form
        if self.worker_key and not Path(self.worker_key).is_absolute():
            raise ValueError(f"worker_key must be an absolute path, got {self.worker_key!r}")
        if not isinstance(self.rollouts_store, str):
            raise ValueError("rollouts_store must be a string")
        if self.rollouts_store:
            parse_store_url(self.rollouts_store)
        if self.plane not in ("", *PLANES):
            raise ValueError(f"plane must be one of {', '.join(PLANES)} (or empty: picked for this Mac), got {self.plane!r}")
        if self.rollouts_credentials_file is not None and (
            not isinstance(self.rollouts_credentials_file, Path) or not self.rollouts_credentials_file.is_absolute()
        ):
            raise ValueError(f"rollouts_credentials_file must be an absolute path, got {self.rollouts_credentials_file!r}")

    def same_run(self, store: str, run: str) -> bool:
        """Whether this config already works for `run` in the bucket at `store`."""
        return (self.store, self.run) == (store, run)

    # -- TOML ---------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Plain TOML values (paths as strings; no credentials_file key when None, no run_key or
        worker_key when empty)."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None and not (f.name in ("run_key", "worker_key", "rollouts_store", "plane") and not value):
                out[f.name] = str(value) if isinstance(value, Path) else value
        return out

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any]) -> DaemonConfig:
        """Build from parsed TOML; ValueError naming unknown, missing or bad keys."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(doc) - known)
        if unknown:
            raise ValueError(f"unknown key(s) {unknown}; known: {sorted(known)}")
        missing = sorted(k for k in ("store", "run", "name", "worker_id", "data_dir") if k not in doc)
        if missing:
            raise ValueError(f"missing key(s) {missing}")
        values = dict(doc)
        for key in ("data_dir", "credentials_file", "rollouts_credentials_file"):
            if key in values:
                if not isinstance(values[key], str) or not values[key]:
                    raise ValueError(f"{key} must be a path string")
                values[key] = Path(values[key]).expanduser()
        try:
            return cls(**values)
        except TypeError as exc:
            raise ValueError(str(exc)) from None

    def to_toml(self) -> str:
        """The config as TOML, each key preceded by its documentation."""
        import tomli_w  # worker extra; only needed to write

        lines = [
            "# macd configuration, written by `macd join`. Edit it, then restart the daemon",
            "# (`macd start` restarts a running agent). Credentials are not kept here.",
            "",
        ]
        docs = {f.name: help_of(f) for f in fields(self)}
        for key, value in self.to_dict().items():
            lines += [f"# {line}" for line in textwrap.wrap(docs[key], 96)]
            lines += [tomli_w.dumps({key: value}).rstrip("\n"), ""]
        return "\n".join(lines)

    @classmethod
    def from_toml(cls, text: str, where: str = "config") -> DaemonConfig:
        try:
            doc = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{where} is not valid TOML: {exc}") from None
        try:
            return cls.from_dict(doc)
        except ValueError as exc:
            raise ConfigError(f"{where}: {exc}") from None

    # -- credentials --------------------------------------------------------------------------
    def read_credentials(self, file: Path | Literal["store"] | None = "store") -> Credentials | None:
        """The credentials in `credentials_file` (or in `file`), or None to use the usual lookup."""
        file = self.credentials_file if file == "store" else file
        if file is None:
            return None
        if not file.exists():
            raise ConfigError(
                f"credentials file {file} (named in the config) does not exist: "
                f"run `macd join` again with the bucket's access keys"
            )
        return credentials_from_env(read_env_file(file), str(file))

    def open_store(self) -> Store:
        """The run's store as this worker sees it: `store`, or with `rollouts_store` a `SplitStore`
        (records and heartbeat written to the second bucket, everything else read from the first)."""
        weights = open_store(self.store, credentials=self.read_credentials())
        if not self.rollouts_store:
            return weights
        rollouts = open_store(self.rollouts_store, credentials=self.read_credentials(self.rollouts_credentials_file))
        return SplitStore(weights, rollouts)


def load_config(path: Path) -> DaemonConfig:
    """Read the config at `path`; ConfigError saying what to run when it is missing or bad."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError(
            f"no macd config at {path}: run `macd join <bucket-url> --run <run>` first"
        ) from None
    return DaemonConfig.from_toml(text, str(path))


def save_config(config: DaemonConfig, path: Path) -> Path:
    """Write the config atomically (mode 0644: it holds no secret)."""
    atomic_write(path, config.to_toml().encode(), mode=0o644, parents_mode=0o700)
    return path


# -- credentials --------------------------------------------------------------------------------

def credentials_from_env(values: Mapping[str, str], source: str) -> Credentials | None:
    """Credentials from env-style names (STOA_*, AWS_*, R2_*); None when there are none.

    ValueError when only one half of the key pair is there.
    """
    return credentials_in(values, source, strict=True)


def credentials_env_text(creds: Credentials) -> str:
    """The env-file text of `creds` (AWS_* names)."""
    values = {"AWS_ACCESS_KEY_ID": creds.access_key_id, "AWS_SECRET_ACCESS_KEY": creds.secret_access_key}
    if creds.session_token:
        values["AWS_SESSION_TOKEN"] = creds.session_token
    for name, value in values.items():
        if not value or value != value.strip() or not value.isprintable() or value[0] in "'\"":
            raise ValueError(f"{name} must be printable, without surrounding spaces or quotes")
    body = "".join(f"{name}={value}\n" for name, value in values.items())
    return "# stoa bucket credentials for macd (written by `macd join`); keep this file mode 0600\n" + body


def write_credentials(path: Path, creds: Credentials) -> Path:
    """Write `creds` to an env file only its owner can read (0600), atomically."""
    atomic_write(path, credentials_env_text(creds).encode(), mode=0o600, parents_mode=0o700)
    return path


# -- joining: what a run asks of this Mac -------------------------------------------------------

#: Resident bytes per weight: bf16 (the one copy patches apply to and MLX serves), or int8: the
#: bf16 master patches apply to (2 bytes, exact) plus the MLX int8 copy served from it (8 bits
#: plus a bf16 scale and bias per 64 weights, 1.0625 bytes).
#: int4 is served only from the run's published 4-bit plane, held alone (4 bits plus a bf16 scale
#: and bias per 64); `macd.plane_choice` counts a published int8 plane held alone too.
BYTES_PER_WEIGHT: dict[Plane, float] = {"bf16": 2.0, "int8": 2.0 + 1.0625, "int4": 0.5625}
#: Runtime overhead besides weights and KV cache (Python, MLX, activations), a rough figure.
OVERHEAD_BYTES = 1 << 30
#: Share of unified memory macOS lets the GPU wire by default (about 2/3 to 3/4).
GPU_SHARE = 0.70
#: Guessed bf16 weights per byte of KV cache per token, when the model config is unknown
#: (Qwen2.5 0.5B-7B and Llama 3 8B lie between 40k and 130k).
_KV_GUESS_RATIO = 50_000


@dataclass(frozen=True, kw_only=True)
class RunInfo:
    """What joining a run means: its manifest and its current weights (when published)."""

    manifest: Any  # slime_stoa.protocol.run_manifest.RunManifest
    version: int | None = None  # current weight version; None before the first publish
    elements: int | None = None  # bf16 weights in the state
    kv_bytes_per_token: int | None = None  # from the anchor's config.json, when readable
    model_config: Mapping[str, Any] | None = None  # the anchor's config.json, when readable


async def probe_run(store: Any, run: str, *, pinned: str | None = None) -> RunInfo:
    """Read the run manifest, the pointer and the model config of `run` in `store`.

    Raises RunNotFound when the run does not exist, StoreError when the bucket cannot be used,
    RunKeyMismatch (a ValueError) when `pinned` is given and the run manifest is not signed by
    that key. Missing weights are not an error (the trainer may not have published yet).
    """
    from slime_stoa.protocol.pulse.history import NotPublished, read_manifest, read_pointer
    from slime_stoa.protocol.store import NotFound

    manifest = await read_run_manifest(store, run, pinned=pinned)
    try:
        pointer = await read_pointer(store, run)
    except NotPublished:
        return RunInfo(manifest=manifest)
    try:
        elements = (await read_manifest(store, pointer.manifest)).elements
    except NotFound:  # retention removed it between the two reads: sizes unknown
        return RunInfo(manifest=manifest, version=pointer.version)
    model_config = await _anchor_config(store, pointer.anchor.manifest)
    return RunInfo(
        manifest=manifest,
        version=pointer.version,
        elements=elements,
        kv_bytes_per_token=None if model_config is None else kv_bytes_per_token(model_config),
        model_config=model_config,
    )


async def _anchor_config(store: Any, anchor_manifest_key: str) -> dict[str, Any] | None:
    """The anchor's config.json (a JSON object), or None when it cannot be read."""
    import json

    from slime_stoa.protocol.pulse.history import read_anchor_manifest
    from slime_stoa.protocol.store.capped import read_capped_bytes

    try:
        anchor = await read_anchor_manifest(store, anchor_manifest_key)
        entry = next((f for f in anchor.extras if f.name == "config.json"), None)
        if entry is None:
            return None
        doc = json.loads(await read_capped_bytes(store, entry.key, 1 << 20))  # a config.json
    except Exception:  # best effort: the estimate falls back to a guess
        return None
    return doc if isinstance(doc, dict) else None


def kv_bytes_per_token(config: Mapping[str, Any]) -> int | None:
    """2 (K, V) x layers x KV heads x head dim x 2 bytes, from an HF config; None if unknown."""
    text = config.get("text_config")
    cfg: Mapping[str, Any] = text if isinstance(text, Mapping) else config
    try:
        layers = int(cfg["num_hidden_layers"])
        heads = int(cfg["num_attention_heads"])
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return None
    return 2 * layers * kv_heads * head_dim * 2


def elements_from_model_name(model: str) -> int | None:
    """A parameter count guessed from a name like `Qwen2.5-1.5B-Instruct`; None if none."""
    match = re.search(r"(?<![\d.])(\d+(?:\.\d+)?)\s*([BbMm])(?![a-zA-Z])", model)
    if not match:
        return None
    return int(float(match[1]) * (1e9 if match[2] in "Bb" else 1e6))


@dataclass(frozen=True, kw_only=True)
class MemoryEstimate:
    """Unified memory a worker needs: weights, KV cache of every sequence at full length, overhead."""

    weights: int
    kv_cache: int
    overhead: int = OVERHEAD_BYTES
    weights_guessed: bool = False  # from the model name, not the published weights
    kv_guessed: bool = False  # without the model config

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.overhead

    def verdict(self, memory: int) -> str:
        """'fits', 'tight' or 'too big' against `memory` bytes of unified memory."""
        usable = GPU_SHARE * memory
        if self.total <= usable:
            return "fits"
        return "tight" if self.total <= 0.85 * memory else "too big"


def estimate_memory(
    *,
    elements: int,
    plane: Plane,
    sequences: int,
    tokens_per_sequence: int,
    kv_bytes_per_token: int | None = None,
    weights_guessed: bool = False,
) -> MemoryEstimate:
    """Memory for serving `elements` weights on `plane` with `sequences` decoding at once."""
    if plane not in BYTES_PER_WEIGHT:
        raise ValueError(f"unknown plane {plane!r}; expected one of {sorted(BYTES_PER_WEIGHT)}")
    if elements < 0 or sequences < 1 or tokens_per_sequence < 1:
        raise ValueError("elements must be >= 0, sequences and tokens_per_sequence >= 1")
    per_token = kv_bytes_per_token if kv_bytes_per_token else max(1, elements // _KV_GUESS_RATIO)
    return MemoryEstimate(
        weights=math.ceil(elements * BYTES_PER_WEIGHT[plane]),
        kv_cache=per_token * sequences * tokens_per_sequence,
        weights_guessed=weights_guessed,
        kv_guessed=not kv_bytes_per_token,
    )


def decoding_sequences(config: DaemonConfig, group_size: int) -> int:
    """How many sequences decode at once: batch x group size, capped by max_decode."""
    full = config.batch * group_size
    return min(full, config.max_decode) if config.max_decode else full

