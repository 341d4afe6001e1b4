"""`macd join`: point this Mac at a run — write the config, check the bucket and the run, and say
what this Mac will do (model, task, batch, memory: the memory plan counts a search task's index at
the size its manifest in the bucket gives, `macd.index_plan`)."""

from __future__ import annotations

import argparse
import asyncio
import getpass
import json
import math
import os
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from slime_stoa.protocol.cli_fields import add_field_options, setting
from slime_stoa.protocol.shell import shell_command
from slime_stoa.protocol.signing import PublicKey, write_private_file
from slime_stoa.protocol.worker_keys import worker_key_bytes

from . import config as cfg
from .cmdline import add_config_option, config_path, error, run_create_command
from .index_plan import IndexPlan
from .join_settings import JOIN_SETTINGS, Keep, merge_settings
from .plane_choice import plan_device

if TYPE_CHECKING:
    from slime_stoa.protocol.heartbeat import Heartbeat
    from slime_stoa.protocol.run_manifest import Plane

    from .plane_choice import PlaneChoice


@dataclass(frozen=True, kw_only=True)
class JoinInputs:
    """The options of `macd join` that are not config fields: credentials to write, and whether to
    check the bucket (with `--config`, every other option is a `DaemonConfig` field)."""

    access_key_id: str | None = setting("bucket access key id (default: from the environment)", None, join=True)
    secret_access_key: str | None = setting(
        "bucket secret key; visible to other users in `ps` and kept in shell history: prefer "
        "AWS_SECRET_ACCESS_KEY in the environment, --credentials-stdin, or the prompt",
        None,
        join=True,
    )
    credentials_stdin: bool = setting(
        "read KEY=VALUE lines (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY) from stdin", False, join=True
    )
    no_check: bool = setting("write the config without contacting the bucket", False, join=True)


#: The fields a re-join of any run keeps from the previous config unless a flag sets them.
KEPT_ON_REJOIN = tuple(row.field for row in JOIN_SETTINGS if row.keep is Keep.ANY_RUN)


def add_parser(sub: argparse._SubParsersAction) -> None:
    """`macd join`: one option per `DaemonConfig` field with `join=` help (default None: not given,
    so the previous config's value or the field's default), then the `JoinInputs` and `--config`."""
    join = sub.add_parser(
        "join",
        help="point this Mac at a run: write the config, check the bucket and the run",
        description=(
            "Write macd's config for a run, check that the bucket is reachable and the run exists, "
            "and show what this Mac will do. Credentials (from the flags, stdin or the environment) "
            "go to a separate env file only you can read, never into the config."
        ),
    )
    add_field_options(join, cfg.DaemonConfig, "join", with_defaults=False)
    add_field_options(join, JoinInputs, "join", with_defaults=False)
    add_config_option(join)
    join.set_defaults(handler=handle)


def handle(args: argparse.Namespace) -> int:
    from slime_stoa.protocol.store import StoreError

    try:
        return _do_join(args)
    except (ValueError, StoreError) as exc:
        return error(str(exc))


