"""`stoa quickstart` resuming on an old genuine consumer state put back (`StateRollback`).

A worker token can put back an older save of the trainer's own consumer state (signed by the run
key, so it verifies, but below the newest signed head). The rerun quickstart

- with its copy of the state (`<out>/kept`, the default) puts the copy back and resumes: exit 0;
- without it (the copy deleted) pauses, its console saying so in one line that names
  `consumer.json` and the quickstart's own repair (the consumer's own lines, at tries 1, 2, 4,
  ..., in `<out>/quickstart.log`), and resumes by itself once the newest state is back: exit 0;
- without it, paused past its time limit (`--minutes`), stops with one `error:` line naming the
  repairs: exit 1; and the `--restart-from` command in that line, run as printed, writes its
  checkpoint's state over the spoiled one and runs: exit 0.

Never a traceback. Real `macd run` workers, real learner, a local bucket; bounded by versions.
"""

from __future__ import annotations

import dataclasses
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mlx_lm")
pytest.importorskip("torch")

from slime_stoa.protocol.signing import read_key_file
from slime_stoa.quickstart.logfile import LOG_FILE
from slime_stoa.trainer.consumer.persistence import parse_state, state_bytes
from tests.conftest import wait_until
from tests.test_quickstart import Quickstart

RUN = "quickstart"
#: The shortest run that saves the consumer state more than once: one worker, one version.
SHORT = ("--workers", "1", "--max-versions", "1", "--no-eval", "--no-warm-start", "--minutes", "5")


def bucket_state(out: Path) -> Path:
    return out / "bucket" / "runs" / RUN / "trainer" / "consumer.json"


def kept_state(out: Path) -> Path:
    return out / "kept" / "runs" / RUN / "trainer" / "consumer.json"


def put_back_an_old_save(out: Path) -> tuple[bytes, int]:
    """Replace the bucket's state with an older save of it, signed by the run key (a genuine
    state below the newest head); returns (the newest state's bytes, its save number)."""
    newest = bucket_state(out).read_bytes()
    key = read_key_file(out / "run.key")
    state = parse_state(newest, RUN, [key.public])
    assert state.seq >= 2, state.seq  # a head above save 1 exists
    bucket_state(out).write_bytes(state_bytes(dataclasses.replace(state, seq=1), key))
    return newest, state.seq


def restart_as_printed(error: str) -> str:
    """Run the `stoa quickstart ... --restart-from N` command of a repair line as printed; its
    output, asserted to exit 0 without a traceback."""
    found = re.search(r"restart from its newest checkpoint: (stoa quickstart .*?); or ", error)
    assert found, error
    argv = shlex.split(found.group(1))
    done = subprocess.run(
        [sys.executable, "-m", "slime_stoa.cli", *argv[1:]], stdin=subprocess.DEVNULL, capture_output=True,
        text=True, timeout=600,
    )
    text = done.stdout + done.stderr
    assert done.returncode == 0, text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    return text


def finished(qs: Quickstart) -> str:
    """The output of a quickstart that ends by itself, asserted to exit 0 without a traceback."""
    code = qs.proc.wait(timeout=600)
    text = qs.finish()
    assert code == 0, text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    return text


@pytest.mark.slow  # five quickstart runs, ~5 minutes on two cores: python -m pytest --slow tests/test_quickstart_rollback.py
def test_a_rerun_on_an_old_state_put_back_resumes_restarts_or_stops_with_the_repair(tmp_path: Path) -> None:
    out = tmp_path / "qs"
    finished(Quickstart(out, *SHORT))

    # Without the copy, past the time limit: one line with the repairs; its restart runs as printed.
    _newest, seq = put_back_an_old_save(out)
    kept_state(out).unlink()
    qs = Quickstart(out, *SHORT[:-1], "0.05")  # --minutes 0.05: three seconds for the RL part
    code = qs.proc.wait(timeout=600)
    text = qs.finish()
    assert code == 1 and "Traceback" not in text, text[-3000:]
    (error,) = [line for line in text.splitlines() if line.startswith("error:")]
    assert error.startswith("error: the time limit (--minutes 0.05) ran out while paused"), error
    assert "consumer.json" in error and str(kept_state(out)) in error, error
    assert not any(word in error for word in ("keep_dir", "slime", "heads under")), error
    assert "stoa paused:" in text  # the note when the pause started
    assert parse_state(bucket_state(out).read_bytes(), RUN, [read_key_file(out / "run.key").public]).seq == 1
    text = restart_as_printed(error)
    assert "is an older save put back (older than its newest signed head): the checkpoint's state is saved over it" in text
    restarted = parse_state(bucket_state(out).read_bytes(), RUN, [read_key_file(out / "run.key").public])
    assert restarted.seq > seq  # above the head: no pause on the next run

    # Without the trainer's copy: paused (one note; the consumer's lines in the log file) until the state is back.
    newest, seq = put_back_an_old_save(out)
    kept_state(out).unlink()
    log_file = out / LOG_FILE
    log_file.unlink(missing_ok=True)
    qs = Quickstart(out, *SHORT)
    try:
        wait_until(lambda: log_file.exists() and "stoa: paused (try 2," in log_file.read_text(), timeout=300,
                   interval=0.05, message=lambda: f"the second paused try in {log_file}\n{qs.text()}")
    except BaseException:
        qs.finish()
        raise
    bucket_state(out).write_bytes(newest)  # the operator's repair
    text = finished(qs)
    (note,) = [line for line in text.splitlines() if "paused" in line]  # the console: the quickstart's one note
    assert note.startswith("stoa paused:") and "consumer.json" in note and "Repair:" in note, note
    logged = log_file.read_text()
    paused = [line for line in logged.splitlines() if "stoa: paused" in line]
    assert paused and all("consumer.json" in line and "older than its newest signed head" in line for line in paused)
    assert all("Repair:" in line for line in paused)
    tries = [int(m.group(1)) for line in paused if (m := re.search(r"\(try (\d+),", line))]
    assert tries == [2**i for i in range(len(tries))]  # at tries 1, 2, 4, ...: not a line per try
    assert "resumed after" in logged
    after_repair = parse_state(bucket_state(out).read_bytes(), RUN, [read_key_file(out / "run.key").public])
    assert after_repair.seq > seq  # it resumed from the repaired state and saved on

    # With the copy (kept again by that run): put back by the trainer itself, no pause at all.
    _newest, seq = put_back_an_old_save(out)
    text = finished(Quickstart(out, *SHORT))
    assert "paused" not in text  # no note of the quickstart's (the consumer's lines would be in the log file)
    assert f"put the trainer's own copy (save {seq}) back" in text
    resumed = parse_state(bucket_state(out).read_bytes(), RUN, [read_key_file(out / "run.key").public])
    assert resumed.seq > seq
