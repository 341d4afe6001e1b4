"""`macd run`: the daemon in the foreground (what launchd supervises)."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable

from slime_stoa.protocol.cli_fields import Flag, add_field_options, field_values, setting
from slime_stoa.protocol.store import StoreConfigError, StoreError

from . import config as cfg
from .cmdline import add_config_option, config_path


def _pid(text: str) -> int:
    pid = int(text)
    if pid < 1:
        raise argparse.ArgumentTypeError(f"not a process id: {text}")
    return pid


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunInputs:
    """The options of `macd run` that are not config fields: how this one run of the daemon
    starts and stops (the config file holds what every run shares)."""

    max_cohorts: int | None = setting("stop after this many cohorts", None, run=True)
    seed: int | None = setting("prompt choice and sampling seed", None, run=True)
    parent_pid: int | None = setting(
        "stop cleanly (flush uploads, final heartbeat) as soon as process PID is gone, e.g. the "
        "program that started this worker (checked every second)",
        None,
        run=Flag(type=_pid, metavar="PID"),
    )
    lock_wait: float = setting(
        "if another macd still holds this worker's spool, wait up to this long for it to stop; "
        "0 fails at once, naming its pid",
        0.0,
        run=Flag(metavar="SECONDS"),
    )


def add_parser(sub: argparse._SubParsersAction) -> None:
    """`macd run`: `--config`, the `RunInputs` (with their defaults), then the `DaemonConfig`
    fields with `run=` help (default None: the config file's value)."""
    run = sub.add_parser(
        "run",
        help="run the worker in the foreground (SIGTERM or Ctrl-C: stop, flush uploads, exit 0)",
        description=(
            "Follow the run's weights, generate groups of rollouts with MLX, score them and upload "
            "them. Every finished group goes to the on-disk spool first, so a crash loses nothing."
        ),
    )
    add_config_option(run)
    add_field_options(run, RunInputs, "run")
    add_field_options(run, cfg.DaemonConfig, "run", with_defaults=False)
    run.set_defaults(handler=handle)


STOP_GRACE_S = 50.0  # after a stop signal, exit within this long whatever is still running
PARENT_POLL_S = 1.0  # how often --parent-pid is checked


def _force_exit() -> None:
    logging.getLogger("macd").warning("still running %.0f s after the stop signal: exiting now "
                                      "(the spool is crash-safe; it drains on the next start)", STOP_GRACE_S)
    logging.shutdown()
    os._exit(0)


def parent_alive(pid: int, direct: bool) -> bool:
    """Whether process `pid` still runs. `direct`: it is our parent, so its death shows at once
    as a new parent pid (even while it is an unreaped zombie, which `kill(pid, 0)` still finds)."""
    if direct:
        return os.getppid() == pid
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # it exists, under another user
    return True


async def watch_parent(
    pid: int, stop: asyncio.Event, on_gone: Callable[[], None], interval: float = PARENT_POLL_S
) -> None:
    """Call `on_gone()` once process `pid` is gone (checked every `interval` s) or return at `stop`."""
    direct = os.getppid() == pid
    while not stop.is_set():
        if not parent_alive(pid, direct):
            logging.getLogger("macd").warning("parent process %d is gone: stopping", pid)
            on_gone()
            return
        try:
            async with asyncio.timeout(interval):
                await stop.wait()
        except TimeoutError:
            pass


async def run_daemon(inputs: RunInputs, config) -> int:
    from .worker import Worker, WorkerOptions

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signal() -> None:
        if not stop.is_set():
            stop.set()
            # Bounded stop, as launchd expects: a watchdog ends the process if anything hangs.
            watchdog = threading.Timer(STOP_GRACE_S, _force_exit)
            watchdog.daemon = True
            watchdog.start()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    watcher = None
    if inputs.parent_pid is not None:
        watcher = asyncio.create_task(watch_parent(inputs.parent_pid, stop, on_signal))
    options = WorkerOptions(
        max_cohorts=inputs.max_cohorts, seed=inputs.seed, flush_timeout_s=30.0, lock_wait_s=max(inputs.lock_wait, 0.0)
    )
    tracker = None
    try:
        if config.wandb_project is not None:
            from .tracking import HeartbeatLog

            tracker = await asyncio.to_thread(HeartbeatLog.open, config, config.wandb_project)
        async with config.open_store() as store:
            worker = Worker(config, store, options)
            worker.on_heartbeat = None if tracker is None else tracker.log
            return await worker.run(stop)
    finally:
        if watcher is not None:
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)
        if tracker is not None:
            await asyncio.to_thread(tracker.close)


def handle(args: argparse.Namespace) -> int:
    from .spool import SpoolError
    from .tracking import TrackingUnavailable, import_wandb

    try:
        config = cfg.load_config(config_path(args))
        given = {k: v for k, v in field_values(args, cfg.DaemonConfig, "run").items() if v is not None}
        if given:
            config = dataclasses.replace(config, **given)
        if config.wandb_project is not None:
            import_wandb()  # a missing package fails here, at once
    except (ValueError, TrackingUnavailable) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    logging.basicConfig(
        level=getattr(logging, config.log_level, logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    from .cpu_blas import use_fast_blas

    use_fast_blas()  # Linux: before anything loads MLX, whose CPU matmuls bind to the first BLAS loaded
    from .fatal import Fatal

    try:
        return asyncio.run(run_daemon(RunInputs(**field_values(args, RunInputs, "run")), config))
    except (StoreConfigError, TrackingUnavailable, Fatal) as exc:
        logging.getLogger("macd").error("%s", exc)
        return 2  # launchd restarts a failed daemon; a config error or a permanent one needs a person: say so
    except (StoreError, SpoolError, ValueError) as exc:
        logging.getLogger("macd").error("%s", exc)
        return 1
