"""`macd run`: the daemon in the foreground (what launchd supervises)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import threading

from slime_stoa.protocol.store import StoreConfigError, StoreError, open_store


def add_parser(sub: argparse._SubParsersAction, add_config_option) -> None:
    run = sub.add_parser(
        "run",
        help="run the worker in the foreground (SIGTERM or Ctrl-C: stop, flush uploads, exit 0)",
        description=(
            "Follow the run's weights, generate groups of rollouts with MLX, score them and upload "
            "them. Every finished group goes to the on-disk spool first, so a crash loses nothing."
        ),
    )
    add_config_option(run)
    run.add_argument("--max-cohorts", type=int, default=None, help="stop after this many cohorts")
    run.add_argument("--seed", type=int, default=None, help="prompt choice and sampling seed")
    run.set_defaults(handler=handle)


STOP_GRACE_S = 50.0  # after a stop signal, exit within this long whatever is still running


def _force_exit() -> None:
    logging.getLogger("macd").warning("still running %.0f s after the stop signal: exiting now "
                                      "(the spool is crash-safe; it drains on the next start)", STOP_GRACE_S)
    logging.shutdown()
    os._exit(0)


async def run_daemon(args: argparse.Namespace, config) -> int:
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
    options = WorkerOptions(max_cohorts=args.max_cohorts, seed=args.seed, flush_timeout_s=30.0)
    async with open_store(config.store, credentials=config.read_credentials()) as store:
        return await Worker(config, store, options).run(stop)


def handle(args: argparse.Namespace) -> int:
    from . import config as cfg
    from .cli import config_path

    try:
        config = cfg.load_config(config_path(args))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    logging.basicConfig(
        level=getattr(logging, config.log_level, logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return asyncio.run(run_daemon(args, config))
    except StoreConfigError as exc:
        logging.getLogger("macd").error("%s", exc)
        return 2  # launchd restarts a failed daemon; a config error needs a person: say so
    except (StoreError, ValueError) as exc:
        logging.getLogger("macd").error("%s", exc)
        return 1