def _do_join(args: argparse.Namespace) -> int:
    from slime_stoa.protocol.layout import check_name, check_worker_id
    from slime_stoa.protocol.store import parse_store_url

    path = config_path(args)
    location = parse_store_url(args.store)
    if location.scheme == "file" and location.path is not None and not location.path.is_absolute():
        # Kept absolute: the daemon (launchd) and `macd doctor` run from other folders.
        args.store = f"file://{location.path.resolve()}"
    check_name("run", args.run)
    if args.worker_id is not None:
        check_worker_id(args.worker_id)
    if args.run_key is not None:
        PublicKey.from_text(args.run_key)  # ValueError naming the expected form
    worker_key = _read_worker_key(args)
    old = _previous_config(path)
    creds, credentials_file = _join_credentials(args, old, path, remote=location.scheme != "file")
    key_copy = worker_key_path_for(path) if worker_key is not None else None
    settings = merge_settings(
        JOIN_SETTINGS,
        _given_settings(args, worker_key, key_copy),
        None if old is None else {f.name: getattr(old, f.name) for f in fields(old)},
        same_run=old is not None and old.same_run(args.store, args.run),
    )
    settings["name"] = cfg.check_label(settings["name"])  # the previous config's or the host's too
    settings["data_dir"] = Path(os.path.abspath(settings["data_dir"].expanduser()))
    keep_id = old is not None and old.worker_id == settings["worker_id"]
    config = cfg.DaemonConfig(store=args.store, run=args.run, credentials_file=credentials_file, **settings)
    info: cfg.RunInfo | None = None
    index: IndexPlan | None = None
    live: Heartbeat | None = None
    pinned_now = False
    if not args.no_check:
        checked = _check_run(config, creds if creds is not None else config.read_credentials())
        if isinstance(checked, int):
            return checked
        info, index, live = checked
        if config.plane:
            try:
                cfg.plane_override(info.manifest, config.plane)
            except ValueError as exc:
                return error(f"--plane: {exc}")
        if not config.run_key and info.manifest.run_key:  # trust on first use
            config, pinned_now = replace(config, run_key=info.manifest.run_key), True
    if creds is not None and credentials_file is not None:
        cfg.write_credentials(credentials_file, creds)
    if worker_key is not None and key_copy is not None:
        write_private_file(key_copy, worker_key_bytes(worker_key), overwrite=True)
    cfg.save_config(config, path)
    for line in join_report(config, path, info, kept_id=keep_id, creds_written=creds is not None, index=index):
        print(line)
    for line in key_lines(config, pinned_now=pinned_now, explicit=args.run_key is not None):
        print(line)
    if warning := no_worker_key_warning(config):
        print(warning, file=sys.stderr)
    if live is not None:
        print(live_worker_warning(config, live, time.time()), file=sys.stderr)
    return 0


def _given_settings(args: argparse.Namespace, worker_key: Any, key_copy: Path | None) -> dict[str, Any]:
    """The settings the flags give (None: not given), checked: the worker id is the worker key's
    when one is given (`_read_worker_key` checked it against --worker-id), its config entry the
    installed copy's path."""
    from slime_stoa.protocol.store import parse_store_url

    name = cfg.check_label(args.name) if args.name else None  # checked first, as before the others
    if args.rollouts_store is not None:
        parse_store_url(args.rollouts_store)
    rollouts_credentials_file = None
    if args.rollouts_credentials_file is not None:
        rollouts_credentials_file = Path(os.path.abspath(args.rollouts_credentials_file.expanduser()))
        if not rollouts_credentials_file.exists():
            raise ValueError(f"credentials file {rollouts_credentials_file} does not exist")
    return {
        "name": name,
        "worker_id": worker_key.worker if worker_key is not None else args.worker_id,
        "data_dir": args.data_dir,
        "batch": args.batch,
        "plane": args.plane,
        "run_key": args.run_key,
        "rollouts_store": args.rollouts_store,
        "rollouts_credentials_file": rollouts_credentials_file,
        "worker_key": None if key_copy is None else str(key_copy),
    }


def live_worker_warning(config: cfg.DaemonConfig, beat: Heartbeat, now: float) -> str:
    """What join says when the worker id's heartbeat says it runs: this Mac's own macd (it holds
    the spool of this data folder), or another Mac's, which `macd run` here would be refused
    next to (`twin.py`)."""
    from slime_stoa.protocol.heartbeat import ago

    from .spool import lock_holder

    seen = f"its heartbeat said {beat.status!r} {ago(now - beat.updated_at)}, name {beat.name!r}"
    holder = lock_holder(config.data_dir / "spool" / config.run)
    if holder is not None:
        pid = f"pid {holder}" if holder > 0 else "a process"
        return (f"note: worker {config.worker_id!r} already runs on this Mac ({pid} holds its spool; {seen}): "
                f"restart it to use this config")
    return (
        f"warning: worker {config.worker_id!r} of run {config.run!r} is running elsewhere ({seen}): two Macs with "
        f"one worker id repeat each other's record keys and the trainer refuses half their groups; join this Mac "
        f"with another --worker-id (in a signed run with a worker key of its own), or stop the other first "
        f"(`macd run` here refuses to start while it runs)"
    )


