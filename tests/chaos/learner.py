"""The chaos suite's learner: the quickstart's real learner path (`run_quickstart`: the consumer,
the CPU learner, the PULSE publisher, its state saved after every batch and every version), run
as its own process with its workers left to the test, which starts, kills and restarts them.

    python -m tests.chaos.learner CONFIG.json

CONFIG holds `QuickstartConfig` fields (`out`, `store`, ...). Every batch the learner trained on
and published is appended to `<out>/events.jsonl` as one JSON line (the keys of its groups,
their weight versions, lags and uses), written before the next step starts, so a SIGKILL loses
at most the step in hand. SIGTERM or SIGINT: a clean stop at the next safe point (exit 130), as
`stoa quickstart` does. The process also stops when its parent (the test) is gone.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

from slime_stoa.protocol.pulse.publisher import Publisher
from slime_stoa.quickstart import run as quickstart
from slime_stoa.quickstart.config import QuickstartConfig
from slime_stoa.quickstart.interrupt import Interrupt, Interrupted
from tests.chaos.harness import EVENTS, INTERRUPTED


class NoWorkers:
    """Stands in for the quickstart's `WorkerProcesses`: the test runs the workers itself."""

    def __init__(self, cfg: QuickstartConfig, url: str, *, run_key: str | None = None) -> None:
        self.cfg = cfg

    def write_configs(self, check: Any = None) -> None:
        pass

    def start(self, i: int) -> None:
        pass

    def kill(self, i: int) -> None:
        pass

    def alive(self) -> int:
        return self.cfg.workers

    def stop(self, timeout: float = 0.0) -> None:
        pass


class EventLog:
    """The quickstart's report, as JSON lines: what the test reconciles against the bucket."""

    def __init__(self, path: Path) -> None:
        self.file = open(path, "a", buffering=1)  # noqa: SIM115 - open for the life of the process

    def emit(self, **event: Any) -> None:
        self.file.write(json.dumps({"pid": os.getpid(), "t": time.time(), **event}) + "\n")
        self.file.flush()

    def note(self, text: str) -> None:
        self.emit(event="note", text=text)

    def version(self, version: int, metrics: dict, batch: Any, *rest: Any, **kw: Any) -> None:
        groups = [
            {"key": g.key, "weight_version": g.weight_version, "lag": g.version_lag, "use": g.use,
             "digest": g.group.state_digest}
            for g in batch.groups
        ]  # fmt: skip
        self.emit(event="version", version=version, trainer_version=batch.trainer_version, groups=groups)

    def __getattr__(self, name: str) -> Any:  # any other report call the quickstart makes
        return lambda *args, **kw: None


def record_publishes(events: EventLog) -> None:
    """Log every version the learner's publisher commits, with its state digest (the real
    `Publisher.publish`, wrapped: a record's claimed digest is checked against these)."""
    publish = Publisher.publish

    async def publish_and_log(self: Publisher, state: Any) -> Any:
        result = await publish(self, state)
        events.emit(event="published", version=self.version, digest=self.state_digest)
        return result

    Publisher.publish = publish_and_log  # type: ignore[method-assign]


def watch_parent(interrupt: Interrupt) -> None:
    """Stop (cleanly, then for good) once the process that started us is gone."""
    parent = os.getppid()
    while os.getppid() == parent:
        time.sleep(0.5)
    interrupt.request()
    time.sleep(30)
    os._exit(1)


def main(config_path: str) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    doc = json.loads(Path(config_path).read_text())
    cfg = QuickstartConfig(**{**doc, "out": Path(doc["out"])})
    cfg.out.mkdir(parents=True, exist_ok=True)
    quickstart.WorkerProcesses = NoWorkers  # type: ignore[misc,assignment]
    events = EventLog(cfg.out / EVENTS)
    record_publishes(events)
    events.emit(event="start")
    interrupt = Interrupt()
    threading.Thread(target=watch_parent, args=(interrupt,), daemon=True).start()
    try:
        with interrupt.installed():
            summary = asyncio.run(quickstart.run_quickstart(cfg, events, interrupt))
            interrupt.check()
    except (Interrupted, KeyboardInterrupt):
        events.emit(event="stopped")
        return INTERRUPTED
    events.emit(event="done", summary={k: v for k, v in summary.items() if isinstance(v, (int, float, str))})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
