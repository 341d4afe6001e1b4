"""`scripts/readme_figures.py`: a quickstart's output made into the README's block (the run itself
is the script's; here its text handling, on a run's real shape)."""

from __future__ import annotations

from pathlib import Path

from tests.scripts_loader import load_script


def run_output(scratch: Path, versions: int) -> str:
    rows = [f"{f'v{v}':>7}  0.{v:03d}   0.00 {16 * v:>6}" for v in range(1, versions + 1)]
    return "\n".join([
        f"stoa new run 'quickstart' in bucket file://{scratch}/bucket",
        f"stoa built a tiny qwen2 model with a tokenizer trained on the task's text: {scratch}/model",
        "stoa warm start: step 60/600 (10%), 16.7 steps/s, ETA 32s, loss 1.240",
        "stoa warm start: step 600/600 (100%), 14.7 steps/s, ETA 0s, loss 0.822",
        "version reward search groups",
        *rows,
        "stoa target reward 0.9 reached",
    ]) + "\n"


def test_the_block_is_what_a_terminal_shows_with_the_readme_paths_and_the_table_elided(tmp_path: Path) -> None:
    rf = load_script("readme_figures")
    scratch = tmp_path / "stoa-quickstart"
    summary = {"reward_first": 0.234, "reward_last": 0.931, "first_version": 0, "window": 5, "versions_run": 50,
               "eval_pass1_first": 0.262, "eval_pass1_last": None, "eval_prompts": 64, "seconds_run": 128.4,
               "groups_used_run": 800, "groups_lost": 0, "digests_checked": 12, "digest_mismatches": 0}
    log = "2026-12-02 04:39:26,472 WARNING slime_stoa.trainer: rejected a duplicate\n"
    text = rf.block(run_output(scratch, 50), log, summary, scratch, date="2026-12-02 04:38 UTC", cores=2,
                    load_before="4.87 7.09 5.29", load_after="8.28 7.20 5.54", exit_code=0)
    lines = text.splitlines()
    assert lines[0] == ("# stoa quickstart, 2026-12-02 04:38 UTC, 2 cores, load average (1/5/15 min) "
                        "4.87 7.09 5.29 before, 8.28 7.20 5.54 after; exit 0")
    assert "stoa new run 'quickstart' in bucket file:///.../stoa-quickstart/bucket" in lines
    assert lines[3].endswith("text: stoa-quickstart/model") and str(tmp_path) not in text
    assert not any("warm start: step" in line for line in lines)  # a bar on a terminal, gone when done
    shown = [line.split()[0] for line in lines if rf.VERSION_ROW.match(line)]
    assert shown == ["v1", "v2", "v3", "v26", "v49", "v50"] and lines.count("   ...") == 2
    assert "  reward 0.234 (v0) -> 0.931 (last 5 versions) in 50 versions" in lines
    assert "  eval pass@1 0.262 -> n/a (64 held-out prompts)" in lines
    assert "  run time 128 s" in lines and "  log lines (stderr): 1 (1 WARNING)" in lines


def test_a_short_table_is_kept_whole_and_an_empty_log_is_zero() -> None:
    rf = load_script("readme_figures")
    lines = ["header", *(f"     v{v}  0.5" for v in range(1, 7)), "end"]
    assert rf.elide_versions(lines) == lines
    assert rf.log_summary("\n\n") == "0"