def no_worker_key_warning(config: cfg.DaemonConfig) -> str | None:
    """One line when the run is signed (a run key is pinned) but this Mac holds no worker key."""
    if not config.run_key or config.worker_key:
        return None
    add = shell_command("stoa", "worker", "add", "NAME", "--store", config.store, "--run", config.run,
                        "--key", "RUN_KEY_FILE", "--out", "FILE")
    return (
        f"warning: run {config.run!r} is signed and this Mac has no worker key: the trainer will refuse its "
        f"records; issue one with `{add}` and join again with --worker-key FILE"
    )


def worker_key_path_for(config_path: Path) -> Path:
    """Where `macd join --worker-key` installs the worker key of the config at `config_path`."""
    return config_path.with_name(f"{config_path.stem}.worker-key.json")


def _read_worker_key(args: argparse.Namespace) -> Any:
    """The worker key file given with --worker-key (None without); ValueError if it is not for the run."""
    if args.worker_key is None:
        return None
    from slime_stoa.protocol.worker_keys import read_worker_key_file

    entry = read_worker_key_file(Path(os.path.abspath(args.worker_key.expanduser())))
    if entry.run != args.run:
        raise ValueError(f"worker key {args.worker_key} is for run {entry.run!r}, not {args.run!r}")
    if args.worker_id is not None and args.worker_id != entry.worker:
        raise ValueError(f"worker key {args.worker_key} is worker {entry.worker!r}'s, not --worker-id {args.worker_id!r}")
    return entry


def key_lines(config: cfg.DaemonConfig, *, pinned_now: bool, explicit: bool) -> list[str]:
    """What join says about the run key it pinned and the worker key it installed."""
    lines = []
    if config.run_key:
        key = PublicKey.from_text(config.run_key)
        how = "given with --run-key" if explicit else "trusted on first use" if pinned_now else "pinned before"
        lines.append(f"  run key      {key.key_id} ({key.fingerprint}), {how}: weights not signed by it are refused")
        if pinned_now:
            lines.append("               compare this fingerprint with the operator's `stoa keys show`")
    else:
        lines.append("  run key      none: the run is unsigned (or not checked), weights are not verified by signature")
    if config.worker_key:
        lines.append(f"  worker key   {config.worker_key} (mode 0600)")
    return lines


def _previous_config(path: Path) -> cfg.DaemonConfig | None:
    """The config already at `path`, if any and valid (a broken one is replaced, with a warning)."""
    if not path.exists():
        return None
    try:
        return cfg.load_config(path)
    except ValueError as exc:
        print(f"warning: replacing the invalid config: {exc}", file=sys.stderr)
        return None


def _join_credentials(
    args: argparse.Namespace, old: cfg.DaemonConfig | None, path: Path, *, remote: bool
) -> tuple[Any, Path | None]:
    """(credentials to write or None, credentials file for the config).

    Order: flags, stdin, --credentials-file, the environment, the previous config's file;
    none of them: the usual lookup at run time (~/.r2env, ...).
    """
    from slime_stoa.protocol.store.credentials import (
        Credentials,
        credentials_in,
        parse_env_file,
        read_env_file,
    )

    given = args.access_key_id or args.secret_access_key or args.credentials_stdin or args.credentials_file
    if not remote:
        if given:
            print("note: file:// buckets need no credentials; ignoring the ones given", file=sys.stderr)
        return None, None
    if args.access_key_id or args.secret_access_key:
        if not args.access_key_id:
            raise ValueError("--secret-access-key needs --access-key-id")
        secret = args.secret_access_key or _secret_from_env_or_prompt()
        return Credentials(args.access_key_id, secret, None, "the command line"), cfg.credentials_path_for(path)
    if args.credentials_stdin:
        try:
            values = parse_env_file(sys.stdin.read())
        except ValueError as exc:
            raise ValueError(f"credentials on stdin: {exc}") from None
        creds = credentials_in(values, "stdin", strict=True)
        if creds is None:
            raise ValueError("no credentials on stdin: expected AWS_ACCESS_KEY_ID=... and AWS_SECRET_ACCESS_KEY=... lines")
        return creds, cfg.credentials_path_for(path)
    if args.credentials_file:
        file = Path(os.path.abspath(args.credentials_file.expanduser()))
        if not file.exists():
            raise ValueError(f"credentials file {file} does not exist")
        if credentials_in(read_env_file(file), str(file), strict=True) is None:
            raise ValueError(f"credentials file {file} holds no AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY")
        return None, file
    env_creds = credentials_in(os.environ, "the environment", strict=True)
    if env_creds is not None:
        return env_creds, cfg.credentials_path_for(path)
    if old is not None and old.credentials_file is not None and old.credentials_file.exists():
        return None, old.credentials_file
    return None, None


