"""`macd install | uninstall | start | stop | status | logs`: the launchd agent that runs
`macd run --config PATH` at login (see `macd.service` for the plist and the launchctl calls)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from slime_stoa.protocol.shell import shell_command

from . import config as cfg
from .cmdline import add_config_option, config_path, error

if TYPE_CHECKING:
    from .service import Agent, Launchctl

T = TypeVar("T")


def add_parser(sub: argparse._SubParsersAction) -> None:
    specs = [
        ("install", "write the launchd agent (runs `macd run` at login, restarts it if it crashes)", _install),
        ("uninstall", "stop the agent and remove it", _uninstall),
        ("start", "start the agent now (restart it when running, e.g. after a config change)", _start),
        ("stop", "stop the agent (SIGTERM: the spool is flushed) and keep it stopped across logins", _stop),
        ("status", "the agent's state, pid and last exit code (macOS), the last heartbeat and log lines", _status),
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
            return error(str(exc))

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
    print(f"{agent.label}: {agent.plist} {outcome}; it runs `{shell_command('macd', 'run', '--config', path)}` at login")
    print(f"log: {agent.log}")
    print("next: macd start" if outcome != "reloaded" else "the running agent was reloaded with the new settings")
    return 0


def _agent_action(
    args: argparse.Namespace,
    action: Callable[[Agent, Launchctl], T],
    report: Callable[[Agent, T], str],
) -> int:
    """Run a launchctl `action` on the agent `args` names and print `report` of its outcome
    (a dry run prints the launchctl commands instead)."""
    from . import service

    agent = _agent(args)
    outcome = action(agent, service.Launchctl(dry_run=args.dry_run))
    if not args.dry_run:
        print(report(agent, outcome))
    return 0


@_service_call
def _start(args: argparse.Namespace) -> int:
    from . import service

    return _agent_action(
        args, service.start, lambda agent, outcome: f"{agent.label} {outcome}; see `macd status` and `macd logs -f`"
    )


@_service_call
def _stop(args: argparse.Namespace) -> int:
    from . import service

    return _agent_action(
        args,
        service.stop,
        lambda agent, was_running: f"{agent.label} {'stopped' if was_running else 'was not running'}; "
        "it stays stopped until `macd start`",
    )


@_service_call
def _uninstall(args: argparse.Namespace) -> int:
    from . import service

    return _agent_action(
        args,
        service.uninstall,
        lambda agent, existed: (f"{agent.label} removed ({agent.plist})" if existed else f"{agent.label} was not installed")
        + f"\nthe config, credentials, data and log ({agent.log}) are kept",
    )


@_service_call
def _status(args: argparse.Namespace) -> int:
    """Exit 0 when the worker runs, 3 when it does not, 1 when that cannot be told. On macOS the
    agent's state decides (launchctl); elsewhere, with no launchd, the worker's heartbeat does."""
    from . import service

    agent = _agent(args)
    launchctl = service.Launchctl(dry_run=args.dry_run)
    if not args.dry_run and not service.has_launchctl():
        return _status_from_heartbeat(config_path(args))
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


def _status_from_heartbeat(path: Path) -> int:
    """`macd status` without launchd: the worker's config, heartbeat and log; 0 when the
    heartbeat says it runs, 3 when it says it does not (or there is none), 1 when unreadable."""
    print("agent      none: launchd agents are macOS-only; the worker's heartbeat says how it is doing")
    running = _print_config_and_heartbeat(path)
    log = beside_config_log(path)
    if log is not None:
        _print_log_tail(log, 10)
    else:
        print(
            "log        `macd run` logs to the terminal it runs in (under systemd: "
            "`journalctl --user -u <unit>`)"
        )
    return 1 if running is None else 0 if running else 3


def beside_config_log(path: Path) -> Path | None:
    """A `macd.log` beside the config (where `stoa quickstart` writes each worker's), if any."""
    log = path.parent / "macd.log"
    return log if log.is_file() else None


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


def _print_config_and_heartbeat(path: Path) -> bool | None:
    """Print the config and the heartbeat lines; whether the heartbeat says the worker runs
    (None: no config, or the heartbeat could not be read)."""
    try:
        config = cfg.load_config(path)
    except ValueError as exc:
        print(f"config     {exc}")
        return None
    print(f"config     {path}: run {config.run} in {config.store}, worker {config.worker_id} ({config.name})")
    text, running = heartbeat_status(config)
    print(f"heartbeat  {text}")
    return running


def heartbeat_text(config: cfg.DaemonConfig, timeout_s: float = 10.0) -> str:
    """The worker's last heartbeat in the bucket and the run's current version, in one line (or
    why there is none)."""
    return heartbeat_status(config, timeout_s)[0]


def heartbeat_status(config: cfg.DaemonConfig, timeout_s: float = 10.0) -> tuple[str, bool | None]:
    """`heartbeat_text`, and whether the heartbeat says the worker runs (False when it has none
    in the bucket; None when the bucket could not be read)."""
    from slime_stoa.protocol.heartbeat import MAX_HEARTBEAT_BYTES, NOT_RUNNING, Heartbeat, shown_status
    from slime_stoa.protocol.layout import RunLayout
    from slime_stoa.protocol.pulse.history import NotPublished, read_pointer
    from slime_stoa.protocol.pulse.manifests import ManifestError
    from slime_stoa.protocol.store import NotFound, StoreError
    from slime_stoa.protocol.store.capped import read_capped_bytes

    async def read() -> tuple[bytes, int | None]:
        async with config.open_store() as store:
            key = RunLayout(config.run).heartbeat(config.worker_id)
            data = await read_capped_bytes(store, key, MAX_HEARTBEAT_BYTES)
            try:
                head: int | None = (await read_pointer(store, config.run)).version
            except (NotPublished, ManifestError):
                head = None
            return data, head

    try:
        data, head = asyncio.run(asyncio.wait_for(read(), timeout_s))
        beat = Heartbeat.from_bytes(data, worker=config.worker_id)
    except NotFound:
        return "none yet in the bucket", False
    except (StoreError, ValueError, OSError, TimeoutError) as exc:
        return f"unavailable ({str(exc) or 'timed out'})", None
    now = time.time()
    return heartbeat_line(beat, now, head), shown_status(beat, now) not in NOT_RUNNING


def heartbeat_line(beat: Any, now: float, head: int | None) -> str:
    """One heartbeat as of `now`, with the run's current version `head` (None: not known), read
    the way `stoa fleet` reads it: a worker that stopped, or whose heartbeat stopped coming, shows
    as such, with the version it held then and no lag."""
    from slime_stoa.protocol.heartbeat import NOT_RUNNING, ago, shown_lag, shown_status

    status = shown_status(beat, now)
    held = "no weights" if beat.version is None else f"v{beat.version}"
    run_at = "" if head is None else f"; the run is at v{head}"
    if status == "silent":
        text = f"{ago(now - beat.updated_at)}: silent (no heartbeat since; it said {beat.status!r}), held {held}{run_at}"
    elif status in NOT_RUNNING:
        text = f"{ago(now - beat.updated_at)}: {status}, held {held}{run_at}"
    else:
        lag = shown_lag(beat, now, head)
        text = f"{ago(now - beat.updated_at)}: {status}, {held}" + ("" if lag is None else f", lag {lag}")
        # The rate over the worker's last ~30 s, and the tokens so far: both move during a cohort.
        # Before the first token there is no rate (0 would read as a stall).
        if beat.tokens_per_s > 0 or beat.tokens_generated > 0:
            rate = f"{beat.tokens_per_s:.0f} tok/s"
            if beat.tokens_generated > 0:
                rate += f" ({beat.tokens_generated:,} tokens so far)"
        else:
            rate = "tok/s not measured yet (no token generated)"
        text += f"{run_at}, {rate}"
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
    if not log.exists() and sys.platform != "darwin":
        return error(
            f"no log at {log}: the launchd agent (`macd install` / `macd start`) is macOS-only; "
            f"on this system run `macd run` in the foreground (it logs to the terminal), or run it "
            f"from a systemd unit and read its log with `journalctl --user -u <unit>`"
        )
    if not log.exists():
        return error(
            f"no log at {log} yet: the agent writes it once started (`macd start`); "
            f"`macd run` logs to the terminal"
        )
    for line in service.tail_lines(log, args.lines):
        print(line)
    if args.follow:
        sys.stdout.flush()
        with contextlib.suppress(KeyboardInterrupt):
            service.follow(log)
    return 0
