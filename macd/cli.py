"""`macd`: the rollout daemon's command line.

Each command's parser sets `handler`; handlers import what they need lazily, so `macd --help`
and `macd doctor` stay fast and work without MLX.
"""

from __future__ import annotations

import argparse
import asyncio
import getpass
import os
import sys
import time
from pathlib import Path
from typing import Any

from . import config as cfg
from . import run_cmd


def default_data_dir() -> Path:
    return cfg.default_data_dir()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="macd",
        description=(
            "macd: turn this Mac into a stoa rollout worker. It follows a run's weights in the "
            "bucket, generates groups of rollouts with MLX, scores them and uploads them."
        ),
        epilog=(
            "Start with `macd doctor` to see what this machine can run, then "
            "`macd join <bucket-url> --run <run>` and `macd install && macd start`."
        ),
    )
    sub = parser.add_subparsers(title="commands", metavar="COMMAND", required=True)
    doctor = sub.add_parser(
        "doctor", help="check Python, MLX, memory and disk, and recommend a model size and batch"
    )
    doctor.add_argument("--data-dir", type=Path, default=default_data_dir(), help="anchor cache and spool folder")
    add_config_option(doctor)
    doctor.set_defaults(handler=lambda args: _doctor(args))
    _add_join(sub)
    run_cmd.add_parser(sub, add_config_option)
    _add_service_commands(sub)
    return parser


def add_config_option(parser: argparse.ArgumentParser) -> None:
    """`--config PATH` (default: $MACD_CONFIG, else macd.toml in the user's config folder)."""
    parser.add_argument(
        "--config",
        type=Path,
        default=None,
        help="config file (default: $MACD_CONFIG, else macd.toml in the user's config folder)",
    )


def config_path(args: argparse.Namespace) -> Path:
    """The config file named by `--config`, else the default one, as an absolute path."""
    path = args.config if args.config is not None else cfg.default_config_path()
    return Path(os.path.abspath(path.expanduser()))


def _doctor(args: argparse.Namespace) -> int:
    from . import doctor

    return doctor.main(args.data_dir, config_path(args))