def _secret_from_env_or_prompt() -> str:
    """The secret for `--access-key-id`: from the environment (under the store's names, see
    `slime_stoa.protocol.store.credentials`), else asked for in a terminal."""
    from slime_stoa.protocol.store.credentials import SECRET_NAMES

    for name in SECRET_NAMES:
        if os.environ.get(name):
            return os.environ[name]
    if sys.stdin.isatty():
        secret = getpass.getpass("secret access key: ")
        if secret:
            return secret
    raise ValueError(
        "no secret access key: set AWS_SECRET_ACCESS_KEY, use --credentials-stdin, or run in a terminal to be asked"
    )


def _check_run(config: cfg.DaemonConfig, creds: Any) -> tuple[cfg.RunInfo, IndexPlan | None, Heartbeat | None] | int:
    """Probe the bucket and the run (and the size of its search index, if it has one, and whether
    a worker with this id runs: its heartbeat, when it says so); an exit status with the error
    printed when they are not usable."""
    from slime_stoa.protocol.hf.architectures import unsupported_config
    from slime_stoa.protocol.store import open_store

    from .index_plan import run_index_plan
    from .shared_dir import machine_shared_dir

    async def probe() -> tuple[cfg.RunInfo, IndexPlan | None, Heartbeat | None]:
        async with open_store(config.store, credentials=creds) as store:
            info = await cfg.probe_run(store, config.run, pinned=config.run_key or None)
            index = await run_index_plan(store, info.manifest, machine_shared_dir())
            return info, index, await _running_heartbeat(config, store)

    try:
        info, index, live = asyncio.run(probe())
    except cfg.RunNotFound:
        return error(
            f"run {config.run!r} does not exist in {config.store}: create it with "
            f"`{run_create_command(config.store, config.run)}` (or check the run name)"
        )
    from slime_stoa.tasks import TASKS

    task = info.manifest.task
    if task not in TASKS:  # the worker could not make a single prompt of it
        return error(
            f"run {config.run!r} in {config.store} names task {task!r}, which this macd does not know "
            f"(known tasks: {', '.join(sorted(TASKS))}): create a run of one of them under a new name "
            f"(`{run_create_command(config.store, 'NEW_RUN')}`), or upgrade macd if the task is new"
        )
    model = model_config_of(info)  # the anchor's config.json in the bucket (or the run's local model folder)
    if model is not None and (why := unsupported_config(model)):  # `macd run` would refuse it too
        return error(
            f"run {config.run!r} in {config.store} is of a model macd cannot run: {why}; the operator creates "
            f"a run of a supported model (`{run_create_command(config.store, 'NEW_RUN')}`)"
        )
    return info, index, live


async def _running_heartbeat(config: cfg.DaemonConfig, store: Any) -> Heartbeat | None:
    """The heartbeat of this worker id when it says the worker runs (as `stoa fleet` reads it);
    None when it does not, or cannot be read (a warning only: never a reason to fail a join)."""
    from slime_stoa.protocol.heartbeat import NOT_RUNNING, read_heartbeat, shown_status
    from slime_stoa.protocol.store import StoreError, open_store

    try:
        if config.rollouts_store:  # the heartbeat is in the second bucket
            creds = config.read_credentials(config.rollouts_credentials_file)
            async with open_store(config.rollouts_store, credentials=creds) as rollouts:
                beat = await read_heartbeat(rollouts, config.run, config.worker_id)
        else:
            beat = await read_heartbeat(store, config.run, config.worker_id)
    except (StoreError, ValueError, OSError):
        return None
    return beat if shown_status(beat, time.time()) not in NOT_RUNNING else None


