"""The quickstart's warm start: saved as it goes, resumed after a stop, its progress shown."""

from __future__ import annotations

import io
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from rich.console import Console

from slime_stoa.quickstart.interrupt import Interrupted
from slime_stoa.quickstart.meter import StepMeter
from slime_stoa.quickstart.warmstate import WARM_FILE, run_warm_steps
from tests.conftest import wait_until

torch = pytest.importorskip("torch")

KEY = {"run": "r", "task": "synthetic", "seed": 0}


def learner() -> SimpleNamespace:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    return SimpleNamespace(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2))


def stepper(lrn: SimpleNamespace, rng: np.random.Generator):
    def step(i: int) -> float:
        x = torch.from_numpy(rng.normal(size=(8, 4)).astype(np.float32))
        lrn.optimizer.zero_grad()
        loss = (lrn.model(x) - float(i % 3)).pow(2).mean()
        loss.backward()
        lrn.optimizer.step()
        return float(loss.detach())

    return step


def test_a_stopped_warm_start_resumes_with_the_steps_it_would_have_taken(tmp_path: Path) -> None:
    path = tmp_path / WARM_FILE
    straight, rng = learner(), np.random.default_rng(5)
    whole = run_warm_steps(straight, steps=23, step=stepper(straight, rng), rng=rng, path=None, key=KEY)

    first, rng = learner(), np.random.default_rng(5)
    calls = iter(range(100))

    def check() -> None:  # a stop signal before step 17
        if next(calls) == 17:
            raise Interrupted("SIGINT received")

    with pytest.raises(Interrupted):
        run_warm_steps(first, steps=23, step=stepper(first, rng), rng=rng, path=path, key=KEY, check=check, save_every=5)
    again, rng = learner(), np.random.default_rng(5)
    resumed: list[int] = []
    state = run_warm_steps(again, steps=23, step=stepper(again, rng), rng=rng, path=path, key=KEY,
                           on_resume=lambda s: resumed.append(s.step), save_every=5)
    assert resumed == [17] and state.step == 23 and state.losses == pytest.approx(whole.losses)
    for a, b in zip(straight.model.parameters(), again.model.parameters(), strict=True):
        assert torch.equal(a, b)

    other, rng = learner(), np.random.default_rng(5)  # another warm start's state is not taken up
    fresh = run_warm_steps(other, steps=3, step=stepper(other, rng), rng=rng, path=path, key={**KEY, "seed": 1},
                           on_resume=lambda s: resumed.append(s.step))
    assert fresh.resumed_from == 0 and resumed == [17]


def test_the_meter_off_a_terminal_prints_a_line_per_tenth() -> None:
    out = io.StringIO()
    now = [0.0]
    with StepMeter(Console(file=out, width=200), "warm start", 100, clock=lambda: now[0]) as meter:
        for done in range(1, 101):
            now[0] += 0.1
            meter.update(done, loss=1.0)
    lines = out.getvalue().splitlines()
    assert len(lines) == 10 and lines[0].startswith("stoa warm start: step 10/100 (10%), 10.0 steps/s, ETA 9s")
    assert lines[-1].startswith("stoa warm start: step 100/100 (100%)") and "loss 1.000" in lines[-1]
    slow, out = [0.0], io.StringIO()
    with StepMeter(Console(file=out, width=200), "warm start", 10_000, clock=lambda: slow[0]) as meter:
        for done in range(1, 50):
            slow[0] += 1.0  # a step a second: a line every 30 s
            meter.update(done)
    assert len(out.getvalue().splitlines()) == 1


def test_a_rerun_after_a_stopped_warm_start_says_where_it_resumed(tmp_path: Path) -> None:
    out = tmp_path / "qs"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "STOA_"))}
    env["HOME"] = str(tmp_path / "home")
    cmd = [sys.executable, "-m", "slime_stoa.cli", "quickstart", "--out", str(out), "--warmup-steps", "1000000"]

    def started() -> subprocess.Popen[str]:
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)

    first = started()
    try:  # the first save is at step 50: a few seconds of the tiny model's warm start
        wait_until(lambda: (out / WARM_FILE).exists() or first.poll() is not None, timeout=180, interval=0.1,
                   message="the warm start's first save")
        first.send_signal(signal.SIGINT)
        assert first.wait(timeout=60) == 130
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    saved = torch.load(out / WARM_FILE, weights_only=True)["step"]
    assert saved >= 50
    second = started()
    try:
        assert second.stdout is not None
        seen = []
        for line in second.stdout:
            seen.append(line)
            if "resumed the warm start" in line:
                break
        text = "".join(seen)
        found = re.search(r"resumed the warm start at step (\d+) of 1000000", text)
        assert found and int(found[1]) == saved, text
        second.send_signal(signal.SIGINT)
        assert second.wait(timeout=60) == 130
    finally:
        if second.poll() is None:
            second.kill()
            second.wait()
    assert "Traceback" not in text
    assert not (out / "bucket" / "runs").exists() or not any((out / "bucket" / "runs").iterdir())