def _error(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 1


# -- join -----------------------------------------------------------------------------------------


def _add_join(sub: argparse._SubParsersAction) -> None:
    join = sub.add_parser(
        "join",
        help="point this Mac at a run: write the config, check the bucket and the run",
        description=(
            "Write macd's config for a run, check that the bucket is reachable and the run exists, "
            "and show what this Mac will do. Credentials (from the flags, stdin or the environment) "
            "go to a separate env file only you can read, never into the config."
        ),
    )
    join.add_argument(
        "url",
        metavar="BUCKET_URL",
        help="bucket URL: file:///dir, s3://bucket/prefix?endpoint=..., r2://account/bucket/prefix",
    )
    join.add_argument("--run", required=True, help="run name (created by the operator with `stoa run create`)")
    join.add_argument("--name", help="this worker's name in the fleet table (default: the host name)")
    join.add_argument("--access-key-id", help="bucket access key id (default: from the environment)")
    join.add_argument(
        "--secret-access-key",
        help="bucket secret key; visible to other users in `ps` and kept in shell history: prefer "
        "AWS_SECRET_ACCESS_KEY in the environment, --credentials-stdin, or the prompt",
    )
    join.add_argument(
        "--credentials-stdin",
        action="store_true",
        help="read KEY=VALUE lines (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY) from stdin",
    )
    join.add_argument(
        "--credentials-file",
        type=Path,
        help="use this existing env file (mode 0600) instead of writing one",
    )
    add_config_option(join)
    join.add_argument("--data-dir", type=Path, help="anchor cache and spool folder (default: the user's data folder)")
    join.add_argument("--batch", type=int, help="prompts generated together (default: this machine's memory tier)")
    join.add_argument("--no-check", action="store_true", help="write the config without contacting the bucket")
    join.set_defaults(handler=_join)


def _join(args: argparse.Namespace) -> int:
    from slime_stoa.protocol.store import StoreError

    try:
        return _do_join(args)
    except (ValueError, StoreError) as exc:
        return _error(str(exc))


def _do_join(args: argparse.Namespace) -> int:
    from slime_stoa.protocol.layout import check_name
    from slime_stoa.protocol.store import parse_store_url

    path = config_path(args)
    location = parse_store_url(args.url)
    check_name("run", args.run)
    old = _previous_config(path)
    creds, credentials_file = _join_credentials(args, old, path, remote=location.scheme != "file")
    name = cfg.check_label(args.name or (old.name if old else cfg.default_name()))
    keep_id = old is not None and old.same_run(args.url, args.run)
    data_dir = args.data_dir or (old.data_dir if old else cfg.default_data_dir())
    knobs: dict[str, Any] = {}
    if old is not None:
        knobs = {k: getattr(old, k) for k in ("batch", "max_decode", "transfer_concurrency", "spool_max_mb", "log_level")}
    if args.batch is not None:
        knobs["batch"] = args.batch
    config = cfg.DaemonConfig(
        store=args.url,
        run=args.run,
        name=name,
        worker_id=old.worker_id if keep_id and old else cfg.new_worker_id(name),
        data_dir=Path(os.path.abspath(data_dir.expanduser())),
        credentials_file=credentials_file,
        **knobs,
    )
    info = None
    if not args.no_check:
        info = _check_run(config, creds if creds is not None else config.read_credentials())
        if isinstance(info, int):
            return info
    if creds is not None and credentials_file is not None:
        cfg.write_credentials(credentials_file, creds)
    cfg.save_config(config, path)
    for line in _join_report(config, path, info, kept_id=keep_id, creds_written=creds is not None):
        print(line)
    return 0


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
        creds = cfg.credentials_from_env(values, "stdin")
        if creds is None:
            raise ValueError("no credentials on stdin: expected AWS_ACCESS_KEY_ID=... and AWS_SECRET_ACCESS_KEY=... lines")
        return creds, cfg.credentials_path_for(path)
    if args.credentials_file:
        file = Path(os.path.abspath(args.credentials_file.expanduser()))
        if not file.exists():
            raise ValueError(f"credentials file {file} does not exist")
        if cfg.credentials_from_env(read_env_file(file), str(file)) is None:
            raise ValueError(f"credentials file {file} holds no AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY")
        return None, file
    env_creds = cfg.credentials_from_env(os.environ, "the environment")
    if env_creds is not None:
        return env_creds, cfg.credentials_path_for(path)
    if old is not None and old.credentials_file is not None and old.credentials_file.exists():
        return None, old.credentials_file
    return None, None


def _secret_from_env_or_prompt() -> str:
    for name in ("STOA_SECRET_ACCESS_KEY", "AWS_SECRET_ACCESS_KEY"):
        if os.environ.get(name):
            return os.environ[name]
    if sys.stdin.isatty():
        secret = getpass.getpass("secret access key: ")
        if secret:
            return secret
    raise ValueError(
        "no secret access key: set AWS_SECRET_ACCESS_KEY, use --credentials-stdin, or run in a terminal to be asked"
    )


def _check_run(config: cfg.DaemonConfig, creds: Any) -> cfg.RunInfo | int:
    """Probe the bucket and the run; an exit status with the error printed when they are not usable."""
    from slime_stoa.protocol.store import open_store

    async def probe() -> cfg.RunInfo:
        async with open_store(config.store, credentials=creds) as store:
            return await cfg.probe_run(store, config.run)

    try:
        return asyncio.run(probe())
    except cfg.RunNotFound:
        return _error(
            f"run {config.run!r} does not exist in {config.store}: create it with "
            f"`stoa run create {config.store} --run {config.run} --model <model> --task <task>` "
            f"(or check the run name)"
        )


def _join_report(
    config: cfg.DaemonConfig, path: Path, info: cfg.RunInfo | None, *, kept_id: bool, creds_written: bool
) -> list[str]:
    """What join did and what this Mac will do."""
    from .doctor import memory_bytes

    who = f"worker {config.worker_id} ({'same id as before' if kept_id else 'new id'}), name {config.name!r}"
    lines = [f"joined run {config.run!r} in {config.store} as {who}", f"  config       {path}"]
    if config.credentials_file is not None:
        how = "written, mode 0600" if creds_written else "kept"
        lines.append(f"  credentials  {config.credentials_file} ({how})")
    lines.append(f"  data         {config.data_dir}")
    if info is None:
        lines.append("  (bucket not checked: --no-check)")
    else:
        lines += _plan_lines(config, info, memory_bytes())
    suffix = "" if path == cfg.default_config_path() else f" --config {path}"
    lines += [
        "",
        f"next: macd install{suffix} && macd start    (or `macd run{suffix}` in the foreground)",
    ]
    return lines


def _plan_lines(config: cfg.DaemonConfig, info: cfg.RunInfo, memory: int) -> list[str]:
    m = info.manifest
    sequences = cfg.decoding_sequences(config, m.group_size)
    lines = [
        "this Mac will generate:",
        f"  model        {m.model} ({m.plane} plane)",
        f"  task         {m.task} (split {m.task_split})",
        f"  group size   {m.group_size} samples per prompt, temperature {m.temperature}, up to {m.max_tokens} tokens",
        f"  batch        {config.batch} prompts at once ({sequences} sequences decoding)",
    ]
    elements, guessed = info.elements, False
    if info.version is None:
        lines.append("  weights      none published yet: the worker waits for the trainer's first anchor")
        elements, guessed = cfg.elements_from_model_name(m.model), True
    elif info.elements is None:
        lines.append(f"  weights      v{info.version}")
    else:
        lines.append(f"  weights      v{info.version} ({info.elements:,} weights)")
    if elements is None:
        lines.append(f"  memory       unknown until the weights' size is known ({memory / 2**30:.0f} GiB here)")
        return lines
    est = cfg.estimate_memory(
        elements=elements,
        plane=m.plane,
        sequences=sequences,
        tokens_per_sequence=m.max_prompt_tokens + m.max_tokens,
        kv_bytes_per_token=info.kv_bytes_per_token,
        weights_guessed=guessed,
    )
    verdict = est.verdict(memory)
    lines.append(
        f"  memory       ~{_gib(est.weights)} weights{' (guessed from the model name)' if guessed else ''}"
        f" + ~{_gib(est.kv_cache)} KV cache{' (guess)' if est.kv_guessed else ''} + {_gib(est.overhead)} runtime"
        f" = ~{_gib(est.total)} of {_gib(memory)} here: {verdict}"
    )
    if verdict != "fits":
        lines.append(
            "               lower `batch` (or set `max_decode`) in the config, or serve an int8 run"
        )
    return lines


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 / 10 else f"{n / 2**20:.0f} MiB"


# -- the launchd agent ----------------------------------------------------------------------------


def _add_service_commands(sub: argparse._SubParsersAction) -> None:
    specs = [
        ("install", "write the launchd agent (runs `macd run` at login, restarts it if it crashes)", _install),
        ("uninstall", "stop the agent and remove it", _uninstall),
        ("start", "start the agent now (restart it when running, e.g. after a config change)", _start),
        ("stop", "stop the agent (SIGTERM: the spool is flushed) and keep it stopped across logins", _stop),
        ("status", "the agent's state, pid and last exit code, the last heartbeat and log lines", _status),
    ]
    for name, help_text, handler in specs:
        cmd = sub.add_parser(name, help=help_text, description=help_text[0].upper() + help_text[1:] + ".")
        _add_agent_options(cmd)
        cmd.add_argument("--dry-run", action="store_true", help="print the launchctl commands instead of running them")
        if name in ("install", "status"):
            add_config_option(cmd)
        if name == "install":
            cmd.add_argument(
                "--background",
                action="store_true",
                help="yield to a person using this Mac (ProcessType Background: low priority, slower rollouts)",
            )
        cmd.set_defaults(handler=handler)
    logs = sub.add_parser("logs", help="print the agent's log (-f: keep following it)")
    logs.add_argument("--instance", help="name of a second agent on this Mac (label dev.stoa.macd.<instance>)")
    logs.add_argument("-n", "--lines", type=int, default=50, help="how many last lines to print")
    logs.add_argument("-f", "--follow", action="store_true", help="keep printing new lines (Ctrl-C stops)")
    logs.set_defaults(handler=_logs)


def _add_agent_options(cmd: argparse.ArgumentParser) -> None:
    cmd.add_argument("--instance", help="name of a second agent on this Mac (label dev.stoa.macd.<instance>)")
    cmd.add_argument(
        "--domain",
        choices=("auto", "gui", "user"),
        default="auto",
        help="launchd domain: gui/<uid> (logged in at the screen) or user/<uid> (e.g. over SSH); "
        "auto picks gui when you own the console",
    )


def _service_call(fn):
    """Run a service handler; launchd and config errors become `error: ...` and exit 1."""

    def handler(args: argparse.Namespace) -> int:
        from .service import ServiceError

        try:
            return fn(args)
        except (ServiceError, ValueError, OSError) as exc:
            return _error(str(exc))

    return handler


def _agent(args: argparse.Namespace):
    from . import service

    return service.agent_for(args.instance, domain_kind=args.domain)


@_service_call
def _install(args: argparse.Namespace) -> int:
    from . import service

    launchctl = service.Launchctl(dry_run=args.dry_run)
    launchctl.require()
    path = config_path(args)
    config = cfg.load_config(path)
    agent = _agent(args)
    plist = service.build_plist(
        label=agent.label,
        config_path=path,
        python=sys.executable,
        working_dir=config.data_dir,
        log_file=agent.log,
        process_type="Background" if args.background else service.DEFAULT_PROCESS_TYPE,
    )
    if not args.dry_run:
        config.data_dir.mkdir(parents=True, exist_ok=True)
    outcome = service.install(agent, plist, launchctl)
    if args.dry_run:
        print("# then `macd start` runs:")
        service.start(agent, launchctl)
        return 0
    print(f"{agent.label}: {agent.plist} {outcome}; it runs `macd run --config {path}` at login")
    print(f"log: {agent.log}")
    print("next: macd start" if outcome != "reloaded" else "the running agent was reloaded with the new settings")
    return 0


@_service_call
def _start(args: argparse.Namespace) -> int:
    from . import service

    agent = _agent(args)
    outcome = service.start(agent, service.Launchctl(dry_run=args.dry_run))
    if not args.dry_run:
        print(f"{agent.label} {outcome}; see `macd status` and `macd logs -f`")
    return 0


@_service_call
def _stop(args: argparse.Namespace) -> int:
    from . import service

    agent = _agent(args)
    was_running = service.stop(agent, service.Launchctl(dry_run=args.dry_run))
    if not args.dry_run:
        print(f"{agent.label} {'stopped' if was_running else 'was not running'}; it stays stopped until `macd start`")
    return 0


@_service_call
def _uninstall(args: argparse.Namespace) -> int:
    from . import service

    agent = _agent(args)
    existed = service.uninstall(agent, service.Launchctl(dry_run=args.dry_run))
    if not args.dry_run:
        print(f"{agent.label} removed ({agent.plist})" if existed else f"{agent.label} was not installed")
        print(f"the config, credentials, data and log ({agent.log}) are kept")
    return 0


@_service_call
def _status(args: argparse.Namespace) -> int:
    """Exit 0 when the agent runs, 3 when it does not, 1 when launchd cannot be asked."""
    from . import service

    agent = _agent(args)
    launchctl = service.Launchctl(dry_run=args.dry_run)
    rc = 0
    try:
        state = service.status(agent, launchctl)
    except (service.ServiceError, ValueError) as exc:
        print(f"agent      {exc}")
        state, rc = None, 1
    if args.dry_run:
        return 0
    if state is not None:
        print(f"agent      {agent.service}")
        print(f"plist      {agent.plist} ({'installed' if agent.plist.exists() else 'not installed: run `macd install`'})")
        print(f"state      {_state_text(state)}")
        rc = 0 if state.running else 3
    _print_config_and_heartbeat(config_path(args))
    _print_log_tail(agent.log, 10)
    return rc


def _state_text(state: Any) -> str:
    if not state.loaded:
        return "not loaded (stopped): `macd start` starts it"
    parts = [state.state or "unknown"]
    if state.pid is not None:
        parts.append(f"pid {state.pid}")
    if state.last_exit is not None:
        parts.append(f"last exit code {state.last_exit}")
    if state.last_signal:
        parts.append(f"last signal {state.last_signal}")
    if state.runs is not None:
        parts.append(f"{state.runs} run(s)")
    return ", ".join(parts)


def _print_config_and_heartbeat(path: Path) -> None:
    try:
        config = cfg.load_config(path)
    except ValueError as exc:
        print(f"config     {exc}")
        return
    print(f"config     {path}: run {config.run} in {config.store}, worker {config.worker_id} ({config.name})")
    print(f"heartbeat  {_heartbeat_text(config)}")


def _heartbeat_text(config: cfg.DaemonConfig, timeout_s: float = 10.0) -> str:
    """The worker's last heartbeat in the bucket, in one line (or why there is none)."""
    from slime_stoa.protocol.heartbeat import Heartbeat
    from slime_stoa.protocol.layout import RunLayout
    from slime_stoa.protocol.store import NotFound, StoreError, open_store

    async def read() -> bytes:
        async with open_store(config.store, credentials=config.read_credentials()) as store:
            return await store.get_bytes(RunLayout(config.run).heartbeat(config.worker_id))

    try:
        beat = Heartbeat.from_bytes(asyncio.run(asyncio.wait_for(read(), timeout_s)))
    except NotFound:
        return "none yet in the bucket"
    except (StoreError, ValueError, OSError, TimeoutError) as exc:
        return f"unavailable ({str(exc) or 'timed out'})"
    age = time.time() - beat.updated_at
    version = "no weights" if beat.version is None else f"v{beat.version}"
    text = f"{age:.0f} s ago: {beat.status}, {version}, {beat.tokens_per_s:.0f} tok/s"
    text += f", {beat.groups_uploaded} groups uploaded"
    if beat.groups_spooled:
        text += f", {beat.groups_spooled} spooled"
    if beat.errors:
        text += f", {beat.errors} errors (last: {beat.last_error})"
    return text


def _print_log_tail(log: Path, count: int) -> None:
    from .service import tail_lines

    if not log.exists():
        print(f"log        {log} (none yet)")
        return
    print(f"log        {log}, last lines:")
    for line in tail_lines(log, count):
        print(f"  {line}")


def _logs(args: argparse.Namespace) -> int:
    from . import service

    log = service.log_path(service.label_for(args.instance))
    if not log.exists():
        return _error(
            f"no log at {log} yet: the agent writes it once started (`macd start`); "
            f"`macd run` logs to the terminal"
        )
    for line in service.tail_lines(log, args.lines):
        print(line)
    if args.follow:
        sys.stdout.flush()
        try:
            service.follow(log)
        except KeyboardInterrupt:
            pass
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.handler(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