def join_report(
    config: cfg.DaemonConfig, path: Path, info: cfg.RunInfo | None, *, kept_id: bool, creds_written: bool,
    index: IndexPlan | None = None,
) -> list[str]:
    """What join did and what this Mac will do (`index`: the run's search index, if it has one)."""
    from .machine import memory_bytes

    who = f"worker {config.worker_id} ({'same id as before' if kept_id else 'new id'}), name {config.name!r}"
    lines = [f"joined run {config.run!r} in {config.store} as {who}", f"  config       {path}"]
    if config.credentials_file is not None:
        how = "written, mode 0600" if creds_written else "kept"
        lines.append(f"  credentials  {config.credentials_file} ({how})")
    if config.rollouts_store:
        lines.append(f"  rollouts     {config.rollouts_store} (records and heartbeat; the run's bucket is only read)")
    lines.append(f"  data         {config.data_dir}")
    if info is None:
        lines.append("  (bucket not checked: --no-check)")
    else:
        lines += plan_lines(config, info, memory_bytes(), index)
    suffix = "" if path == cfg.default_config_path() else f" {shell_command('--config', path)}"
    lines += [
        "",
        f"next: macd install{suffix} && macd start    (or `macd run{suffix}` in the foreground)",
    ]
    return lines


def plan_lines(
    config: cfg.DaemonConfig, info: cfg.RunInfo, memory: int, index: IndexPlan | None = None, device: str | None = None,
) -> list[str]:
    """What this Mac will generate for the run, and whether it fits in `memory` bytes beside the
    run's search `index` (None: the run has none), computing on `device` (None: this machine's,
    `plan_device`)."""
    m = info.manifest
    sequences = cfg.decoding_sequences(config, m.group_size)
    lines = [
        "this Mac will generate:",
        f"  model        {m.model} ({m.plane} plane)",
        f"  task         {m.task} (split {m.task_split})",
        f"  group size   {m.group_size} samples per prompt, temperature {m.temperature}, up to {m.max_tokens} tokens",
        f"  batch        {config.batch} prompts at once ({sequences} sequences decoding)",
    ]
    plane_text = plane_line(config, info, memory, index, device=device)
    if plane_text is not None:
        lines.append(plane_text)
    elements, guessed = info.elements, False
    if info.version is None:
        lines.append("  weights      none published yet: the worker waits for the trainer's first anchor")
        elements, guessed = cfg.elements_from_model_name(m.model), True
    elif info.elements is None:
        lines.append(f"  weights      v{info.version}")
    else:
        lines.append(f"  weights      v{info.version} ({info.elements:,} weights)")
    plan, warning = memory_plan_lines(config, info, memory, index, device)
    tail = plan + ([] if warning is None else [warning])
    if elements is None:
        lines.append(f"  memory       unknown until the weights' size is known ({memory / 2**30:.0f} GiB here)")
        return lines + tail
    if _planned(plan):  # the plan counts all a rough estimate would, from the model's own config
        return lines + tail
    served, _ = served_plane(config, info, memory, index, device=device)
    est = cfg.estimate_memory(
        elements=elements,
        plane=served,
        sequences=sequences,
        tokens_per_sequence=m.max_prompt_tokens + m.max_tokens,
        kv_bytes_per_token=info.kv_bytes_per_token,
        weights_guessed=guessed,
    )
    if served != "bf16" and m.offers(served):  # a published plane is held alone, no bf16 master
        from .memory_plan import HELD_BYTES

        est = replace(est, weights=math.ceil(elements * HELD_BYTES[served]))
    index_bytes = 0 if index is None else index.counted
    whole = replace(est, overhead=est.overhead + index_bytes)  # the index counted beside the runtime
    verdict = whole.verdict(memory)
    lines.append(
        f"  memory       ~{_gib(est.weights)} {served} weights{' (guessed from the model name)' if guessed else ''}"
        f" + ~{_gib(est.kv_cache)} KV cache{' (guess)' if est.kv_guessed else ''} + {_gib(est.overhead)} runtime"
        + (f" + {_gib(index_bytes)} search index" if index_bytes else "")
        + f" = ~{_gib(whole.total)} of {_gib(memory)} here: {verdict}"
    )
    if verdict != "fits":
        lines.append(
            "               lower `batch` (or set `max_decode`) in the config, or join a run of a smaller model"
        )
    return lines + tail


