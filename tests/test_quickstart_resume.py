"""How a quickstart starts its learner (`quickstart.resume.resume_mode`, pure: one test per mode)
and what the learner file says it holds (`quickstart.learner_file.saved_weights`, on real files)."""

from __future__ import annotations

import io
from pathlib import Path

import torch

from slime_stoa.quickstart.learner_file import LEARNER_FORMAT, saved_weights
from slime_stoa.quickstart.resume import ResumeMode, WeightsAt, resume_mode

HEAD = WeightsAt("r", 7, "sha256:abc")


def test_a_new_run_starts_from_the_prepared_learner_whatever_is_on_disk() -> None:
    assert resume_mode(new_run=True, restart_from=None, published=HEAD, saved=None) is ResumeMode.NEW
    assert resume_mode(new_run=True, restart_from=None, published=HEAD, saved=HEAD) is ResumeMode.NEW


def test_restart_from_wins_over_a_current_learner_file() -> None:
    assert resume_mode(new_run=False, restart_from=3, published=HEAD, saved=HEAD) is ResumeMode.RESTART
    assert resume_mode(new_run=False, restart_from=0, published=HEAD, saved=None) is ResumeMode.RESTART


def test_a_learner_file_of_the_published_weights_resumes_the_learner_exactly() -> None:
    assert resume_mode(new_run=False, restart_from=None, published=HEAD, saved=HEAD) is ResumeMode.LEARNER_FILE


def test_anything_else_rebuilds_the_published_weights() -> None:
    for saved in (
        None,  # no (readable) learner file
        WeightsAt("r", 6, "sha256:abc"),  # an older version
        WeightsAt("r", 7, "sha256:other"),  # the same number, other weights (a restarted lineage)
        WeightsAt("other-run", 7, "sha256:abc"),
    ):
        assert resume_mode(new_run=False, restart_from=None, published=HEAD, saved=saved) is ResumeMode.REBUILD


def _save(path: Path, doc: object) -> None:
    buffer = io.BytesIO()
    torch.save(doc, buffer)
    path.write_bytes(buffer.getvalue())


def test_saved_weights_reads_the_head_of_a_learner_file(tmp_path: Path) -> None:
    path = tmp_path / "learner.pt"
    assert saved_weights(path) is None  # none yet
    _save(path, {"format": LEARNER_FORMAT, "run": "r", "version": 7, "state_digest": "sha256:abc",
                 "model": {"w": torch.ones(4)}, "optimizer": {}})
    assert saved_weights(path) == HEAD


def test_saved_weights_ignores_damaged_and_foreign_files(tmp_path: Path) -> None:
    path = tmp_path / "learner.pt"
    path.write_bytes(b"not a torch file")
    assert saved_weights(path) is None
    _save(path, {"format": "something/else", "run": "r", "version": 7, "state_digest": "sha256:abc"})
    assert saved_weights(path) is None
    _save(path, {"format": LEARNER_FORMAT, "run": "r", "state_digest": "sha256:abc"})  # no version
    assert saved_weights(path) is None