def served_plane(
    config: cfg.DaemonConfig, info: cfg.RunInfo, memory: int, index: IndexPlan | None = None, *,
    device: str | None = None,
) -> tuple[Plane, PlaneChoice | None]:
    """The plane this Mac will serve the run on, as the worker picks it (`following.plane_for`):
    the config's `plane`; else, when the run publishes quantized planes and its model config is
    known, `plane_choice.choose_plane`'s beside the run's search `index` (returned with it); else
    the run's plane."""
    from .plane_choice import choose_plane

    m, model = info.manifest, model_config_of(info)
    if config.plane:
        try:
            return cfg.plane_override(m, config.plane), None
        except ValueError:  # the worker refuses to serve; join and doctor say why
            return m.plane, None
    if not m.planes or model is None:
        return m.plane, None
    choice = choose_plane(model, m, memory=memory, sequences=cfg.decoding_sequences(config, m.group_size),
                          index_bytes=0 if index is None else index.counted, device=device)
    return (m.plane, None) if choice is None else (choice.plane, choice)


def plane_line(
    config: cfg.DaemonConfig, info: cfg.RunInfo, memory: int, index: IndexPlan | None = None, *,
    device: str | None = None,
) -> str | None:
    """The plane this Mac serves the run on (`served_plane`), when the config sets it or the run
    publishes quantized planes and its model config is known."""
    if config.plane:
        return f"  plane        {config.plane} (this config's `plane`)"
    _, choice = served_plane(config, info, memory, index, device=device)
    return None if choice is None else f"  plane        {choice.describe()}"


def model_config_of(info: cfg.RunInfo) -> Mapping[str, Any] | None:
    """The run's model config: the anchor's config.json, else the manifest's model folder when it
    is a folder on this machine (a run not yet published); None when neither is readable."""
    if info.model_config is not None:
        return info.model_config
    try:
        doc = json.loads((Path(info.manifest.model).expanduser() / "config.json").read_bytes())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


_NO_PLAN = ("  memory plan  unknown", "  memory plan  the model's config.json lacks")


def _planned(plan: list[str]) -> bool:
    """Whether `memory_plan_lines` made a plan (the model's config.json gave its sizes)."""
    return bool(plan) and not plan[0].startswith(_NO_PLAN)


def memory_plan_lines(
    config: cfg.DaemonConfig, info: cfg.RunInfo, memory: int, index: IndexPlan | None = None, device: str | None = None,
) -> tuple[list[str], str | None]:
    """`memory_plan.this_mac` for the run's model, group size, lengths and this config's batch,
    with the run's search `index` (None: the run has none), on `device` (None: this machine's,
    `plan_device`): (indented lines, warning or None); nothing but the index's line when the model
    config is unknown."""
    from .memory_plan import this_mac

    model = model_config_of(info)
    index_lines = [] if index is None else [f"  {'':<12} {index.line}"]
    if model is None:
        return [f"{_NO_PLAN[0]} until the model's config.json is published", *index_lines], None
    m = info.manifest
    lines, warning = this_mac(
        model, memory=memory, plane=m.plane, group_size=cfg.decoding_sequences(config, m.group_size), groups=1,
        prompt_tokens=m.max_prompt_tokens, response_tokens=m.max_tokens, published=m.planes,
        index_bytes=0 if index is None else index.counted, index_line="" if index is None else index.line,
        served=served_plane(config, info, memory, index, device=device)[0], device=device or plan_device(),
    )
    if not lines:
        return [f"{_NO_PLAN[1]} the sizes a plan needs", *index_lines], None
    return [f"  {'memory plan' if i == 0 else '':<12} {line}" for i, line in enumerate(lines)], warning


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 / 10 else f"{n / 2**20:.0f} MiB"
