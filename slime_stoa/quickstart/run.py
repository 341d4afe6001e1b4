"""`stoa quickstart`: the whole loop on one machine, for real.

A local bucket, a small model, N `macd run` worker processes (MLX) and a learner that is the
trainer side without Megatron: the same consumer as `generate_rollout` (staleness and reuse rules
included), the same DPPO loss, the same PULSE publisher. The reward of the synthetic task climbs
while every version reaches the workers as a patch.

Stopping and resuming: Ctrl-C (or SIGTERM) is honoured within a few seconds in every phase (see
`interrupt`) and stops the workers and the learner cleanly. Each worker runs with
`--parent-pid`, so even a SIGKILLed quickstart leaves no `macd run` behind. The consumer's state
goes to the bucket after every batch is taken, before the step trains on it, and the learner's
float32 weights and optimizer state to `<out>/learner.pt` after every publish (both atomic), so a
rerun after any kind of stop resumes where the bucket says: no group is used, or counted, twice.
A checkpoint of each of the last few versions (`checkpoints`: learner and consumer state of then)
lets `--restart-from N` restart the run from an earlier version, as slime does. Store outages at
start-up (seeding, the publisher, the keys, the rebuild) pause it, as they pause training. A
stopped warm start resumes from its last saved step (`warmstate`). One quickstart at a time per
run folder (`lock`): a second one on the same --out is refused at start. A consumer state a
bucket writer spoiled, with no copy in `<out>/kept` to put back, pauses the rerun until it is
repaired, within the RL part's time limit, naming the quickstart's own repairs (`spoiled`).

The phases, in order (`_run_locked`; each a `phase_*` function but `train`, sharing a `Session`):
check the bucket, prepare the model, warm start (a new run), seed the run, resume (the learner
as `resume.resume_mode` decides: new, --restart-from, its own file, or the published weights),
eval the first version, start the workers, train, report.

Signed by default, as a real fleet: a new run gets a run key (`<out>/run.key`, 0600) that signs
its manifest, weights and worker registry, and every worker a worker key
(`<out>/workers/worker-<i>/worker.key`, 0600, installed with `macd join --worker-key`) that signs
its records; the learner's consumer expects that run key and admits only records signed by the
registered workers. A rerun reuses the keys; a run first made unsigned stays unsigned.

From seeding (its publisher opened: resumed from the bucket's pointer, or the first version
published) to the end, the quickstart re-signs its pointers every `freshness.REFRESH_S` on its
event loop (`Seeded.keeper`, `pulse.keepalive`), through the train phase, its waits for batches
and the final report, so a worker joining for the first time takes its pointer (`pulse.freshness`).
Each publish holds the keeper's lock: no refresh interleaves with a commit.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from slime_stoa.protocol.heartbeat import Heartbeat, HeartbeatTrust, read_judged_heartbeat
from slime_stoa.protocol.hf.folders import save_hf_folder
from slime_stoa.protocol.kept import TrainerCopies
from slime_stoa.protocol.layout import RunLayout
from slime_stoa.protocol.pulse.chain_keeper import kept_publisher_store
from slime_stoa.protocol.pulse.freshness import REFRESH_S
from slime_stoa.protocol.pulse.history import HistoryError
from slime_stoa.protocol.pulse.keepalive import PointerKeeper
from slime_stoa.protocol.pulse.kept_chain import LIVE_CHAIN_FOLDER
from slime_stoa.protocol.pulse.publisher import Publisher, PublisherConfig, UntrustedState
from slime_stoa.protocol.pulse.rebuild import rebuild
from slime_stoa.protocol.pulse.retry import is_publish_outage as is_startup_outage
from slime_stoa.protocol.pulse.retry import publish_with_retries
from slime_stoa.protocol.registry import Registry, add_worker, read_registry, update_registry
from slime_stoa.protocol.run_manifest import RunManifest, RunNotFound, read_run_manifest
from slime_stoa.protocol.signing import SigningKey, read_key_file, write_key_file
from slime_stoa.protocol.store import NotFound, Store, StoreError, open_store
from slime_stoa.protocol.store.retry import through_outages
from slime_stoa.protocol.worker_keys import WorkerKeyFile, read_worker_key_file, write_worker_key_file
from slime_stoa.tasks import Synthetic, generate_items, warmup_pairs
from slime_stoa.tasks.prompting import prompt_tokens
from slime_stoa.tasks.search.task import Search
from slime_stoa.tasks.synthetic import baseline_reward
from slime_stoa.trainer.consumer import ConsumerConfig, ConsumerTimeout, RolloutConsumer
from slime_stoa.trainer.consumer.metrics import rejects_by_reason
from slime_stoa.trainer.consumer.persistence import state_key
from slime_stoa.trainer.learner import Learner, LearnerConfig, TrainSequence
from slime_stoa.trainer.loss import DPPOConfig
from slime_stoa.trainer.tracking import TrackedRun, TrackingUnavailable, fleet_metrics, import_wandb

from . import heldout
from . import search as qsearch
from .checkpoints import (
    CHECKPOINTS_DIR,
    Checkpoint,
    apply_checkpoint,
    check_restorable,
    checkpoint_versions,
    load_checkpoint,
    save_checkpoint,
)
from .config import QuickstartConfig, QuickstartError
from .interrupt import Interrupt
from .learner_file import LEARNER_FILE, log_stale, restore_learner, save_learner, saved_weights
from .lock import run_lock
from .logfile import pause_lines_to_file
from .meter import StepMeter, report_console
from .progress import PROGRESS_FILE, Progress, load_progress, save_progress
from .report import split_refusals
from .resume import ResumeMode, WeightsAt, resume_mode
from .seeding import seed_run, tiny_synthetic_model
from .spoiled import (
    SPOILED,
    fresh_run,
    manifest_repair_line,
    opened_consumer,
    repair_line,
    resumed_state,
    spoiled_cause,
)
from .warmstate import WARM_FILE, WarmState, run_warm_steps

log = logging.getLogger("stoa.quickstart")

LOCK_WAIT_S = 60  # a rerun's worker waits this long for its predecessor to release its spool
WANDB_ID_FILE = "wandb-run-id"  # in the run folder: the W&B run of --wandb, resumed by a rerun
RUN_KEY_FILE = "run.key"  # in the run folder: the run key (0600)
WORKER_KEY_FILE = "worker.key"  # in each worker's folder: its worker key (0600)


def worker_id(i: int) -> str:
    """The fixed worker id of the quickstart's worker `i` (the same on every rerun)."""
    return f"quickstart-{i}"


def worker_key_path(cfg: QuickstartConfig, i: int) -> Path:
    return (cfg.out / "workers" / f"worker-{i}" / WORKER_KEY_FILE).resolve()


async def run_key_for(store: Store, cfg: QuickstartConfig, *, new_run: bool) -> SigningKey | None:
    """The run key: made (0600) for a new run, read back for a signed one; None for a run that
    was made unsigned. QuickstartError if a signed run's key file is gone."""
    path = cfg.out / RUN_KEY_FILE
    if not new_run:
        try:
            manifest = await read_run_manifest(store, cfg.run)
        except RunNotFound:
            manifest = None
        if manifest is not None and manifest.run_key is None:
            return None
        if manifest is not None and not path.exists():
            raise QuickstartError(f"run {cfg.run!r} is signed, and its run key {path} is gone: start a new run (--run NAME)")
    if path.exists():
        return read_key_file(path)
    key = SigningKey.generate()
    write_key_file(path, key)
    return key


async def register_workers(store: Store, cfg: QuickstartConfig, run_key: SigningKey) -> Registry:
    """A worker key file per quickstart worker (kept across reruns) and each one registered."""
    keys: dict[str, SigningKey] = {}
    for i in range(cfg.workers):
        path = worker_key_path(cfg, i)
        if path.exists():
            entry = read_worker_key_file(path)
        else:
            entry = WorkerKeyFile(run=cfg.run, worker=worker_id(i), key=SigningKey.generate())
            write_worker_key_file(path, entry)
        if entry.run != cfg.run or entry.worker != worker_id(i):
            raise QuickstartError(f"{path} is the key of worker {entry.worker!r} of run {entry.run!r}: remove it")
        keys[entry.worker] = entry.key

    def add_missing(registry: Registry) -> Registry:
        for worker, key in keys.items():
            found = registry.workers.get(worker)
            if found is None:
                registry = add_worker(registry, worker=worker, name=worker, key=key.public, now=time.time())
            elif found.key != key.public or found.revoked:
                raise QuickstartError(f"worker {worker!r} is registered with another key or revoked: start a new run")
        return registry

    read = await read_registry(store, cfg.run, run_key.public)
    assert read is not None
    if add_missing(read.registry) is read.registry:
        return read.registry
    return await update_registry(store, cfg.run, run_key, add_missing)


class WorkerProcesses:
    """The quickstart's workers, driven only through the `macd` command line, as on a Mac:
    `macd join` writes each one's config, `macd run` runs it; each has its own config, data and
    log under `<out>/workers/worker-<i>/`."""

    def __init__(self, cfg: QuickstartConfig, url: str, *, run_key: str | None = None):
        self.cfg, self.url, self.run_key = cfg, url, run_key
        self.procs: dict[int, subprocess.Popen] = {}

    def _config_path(self, i: int) -> Path:
        return (self.cfg.out / "workers" / f"worker-{i}" / "macd.toml").resolve()

    def write_configs(self, check: Callable[[], None] = lambda: None) -> None:
        """`macd join --no-check` for each worker, with a fixed `--worker-id` so that a rerun
        resumes the same workers (and drains their spools), and in a signed run the run key pinned
        (`--run-key`: a worker then refuses an unsigned or re-keyed run) and the worker's key
        (`--worker-key`: it names the same id); RuntimeError with macd's message when a join
        fails. `check()` runs before each join (it raises to stop)."""
        for i in range(self.cfg.workers):
            check()
            folder = self._config_path(i).parent
            folder.mkdir(parents=True, exist_ok=True)
            cmd = [
                sys.executable, "-m", "macd", "join", self.url, "--run", self.cfg.run,
                "--name", f"worker-{i}", "--worker-id", worker_id(i), "--config", str(self._config_path(i)),
                "--data-dir", str(folder / "data"), "--batch", str(self.cfg.worker_batch), "--no-check",
            ]
            if self.run_key is not None:
                cmd += ["--run-key", self.run_key, "--worker-key", str(worker_key_path(self.cfg, i))]
            done = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True)
            if done.returncode != 0:
                check()  # a Ctrl-C at the terminal reaches the join too: that is a stop, not a failure
                raise RuntimeError(f"`macd join` for worker {i} failed: {done.stderr.strip() or done.stdout.strip()}")

    def start(self, i: int) -> None:
        """`macd run` for worker `i`, its output appended to its macd.log.

        Its own session (a Ctrl-C at the terminal reaches only the quickstart, which stops the
        workers in order), and `--parent-pid` so that it stops by itself when the quickstart
        is gone, however it went (SIGKILL included). `--lock-wait`: the worker of a rerun
        waits for its predecessor, still flushing its spool, to let go of it."""
        # the folder the workers share (their one copy of the search index) stays in --out
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "STOA_SHARED_DIR": str((self.cfg.out / "shared").resolve())}
        cmd = [
            sys.executable, "-m", "macd", "run", "--config", str(self._config_path(i)), "--seed", str(self.cfg.seed + i),
            "--parent-pid", str(os.getpid()), "--lock-wait", str(LOCK_WAIT_S),
        ]
        with open(self._config_path(i).parent / "macd.log", "ab") as log_file:  # the child keeps its own copy
            self.procs[i] = subprocess.Popen(
                cmd, stdout=log_file, stderr=subprocess.STDOUT, env=env, start_new_session=True,
            )

    def kill(self, i: int) -> None:
        self.procs[i].send_signal(signal.SIGKILL)
        self.procs[i].wait()

    def alive(self) -> int:
        return sum(p.poll() is None for p in self.procs.values())

    def stop(self, timeout: float = 60.0) -> None:
        """SIGTERM every worker (each flushes its spool and writes a final heartbeat) and wait;
        SIGKILL what is left after `timeout`, or at once on a second Ctrl-C (the spool is
        crash-safe: a killed worker's groups upload on its next start)."""
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.time() + timeout
        try:
            for p in self.procs.values():
                try:
                    p.wait(max(deadline - time.time(), 0.1))
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        except BaseException:
            for p in self.procs.values():
                if p.poll() is None:
                    p.kill()
            raise


def _train_sequences(group: Any) -> list[TrainSequence]:
    g = group.group
    return [
        TrainSequence(g.prompt_tokens, s.response_tokens, s.logprobs, float(r), mask=s.mask)  # tool tokens: 0
        for s, r in zip(g.samples, group.rewards, strict=True)
    ]


def warm_start(
    learner: Learner, model_dir: Path, cfg: QuickstartConfig, interrupt: Interrupt | None = None, *,
    path: Path | None = None, meter: StepMeter | None = None, on_resume: Callable[[WarmState], None] = lambda s: None,
) -> str:
    """Supervised steps on the answer FORMAT only (a random shown digit), not the rule.

    Each step draws fresh targets, so the model learns "answer with one of the shown digits and
    stop" rather than memorising one random digit per prompt. `interrupt` is checked before
    every step (`Interrupted`); `path`: where the warm start's state is saved and resumed from
    (`warmstate`); `meter` shows the steps."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    items = generate_items(2048, seed=cfg.seed + 1)
    task = Synthetic(items)
    prompts = [np.array(prompt_tokens(tokenizer, task, item)) for item in items]
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    rng = np.random.default_rng(cfg.seed)

    def step(i: int) -> float:
        picked = rng.choice(len(items), size=32, replace=False)
        targets = warmup_pairs([items[j] for j in picked], seed=cfg.seed * 1_000_003 + i)
        batch = [
            (prompts[j], np.array(tokenizer.encode(target, add_special_tokens=False) + [eos]))
            for j, (_, target) in zip(picked, targets, strict=True)
        ]
        return learner.supervised_step(batch)

    for group in learner.optimizer.param_groups:
        group["lr"] = cfg.warmup_lr
    try:
        state = run_warm_steps(
            learner, steps=cfg.warmup_steps, step=step, rng=rng, path=path, key=warm_key(cfg, model_dir),
            check=interrupt.check if interrupt is not None else lambda: None, meter=meter, on_resume=on_resume,
        )
    finally:
        for group in learner.optimizer.param_groups:
            group["lr"] = cfg.lr
    losses = state.losses
    start, end = (np.mean(losses[:10]), np.mean(losses[-10:])) if losses else (float("nan"),) * 2
    return f"supervised warm start on the answer format: {state.step} steps, loss {start:.2f} -> {end:.2f}"


def warm_key(cfg: QuickstartConfig, model_dir: Path) -> dict[str, Any]:
    """What makes two warm starts the same one (a saved state of another is not resumed)."""
    return {"run": cfg.run, "task": cfg.task, "seed": cfg.seed, "lr": cfg.warmup_lr, "model": str(model_dir.resolve())}


def warm_start_note(cfg: QuickstartConfig) -> str:
    """What the warm start does to the model, said before it starts."""
    return (
        f"supervised warm start on the answer format: {cfg.warmup_steps} steps "
        f"(teaches the format only; --no-warm-start keeps the model as it is)"
    )


TINY_BATCH_WAIT_S = 300.0  # the tiny model's workers fill a batch in seconds: longer is a stalled fleet


def batch_wait_s(cfg: QuickstartConfig, left_s: float) -> float:
    """How long the learner waits for a batch: the tiny model's fleet within `TINY_BATCH_WAIT_S`
    (a stall is reported as an error); a real model's until the RL part's time is up, since on a
    hard task most of its groups can be dropped for equal rewards and a batch takes minutes on a CPU."""
    return TINY_BATCH_WAIT_S if cfg.model is None else max(left_s, 1.0)


def real_task_objects(cfg: QuickstartConfig) -> dict[str, bytes] | None:
    """{split: task data} of a real task's --data files, as `stoa task prepare` makes them; None
    for the generated tasks."""
    from slime_stoa.tasks.objects import task_objects

    files = cfg.data_files()
    if not files:
        return None
    return task_objects(cfg.task, files, split=None, count=0, seed=0, limit=None)


async def check_same_run(store: Store, cfg: QuickstartConfig, model_dir: Path) -> None:
    """QuickstartError, naming --out, when the existing run is of another task, model or tiny
    model family than this command asks for: a rerun resumes a run, it never turns it into
    another one (a `--task search` in the folder of an earlier synthetic run would otherwise
    train the synthetic run on)."""
    try:
        manifest = await read_run_manifest(store, cfg.run)
    except RunNotFound:
        return
    asked = f"this command asks for --task {cfg.task}"
    fix = "pass another --out (or --run) for a new run, or rerun it as it was made"
    if manifest.task != cfg.task:
        raise QuickstartError(f"--out {cfg.out}: run {cfg.run!r} there is a {manifest.task} run, {asked}: {fix}")
    if cfg.model is not None and Path(manifest.model) != cfg.model and Path(manifest.model).resolve() != cfg.model.resolve():
        raise QuickstartError(f"--out {cfg.out}: run {cfg.run!r} there trains {manifest.model}, not --model {cfg.model}: {fix}")
    if cfg.model is None:
        made = tiny_model_family(model_dir)
        if Path(manifest.model).resolve() != model_dir.resolve() or (made is not None and made != cfg.family):
            was = f"the tiny {made} model" if made else manifest.model
            raise QuickstartError(f"--out {cfg.out}: run {cfg.run!r} there trains {was}, not a tiny {cfg.family} model: {fix}")


def tiny_model_family(model_dir: Path) -> str | None:
    """The family of the quickstart's tiny model in `model_dir` (its config's model_type), None
    when there is none to read."""
    import json

    try:
        value = json.loads((model_dir / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, str) else None


async def at_startup(op: Callable[[], Any], what: str, stop: Interrupt) -> Any:
    """`await op()` waiting out a store outage of any length (logged; a stop signal cuts the
    wait short): start-up pauses and resumes, as the training loop does. Each `op` is safe to
    try again (put-if-absent, compare-and-swap, reads)."""
    return await stop.race(through_outages(op, describe=what, is_retryable=is_startup_outage, logger=log))


async def rebuild_published(store: Store, run: str) -> Any:
    """`rebuild` (`protocol.pulse.rebuild`) of the pointer's version, for `at_startup`: rebuild reports a store that
    does not answer as a HistoryError, so after one the store is asked a cheap question (an
    outage raises StoreUnavailable there, and is waited out); a HistoryError while the store
    answers is tried twice more, then raised (damaged weights)."""
    failed: HistoryError | None = None
    for _ in range(3):
        try:
            return await rebuild(store, run)
        except HistoryError as exc:
            failed = exc
            await store.exists(RunLayout(run).pointer)
    assert failed is not None
    raise failed


async def probe_store(url: str, run: str, stop: Interrupt) -> bool:
    """Whether `run` is new in the bucket at `url`; QuickstartError saying what to fix when the
    bucket cannot be used (a bad URL, no credentials, nothing listening at the endpoint)."""
    try:
        async with open_store(url, create=True) as store:
            return not await stop.race(store.exists(RunLayout(run).pointer))
    except (ValueError, StoreError) as exc:
        raise QuickstartError(
            f"cannot use the bucket --store {url}: {exc} (or leave --store out for a local bucket in --out)"
        ) from exc


def load_published(learner: Learner, state: dict[str, np.ndarray]) -> None:
    """Put published bf16 weights into the learner's float32 master (resume)."""
    learner.load_bf16_state(state)


async def read_worker_states(store: Store, run: str, workers: int, registry: Registry | None = None) -> list[Heartbeat]:
    """The heartbeats of `read_judged_states` whose figures count (`trusted`)."""
    return trusted(*await read_judged_states(store, run, workers, registry))


async def read_judged_states(
    store: Store, run: str, workers: int, registry: Registry | None = None
) -> tuple[list[Heartbeat], dict[str, HeartbeatTrust] | None]:
    """The latest heartbeat of each of the quickstart's `workers` (their ids are fixed, see
    `worker_id`; a worker that has written none yet is left out) and, in a signed run
    (`registry`), each one's verdict (`judge_heartbeat`), as `stoa fleet` shows them; None in an
    unsigned run."""
    beats, trust = [], {}
    for i in range(workers):
        try:
            beat, verdict = await through_outages(
                partial(read_judged_heartbeat, store, run, worker_id(i), registry),
                describe=f"reading the heartbeats of run {run!r}",
            )
        except (NotFound, ValueError):
            continue
        beats.append(beat)
        if verdict is not None:
            trust[beat.worker_id] = verdict
    return beats, None if registry is None else trust


def trusted(beats: list[Heartbeat], trust: Mapping[str, HeartbeatTrust] | None) -> list[Heartbeat]:
    """The heartbeats whose figures count: all in an unsigned run, the signed ones in a signed run."""
    return [b for b in beats if trust is None or trust.get(b.worker_id) == "signed"]


async def samples_by_version(
    store: Store, run: str, workers: Registry | None = None
) -> tuple[dict[int, list[float]], dict[int, list[int]]]:
    """Every sample reward and tool-call count of every group in the bucket, by the weight
    version it was drawn from — all groups, including those the trainer filtered (an unbiased
    learning curve). In a signed run (`workers`: its registry) a record counts only when a
    registered worker key signed it; anything that does not decode or verify is skipped."""
    from slime_stoa.protocol.records import RecordError, decode_group
    from slime_stoa.protocol.signed_record import open_signed, verify_signed

    keys = {} if workers is None else {e.key.key_id: e.key for e in workers.workers.values()}
    layout = RunLayout(run)
    rewards: dict[int, list[float]] = defaultdict(list)
    calls: dict[int, list[int]] = defaultdict(list)
    async for info in store.list(layout.rollouts_prefix()):
        try:
            data = await store.get_bytes(info.key)
            if workers is not None:
                signed = open_signed(data)
                if signed.key_id not in keys:
                    continue
                verify_signed(signed, keys[signed.key_id], run=run)
                data = signed.record
            group = decode_group(data)
        except RecordError:
            continue
        rewards[group.weight_version].extend(s.reward for s in group.samples)
        calls[group.weight_version].extend(s.tool_calls for s in group.samples)
    return rewards, calls


def count_lost(beats: list[Heartbeat]) -> int:
    """Finished groups that will never reach the bucket, as the workers themselves report them:
    those set aside for good because their key held other bytes (`groups_quarantined`).

    Called with the workers' heartbeats read after they stopped. On stop a worker flushes its
    spool, then writes a final heartbeat (status "stopped") saying what is left there. A worker
    killed before its final heartbeat is counted from its last regular one (written every few
    seconds); one that never wrote a heartbeat never got as far as generating."""
    return sum(beat.groups_quarantined for beat in beats)


def count_spooled(beats: list[Heartbeat]) -> int:
    """Finished groups still waiting in a worker's spool (`groups_spooled` of the same
    heartbeats as `count_lost`): not lost, a restarted worker uploads them first."""
    return sum(beat.groups_spooled for beat in beats)


def check_tracking(cfg: QuickstartConfig) -> None:
    """QuickstartError at once when --wandb is asked for but the wandb package is missing."""
    if cfg.wandb:
        try:
            import_wandb()
        except TrackingUnavailable as exc:
            raise QuickstartError(f"--wandb: {exc}") from None


def start_tracking(cfg: QuickstartConfig) -> TrackedRun | None:
    """The W&B run of --wandb (None without), files under --out unless $WANDB_DIR says
    otherwise; a rerun resumes it (its id is kept in `WANDB_ID_FILE`)."""
    if not cfg.wandb:
        return None
    settings = {name: str(value) if isinstance(value, Path) else value for name, value in vars(cfg).items()}
    try:
        return TrackedRun.open(
            project=cfg.wandb_project, name=cfg.run, group=cfg.run, config={**settings, "store": cfg.store_url},
            folder=None if os.environ.get("WANDB_DIR") else cfg.out, id_file=cfg.out / WANDB_ID_FILE,
        )
    except TrackingUnavailable as exc:
        raise QuickstartError(f"--wandb: {exc}") from None


def track_step(
    tracker: TrackedRun, *, batch: Any, train_metrics: dict[str, float], result: Any, beats: list[Heartbeat],
    gaps: list[float], head: int, trust: Mapping[str, HeartbeatTrust] | None = None,
) -> None:
    """One learner step in W&B as slime logs one, at the version the batch was taken at:
    train/* (the learner's metrics, the patch) at train/step; rollout/* (the consumer's, the
    fleet's, the same-version logprob gap when measured) and worker/* at rollout/step."""
    step = batch.trainer_version
    trained = {f"train/{name}": value for name, value in train_metrics.items()}
    trained.update({"train/stoa_patch_bytes": float(result.patch_bytes), "train/stoa_changed_frac": result.density})
    tracker.log(trained, step_key="train/step", step=step)
    rollout = {**batch.metrics, **fleet_metrics(beats, time.time(), head=head, trust=trust)}
    if gaps:
        rollout["rollout/stoa_logprob_gap"] = float(np.mean(gaps))
    tracker.log(rollout, step_key="rollout/step", step=step)


def model_token_gaps(seq: TrainSequence, learner_lp: np.ndarray) -> np.ndarray:
    """|learner - worker| logprob at the tokens the model sampled (a tool's tokens have none)."""
    gap = np.abs(learner_lp - seq.worker_logprobs)
    return gap if seq.mask is None else gap[np.asarray(seq.mask, dtype=bool)]


def observe_gaps(consumer: RolloutConsumer, same: list[tuple[Any, list[TrainSequence]]], learner_lps: list[np.ndarray]) -> None:
    """Feed each measured group's |learner - worker| logprob gap to the consumer's quarantine
    policy (per worker; a canary prompt's gap is judged too)."""
    at = 0
    for g, seqs in same:
        diffs = [model_token_gaps(s, lp) for s, lp in zip(seqs, learner_lps[at : at + len(seqs)], strict=True)]
        at += len(seqs)
        d = np.concatenate(diffs) if diffs else np.zeros(0)
        if d.size:
            consumer.observe_logprob_gap(
                g.worker, float(d.mean()), int(d.size), prompt_index=g.group.prompt_index, plane=g.group.plane
            )


@dataclass
class Session:
    """What every phase of one quickstart reads: the command's settings, where it reports, its
    stop flag, the open bucket, whether the run is new there, the model folder, the search task's
    data (None for the other tasks) and the run's progress (the one owner of the summary's figures)."""

    cfg: QuickstartConfig
    report: Any
    stop: Interrupt
    store: Store
    new_run: bool
    model_dir: Path
    search_data: qsearch.SearchData | None
    progress: Progress

    @property
    def learner_file(self) -> Path:
        return self.cfg.out / LEARNER_FILE

    @property
    def progress_file(self) -> Path:
        return self.cfg.out / PROGRESS_FILE

    async def at_startup(self, op: Callable[[], Any], what: str) -> Any:
        return await at_startup(op, what, self.stop)


@dataclass(frozen=True)
class Seeded:
    """What seeding the run gives the later phases: its publisher, the keeper of its pointers'
    freshness (started by `_run_locked`; each publish holds its lock), and in a signed run its
    run key and worker registry (None in an unsigned one)."""

    pub: Publisher
    keeper: PointerKeeper
    run_key: SigningKey | None
    registry: Registry | None

    @property
    def run_key_text(self) -> str | None:
        return None if self.run_key is None else self.run_key.public.to_text()


@dataclass(frozen=True)
class Fleet:
    """What the train phase drives: the learner, its publisher and the keeper of its pointers
    (whose lock each publish holds), the consumer of the workers' groups, the worker processes,
    the W&B run (None without --wandb) and the worker registry (None in an unsigned run)."""

    learner: Learner
    pub: Publisher
    keeper: PointerKeeper
    consumer: RolloutConsumer
    workers: WorkerProcesses
    tracker: TrackedRun | None
    registry: Registry | None


async def train(s: Session, fleet: Fleet, version: int, *, deadline: float) -> None:
    """The train phase: learner steps from `version` until the target reward, the time limit
    (`deadline`: the RL part's, started with its workers) or the version limit.

    Each step: take a batch (a stop signal cuts the wait short), save the consumer's state
    (the batch counts as used from here on: a crash after this point loses it rather than
    using it twice), train, publish, save the learner, then the progress. The stop flag is
    checked between steps, never between taking a batch and publishing what was learnt from it.

    The logprob gap (learner vs worker, same tokens) is measured only on groups drawn from the
    learner's current weights: a step whose batch holds none measures nothing (its row shows
    "-"), as the learner no longer has the weights those groups were drawn with."""
    cfg, progress, report, stop = s.cfg, s.progress, s.report, s.stop
    learner, pub, consumer, workers = fleet.learner, fleet.pub, fleet.consumer, fleet.workers
    restart_at: float | None = None
    while time.time() < deadline and version - progress.first_version < cfg.max_versions:
        try:
            batch = await stop.race(consumer.next_batch(
                cfg.batch_groups, trainer_version=version, timeout_s=batch_wait_s(cfg, deadline - time.time()),
            ))
        except ConsumerTimeout as exc:
            if cfg.model is None or time.time() < deadline:
                raise  # the tiny model's fleet answers within minutes: a stall is a fault to report
            # A real model on a hard task: most groups can have equal rewards (no GRPO signal) and
            # are dropped, so a batch can take longer than the time left. The run ends at its time limit.
            report.note(f"time limit reached waiting for a batch ({' '.join(str(exc).split())[:300]})")
            break
        consumer_state = consumer.state_dict()  # this batch taken: saved now, and with the version's checkpoint
        await consumer.save_state(consumer_state)
        groups = [_train_sequences(g) for g in batch.groups]
        if batch.metrics.get("rollout/stoa_scored_samples"):
            progress.scored_rewards.append(batch.metrics["rollout/stoa_scored_reward_mean"])
        same = [(g, seqs) for g, seqs in zip(batch.groups, groups, strict=True) if g.weight_version == version][:2]
        flat = [seq for _, seqs in same for seq in seqs]
        learner_lps = learner.logprobs(flat) if flat else []
        gaps = [float(np.mean(model_token_gaps(seq, lp))) for seq, lp in zip(flat, learner_lps, strict=True)]
        observe_gaps(consumer, same, learner_lps)
        metrics = learner.step(groups)
        async with fleet.keeper.lock:  # no pointer refresh while the version commits
            result = await publish_with_retries(  # a store outage pauses the learner, never ends the run
                partial(pub.publish, learner.bf16_state()), retries=3, backoff_s=2.0,
                what=f"publishing v{version + 1} of run {cfg.run!r}",
            )
        version = result.version
        save_learner(learner, s.learner_file, run=cfg.run, version=version, state_digest=pub.state_digest or "")
        save_checkpoint(
            cfg.out / CHECKPOINTS_DIR, run=cfg.run, version=version, state_digest=pub.state_digest or "",
            model=learner.model.state_dict(), optimizer=learner.optimizer.state_dict(), consumer=consumer_state,
        )
        progress.last_version = version
        progress.groups_used += len(batch.groups)
        progress.patch_bytes[version] = result.patch_bytes
        progress.publish_seconds.append(result.seconds)
        progress.digests[version] = pub.state_digest or ""
        progress.record_gaps(version, gaps)
        beats, trust = await read_judged_states(s.store, cfg.run, cfg.workers, fleet.registry)
        for beat in trusted(beats, trust):
            if beat.version is not None and beat.state_digest:
                progress.seen_states[(beat.worker_id, beat.version)] = beat.state_digest
            if beat.version is not None and beat.swaps:
                progress.swap_seconds[(beat.worker_id, beat.version)] = beat.last_swap_s
        save_progress(progress, s.progress_file, run=cfg.run)
        report.version(version, metrics, batch, result, progress, workers.alive())
        if fleet.tracker is not None:
            track_step(fleet.tracker, batch=batch, train_metrics=metrics, result=result, beats=beats, gaps=gaps,
                       head=version, trust=trust)
        if cfg.kill_worker_at is not None and version == cfg.kill_worker_at:
            workers.kill(0)
            report.note(f"killed worker 0 with SIGKILL at v{version}; restarting it in 5 s")
            restart_at = time.time() + 5
        if restart_at is not None and time.time() >= restart_at:
            workers.start(0)
            restart_at = None
            report.note("restarted worker 0")
        if progress.reward_recent_batches(cfg.window) >= cfg.target:
            progress.target_reached = True
            report.note(f"target reward {cfg.target} reached (the last {cfg.window} batches' mean)")
            break
        stop.check()


async def run_quickstart(cfg: QuickstartConfig, report: Any, interrupt: Interrupt | None = None) -> dict[str, Any]:
    """Run the loop; `report` gets progress calls (see quickstart_report.ConsoleReport).

    `interrupt` (a stop flag the caller routes Ctrl-C/SIGTERM to) is checked between steps of
    every phase; when it is raised the run stops cleanly and `Interrupted` propagates. The run
    holds the run folder's lock (`lock`) throughout: a second one on the same --out is refused.
    The consumer's own pause lines go to the run folder's log file (`logfile`), not the console."""
    cfg.check_model()
    check_tracking(cfg)
    with run_lock(cfg.out), pause_lines_to_file(cfg.out):  # one quickstart per run folder, for its whole life
        return await _run_locked(cfg, report, interrupt or Interrupt())


async def _run_locked(cfg: QuickstartConfig, report: Any, stop: Interrupt) -> dict[str, Any]:
    """`run_quickstart` once the run folder's lock is held: its phases, in order."""
    import torch

    torch.set_num_threads(1)  # leave the other core(s) to the MLX workers
    progress = Progress()
    new_run = await phase_check_bucket(cfg, report, stop)  # before any slow work: a bad --store fails at once
    async with open_store(cfg.store_url, create=True) as store:
        s = Session(
            cfg=cfg, report=report, stop=stop, store=store, new_run=new_run, model_dir=cfg.model or (cfg.out / "model"),
            search_data=qsearch.search_data() if cfg.task == "search" else None, progress=progress,
        )
        learner = await phase_prepare_model(s)
        extras_dir = phase_warm_start(s, learner)
        seeded = await phase_seed(s, extras_dir)
        seeded.keeper.start()  # the pointers stay fresh from here to the end
        try:
            version, restart = await phase_resume(s, learner, seeded)
            await phase_first_eval(s, seeded.run_key)
            tracker = start_tracking(cfg)
            workers = WorkerProcesses(cfg, cfg.store_url, run_key=seeded.run_key_text)
            consumer: RolloutConsumer | None = None
            deadline = time.time() + cfg.minutes * 60  # the RL part's: its workers, its consumer, its steps
            try:
                phase_start_workers(s, workers)
                consumer = await phase_open_consumer(s, seeded, restart, deadline=deadline)
                fleet = Fleet(learner, seeded.pub, seeded.keeper, consumer, workers, tracker, seeded.registry)
                await train(s, fleet, version, deadline=deadline)
            finally:
                await stop_fleet(consumer, workers, tracker)
            return await phase_report(s, seeded.registry, consumer)
        finally:
            await seeded.keeper.stop()


async def phase_check_bucket(cfg: QuickstartConfig, report: Any, stop: Interrupt) -> bool:
    """Whether the run is new in the bucket (QuickstartError when the bucket cannot be used, or
    when --restart-from names a run that is new)."""
    new_run = await probe_store(cfg.store_url, cfg.run, stop)
    if new_run and cfg.restart_from is not None:
        raise QuickstartError(f"--restart-from {cfg.restart_from}: run {cfg.run!r} is new, there is nothing to restart")
    report.note(f"{'new' if new_run else 'existing'} run {cfg.run!r} in bucket {cfg.store_url}")
    return new_run


async def phase_prepare_model(s: Session) -> Learner:
    """The learner on the run's model: an existing run's checked to be the one asked for, the
    tiny model built when there is none yet."""
    cfg, model_dir = s.cfg, s.model_dir
    if not s.new_run:
        await s.at_startup(partial(check_same_run, s.store, cfg, model_dir), f"reading run {cfg.run!r}")
    if cfg.model is None and not (model_dir / "config.json").exists():
        build = tiny_synthetic_model if s.search_data is None else partial(qsearch.tiny_search_model, data=s.search_data)
        build(
            model_dir, family=cfg.family, hidden_size=cfg.model_hidden, num_layers=cfg.model_layers,
            intermediate_size=2 * cfg.model_hidden, num_heads=4, num_kv_heads=2,
        )
        s.report.note(f"built a tiny {cfg.family} model with a tokenizer trained on the task's text: {model_dir}")
    s.stop.check()
    learner = Learner(model_dir, LearnerConfig(lr=cfg.lr, temperature=cfg.temperature, dppo=DPPOConfig(), seed=cfg.seed))
    s.stop.check()
    return learner


def phase_warm_start(s: Session, learner: Learner) -> Path:
    """A new run's supervised warm start (unless switched off), resumed from its saved step;
    returns the folder of the files published beside the weights (the warm-started model's, else
    the model's own)."""
    cfg, report, progress = s.cfg, s.report, s.progress
    warmed = s.new_run and not (cfg.no_warm_start or cfg.warmup_steps == 0)
    if s.new_run and not warmed:
        progress.warm_start = f"no warm start: RL starts from {s.model_dir} as it is"
        report.note(progress.warm_start)
    if not warmed:
        return s.model_dir
    warm_file = cfg.out / WARM_FILE

    def resumed(state: WarmState) -> None:
        report.note(f"resumed the warm start at step {state.step} of {cfg.warmup_steps} (saved in {warm_file})")

    meter = StepMeter(report_console(report), "warm start", cfg.warmup_steps)
    if s.search_data is not None:  # how to query and read, not when to search
        report.note(qsearch.warm_start_search_note(cfg.warmup_steps))
        with meter:
            progress.warm_start = qsearch.warm_start_search(
                learner, s.model_dir, cfg.out, s.search_data, steps=cfg.warmup_steps, lr=cfg.warmup_lr,
                rl_lr=cfg.lr, seed=cfg.seed, interrupt=s.stop, path=warm_file, key=warm_key(cfg, s.model_dir),
                meter=meter, on_resume=resumed,
            )
    else:
        report.note(warm_start_note(cfg))
        with meter:
            progress.warm_start = warm_start(learner, s.model_dir, cfg, s.stop, path=warm_file, meter=meter,
                                             on_resume=resumed)
    report.note(progress.warm_start)
    warm_dir = cfg.out / "warm-start"
    save_hf_folder(learner.bf16_state(), warm_dir, source_dir=s.model_dir)
    return warm_dir


def kept_dir(cfg: QuickstartConfig) -> Path:
    """The folder of the trainer's own copies of what it signed (run manifest, registry, pointer,
    manifests, consumer state), beside the bucket in the run folder."""
    return cfg.out / "kept"


def run_copies(cfg: QuickstartConfig) -> list[Path]:
    """The folders of `kept_dir` holding this run's copies, the trainer's (`protocol.kept`) and
    its live chain's (`pulse.kept_chain`), each filed by bucket key (every key of the run is under
    its root): what a new run of this name replaces, other runs' copies kept."""
    root = RunLayout(cfg.run).root.rstrip("/")
    return [TrainerCopies(folder).path(root) for folder in (kept_dir(cfg), kept_dir(cfg) / LIVE_CHAIN_FOLDER)]


async def phase_seed(s: Session, extras_dir: Path) -> Seeded:
    """The run in the bucket: its run key, manifest and first weights (put-if-absent: an
    existing run's are kept), its publisher, and in a signed run the workers' keys registered."""
    cfg = s.cfg
    if s.new_run:  # copies kept for an earlier run of this name (its bucket deleted) are not this run's
        for folder in run_copies(cfg):
            shutil.rmtree(folder, ignore_errors=True)
    # The trainer's own copies of what it signs (`protocol/kept.py`): a bucket writer that deletes
    # or overwrites them gets them put back instead of stopping the run.
    publisher_cfg = PublisherConfig(extras_dir=extras_dir, anchor_every=100, keep_dir=kept_dir(cfg))
    run_key = await s.at_startup(partial(run_key_for, s.store, cfg, new_run=s.new_run), f"reading run {cfg.run!r}")
    manifest = RunManifest(
        run=cfg.run, model=str(s.model_dir), task=cfg.task, group_size=cfg.group_size,
        stop=() if s.search_data is None else Search.run_stop,
        run_key=None if run_key is None else run_key.public.to_text(),
        max_tokens=cfg.max_tokens, temperature=cfg.temperature, staleness_limit=cfg.staleness_limit,
        # Each worker makes at most 1.5x its share of a batch per version: some slack for the
        # all-equal filter, never a pile of data that would only go stale.
        worker_groups_per_version=max(-(-3 * cfg.batch_groups // (2 * cfg.workers)), cfg.worker_batch),
    )
    seed = partial(seed_run, objects=real_task_objects(cfg)) if s.search_data is None else partial(
        qsearch.seed_search_run, data=s.search_data)
    # The publisher's store keeps its live chain's small objects and notes what it wrote, and puts
    # back what a bucket writer spoiled while no trainer ran (its resume reads the chain back); the
    # keeper puts them back from then on, or forces an anchor (`pulse.kept_chain`, `pulse.chain_keeper`).
    publisher_store = await kept_publisher_store(s.store, cfg.run, kept_dir(cfg))
    try:
        pub = await s.at_startup(
            partial(seed, publisher_store, manifest, extras_dir, publisher=publisher_cfg, key=run_key),
            f"seeding run {cfg.run!r} and opening its publisher",
        )
    except UntrustedState as exc:  # the bucket's run is not this run key's, and nothing kept repairs it
        raise QuickstartError(
            f"run {cfg.run!r}: {exc}. Repair: put {RunLayout(cfg.run).run_manifest} back from its copy in "
            f"{kept_dir(cfg)} or from `stoa run create`'s output, or start a new run (--run NAME)"
        ) from None
    (cfg.out / WARM_FILE).unlink(missing_ok=True)  # the run is seeded: a rerun resumes it, not its warm start
    registry: Registry | None = None
    if run_key is not None:
        registry = await s.at_startup(partial(register_workers, s.store, cfg, run_key), "registering the worker keys")
        s.report.note(f"signed run: run key {run_key.public.fingerprint}; {len(registry.workers)} worker key(s) registered")
    return Seeded(pub=pub, keeper=pointer_keeper(pub), run_key=run_key, registry=registry)


def pointer_keeper(pub: Publisher, every_s: float = REFRESH_S) -> PointerKeeper:
    """The keeper of `pub`'s pointers (its bf16 weights' and each plane's), re-signing them every
    `every_s` and keeping their live chains whole (`pulse.chain_keeper`)."""
    return PointerKeeper.of_publisher(lambda: pub, every_s=every_s)


async def phase_resume(s: Session, learner: Learner, seeded: Seeded) -> tuple[int, Checkpoint | None]:
    """The learner at the version training goes on from, in the mode `resume_mode` picks, and
    the progress of the run so far; returns that version and the checkpoint restarted from (None
    unless --restart-from)."""
    cfg, progress, report, pub = s.cfg, s.progress, s.report, seeded.pub
    version, digest = pub.version or 0, pub.state_digest or ""
    if s.new_run:
        progress.run_first_version = version
    elif load_progress(progress, s.progress_file, run=cfg.run, version=version):
        report.note(f"the summary and the learning curve cover the whole run, from v{progress.run_first_version}")
    saved = saved_weights(s.learner_file)
    mode = resume_mode(
        new_run=s.new_run, restart_from=cfg.restart_from, published=WeightsAt(cfg.run, version, digest), saved=saved,
    )
    restart: Checkpoint | None = None
    if mode is ResumeMode.NEW:
        save_learner(learner, s.learner_file, run=cfg.run, version=version, state_digest=digest)
        save_checkpoint(
            cfg.out / CHECKPOINTS_DIR, run=cfg.run, version=version, state_digest=digest,
            model=learner.model.state_dict(), optimizer=learner.optimizer.state_dict(), consumer=None,
        )
    elif mode is ResumeMode.RESTART:
        assert cfg.restart_from is not None  # the mode says so
        restart = load_checkpoint(cfg.out / CHECKPOINTS_DIR, cfg.restart_from, run=cfg.run)
        version = await restart_from_checkpoint(s, learner, seeded, restart, head=version)
    elif mode is ResumeMode.LEARNER_FILE:
        restore_learner(learner, s.learner_file, lr=cfg.lr)
        report.note(f"resumed run {cfg.run!r} at weights v{version} from {cfg.store_url} (with the learner's optimizer state)")
    else:
        if saved is not None:
            log_stale(s.learner_file, saved, version)
        rebuilt = await s.at_startup(partial(rebuild_published, s.store, cfg.run), f"rebuilding the weights of run {cfg.run!r}")
        load_published(learner, rebuilt.state)
        report.note(f"resumed run {cfg.run!r} at weights v{version} from {cfg.store_url}")
    progress.first_version = progress.last_version = version
    progress.digests[version] = pub.state_digest or ""
    published = learner.bf16_state()
    progress.full_bytes, progress.tensors = 2 * sum(b.size for b in published.values()), len(published)
    del published
    save_progress(progress, s.progress_file, run=cfg.run)
    return version, restart


async def restart_from_checkpoint(s: Session, learner: Learner, seeded: Seeded, restart: Checkpoint, *, head: int) -> int:
    """--restart-from: the checkpoint's learner, its weights published again (a restore: a new
    lineage epoch) and saved as the newest checkpoint; returns the version published."""
    cfg, pub = s.cfg, seeded.pub
    await s.at_startup(
        partial(check_restorable, s.store, cfg.run, restart, head=head, trust=pub.trust),
        f"reading the weight lineage of run {cfg.run!r}",
    )
    apply_checkpoint(learner, restart, lr=cfg.lr)
    async with seeded.keeper.lock:  # no pointer refresh while the restore commits
        result = await s.stop.race(publish_with_retries(  # first the checkpoint's weights: a restore
            partial(pub.publish, learner.bf16_state()), retries=3, backoff_s=2.0,
            what=f"publishing the weights of checkpoint v{restart.version} of run {cfg.run!r}",
        ))
    if result.restored_from != restart.version:
        log.warning("v%d was not published as a restore of v%d", result.version, restart.version)
    version, digest = result.version, pub.state_digest or ""
    save_learner(learner, s.learner_file, run=cfg.run, version=version, state_digest=digest)
    save_checkpoint(
        cfg.out / CHECKPOINTS_DIR, run=cfg.run, version=version, state_digest=digest,
        model=restart.model, optimizer=restart.optimizer, consumer=restart.consumer,
    )
    left = f"; v{restart.version + 1}..v{version - 1} abandoned" if version - 1 > restart.version else ""
    s.report.note(
        f"run {cfg.run!r} restarts from the checkpoint of v{restart.version}: its weights are "
        f"v{version} (lineage epoch {result.epoch}{left})"
    )
    return version


async def phase_first_eval(s: Session, run_key: SigningKey | None) -> None:
    """A new run's first version evaluated now (unless --no-eval): by the end the bucket may have pruned it."""
    if s.new_run and not s.cfg.no_eval:
        await s.stop.race(first_eval(s.store, s.cfg, s.progress, s.report, synthetic=s.cfg.task == "synthetic", key=run_key))


def phase_start_workers(s: Session, workers: WorkerProcesses) -> None:
    """Each worker joined (`macd join`) and started (`macd run`)."""
    workers.write_configs(s.stop.check)
    for i in range(s.cfg.workers):
        s.stop.check()
        workers.start(i)
    s.report.note(f"started {s.cfg.workers} `macd run` workers (logs in {s.cfg.out / 'workers'})")


async def phase_open_consumer(s: Session, seeded: Seeded, restart: Checkpoint | None, *, deadline: float) -> RolloutConsumer:
    """The learner's consumer of the workers' groups, at its state in the bucket (waiting, until
    `deadline` at most, while a bucket writer has spoiled it or the run manifest: `spoiled`), or at
    the checkpoint's after --restart-from, written over whatever the bucket holds (restarting is
    the repair)."""
    cfg = s.cfg
    config = ConsumerConfig(
        store_url=cfg.store_url, run=cfg.run, wait_timeout_s=300.0, poll_interval_s=0.2,
        admission_order="newest_version",  # this learner outpaces its workers: stay on-policy
        run_key=seeded.run_key_text, keep_dir=str(kept_dir(cfg)),
    )
    kept_manifest = TrainerCopies(kept_dir(cfg)).path(RunLayout(cfg.run).run_manifest)
    consumer = await opened_consumer(  # a run manifest a bucket writer spoiled: waited for as the state is below
        partial(
            RolloutConsumer.open, s.store, config,
            tokenizer_dir=s.model_dir,
            restore=False,  # resumed below, with the quickstart's own repair and time limit
            state_key=seeded.run_key,  # signs the state it saves; reads back only a signed one
        ),
        minutes=cfg.minutes, repair=manifest_repair_line(cfg, kept=kept_manifest, fresh=fresh_run(cfg)),
        deadline=deadline, stop=s.stop, report=s.report, config=config,
    )
    if restart is None:
        try:
            state = await resumed_state(
                consumer.bucket_state, minutes=cfg.minutes, repair=spoiled_repair(cfg, signed=seeded.run_key is not None),
                deadline=deadline, stop=s.stop, report=s.report, config=consumer.config,
            )
        except BaseException:  # the time limit or a stop while paused: closed, and nothing saved over the state
            await consumer.close()
            raise
        if state is not None:
            consumer.load_state_dict(state)
        return consumer
    try:
        await consumer.bucket_state()  # its ETag, for the compare-and-swap
    except SPOILED as exc:
        s.report.note(f"{state_key(cfg.run)} in the bucket is {spoiled_cause(exc)}: the checkpoint's state is saved over it")
    if restart.consumer is not None:
        consumer.load_state_dict(restart.consumer)
    await consumer.save_state()
    return consumer


def spoiled_repair(cfg: QuickstartConfig, *, signed: bool) -> str:
    """`spoiled.repair_line` for this run folder (a signed run keeps its copy in `kept_dir`)."""
    kept = TrainerCopies(kept_dir(cfg)).path(state_key(cfg.run)) if signed else None
    return repair_line(
        cfg, kept=kept, checkpoints=checkpoint_versions(cfg.out / CHECKPOINTS_DIR), fresh=fresh_run(cfg)
    )


async def stop_fleet(consumer: RolloutConsumer | None, workers: WorkerProcesses, tracker: TrackedRun | None) -> None:
    """However the train phase ended: the consumer closed, the workers stopped (each flushes its
    spool), the W&B run closed, then the consumer's state saved."""
    if consumer is not None:
        await consumer.close()
    workers.stop()
    if tracker is not None:
        tracker.close()
    if consumer is not None:
        await consumer.save_state()


async def phase_report(s: Session, registry: Registry | None, consumer: RolloutConsumer | None) -> dict[str, Any]:
    """After the workers stopped: their final heartbeats and every group's rewards read into the
    progress, the last version evaluated, and the summary of the whole run."""
    cfg, progress = s.cfg, s.progress
    final_beats = await read_worker_states(s.store, cfg.run, cfg.workers, registry)
    for beat in final_beats:
        if beat.version is not None and beat.state_digest:
            progress.seen_states[(beat.worker_id, beat.version)] = beat.state_digest
        if beat.version is not None and beat.swaps:  # the last install, if no step's read caught it
            progress.swap_seconds.setdefault((beat.worker_id, beat.version), beat.last_swap_s)
    save_progress(progress, s.progress_file, run=cfg.run)
    lost, spooled = count_lost(final_beats), count_spooled(final_beats)
    progress.rewards, progress.tool_calls = await s.stop.race(samples_by_version(s.store, cfg.run, registry))
    if not cfg.no_eval and progress.last_version not in progress.eval_pass1:  # no version since: evaluated
        await s.stop.race(heldout_eval(s.store, cfg, progress, s.report, progress.last_version))
    assert consumer is not None  # opened, or train() was never reached
    groups_used_run = consumer.counters.get("groups_used", 0)
    refused = rejects_by_reason(consumer.counters)
    return summarize(progress, cfg, lost=lost, spooled=spooled, refused=refused, groups_used_run=groups_used_run)


async def first_eval(
    store: Store, cfg: QuickstartConfig, progress: Progress, report: Any, *, synthetic: bool, key: SigningKey | None
) -> None:
    """Eval pass@1 of the run's first RL version on the held-out test split (kept in progress);
    the synthetic task's split is written first (signed into the task manifest with the run key
    `key` in a signed run)."""
    if synthetic:
        await heldout.put_synthetic_test_split(store, cfg.run, key=key)
    await heldout_eval(store, cfg, progress, report, progress.run_first_version)
    save_progress(progress, cfg.out / PROGRESS_FILE, run=cfg.run)


async def heldout_eval(store: Store, cfg: QuickstartConfig, progress: Progress, report: Any, version: int) -> None:
    """Eval pass@1 of `version` on the held-out test split (kept in progress), with a bar that
    moves with every decode step (in tokens of the budget, with an upper-bound ETA; the search
    task's in prompts as their samples finish)."""
    from .meter import SamplingMeter

    what = f"eval v{version} (held-out test split, {cfg.eval_samples} sample(s) per prompt)"
    with SamplingMeter(report_console(report), what) as meter:
        meter.start(cfg.eval_prompts)  # shown while the version is rebuilt; sized again when sampling starts
        progress.eval_pass1.update(await heldout.pass1_at(
            store, cfg.run, [version], seed=cfg.seed, work_dir=cfg.out, prompts=cfg.eval_prompts,
            k=cfg.eval_samples, on_progress=meter.show,
        ))
    report.note(f"eval pass@1 on the held-out test split at v{version}: {progress.eval_pass1[version]:.3f}")


def summarize(
    progress: Progress,
    cfg: QuickstartConfig,
    *,
    lost: int,
    groups_used_run: int,
    spooled: int = 0,
    refused: Mapping[str, int] | None = None,
) -> dict[str, Any]:
    """The summary of the whole run, but for `versions`, `groups_used` and `seconds`: those are
    this session's, and their whole-run totals the `*_run` keys. `refused`: the trainer's
    records refused, by reason (`rejects_by_reason`), whole run."""
    repeats, failed = split_refusals(refused or {})
    patches = list(progress.patch_bytes.values())
    swaps = list(progress.swap_seconds.values())
    return {
        "first_version": progress.run_first_version,
        "reward_first": progress.reward_first(),
        "reward_last": progress.reward_last(cfg.window),
        "reward_recent_batches": progress.reward_recent_batches(cfg.window),
        "target_reached": progress.target_reached,
        "search_rate_first": progress.search_rate_first(),
        "search_rate_last": progress.search_rate_last(cfg.window),
        "eval_pass1_first": progress.eval_pass1.get(progress.run_first_version, float("nan")),
        "eval_pass1_last": progress.eval_pass1.get(progress.last_version, float("nan")),
        "eval_prompts": cfg.eval_prompts,
        "eval_samples": cfg.eval_samples,
        "task": cfg.task,
        "window": cfg.window,
        "chance": baseline_reward(generate_items(256, seed=cfg.seed)) if cfg.task == "synthetic" else 0.0,
        "target": cfg.target,
        "versions": progress.last_version - progress.first_version,
        "versions_run": progress.last_version - progress.run_first_version,
        "last_version": progress.last_version,
        "digest_mismatches": progress.digest_mismatches(),
        "digests_checked": len(progress.seen_states),
        "mean_abs_logprob_gap": float(np.mean(progress.gaps)) if progress.gaps else float("nan"),
        "logprob_gap_versions": len(progress.gap_by_version),
        "groups_used": progress.groups_used,
        "groups_used_run": groups_used_run,
        "groups_lost": lost,
        "groups_spooled": spooled,
        "groups_repeated": repeats,
        "records_refused": failed,
        "patch_bytes_mean": float(np.mean(patches)) if patches else 0.0,
        "full_bytes": progress.full_bytes,
        "family": cfg.family if cfg.model is None else None,
        "tensors": progress.tensors,
        # this session's: the learner's publish of a version, a worker's sync of one until it serves it
        "publish_seconds_mean": float(np.mean(progress.publish_seconds)) if progress.publish_seconds else float("nan"),
        "worker_sync_seconds_mean": float(np.mean(swaps)) if swaps else float("nan"),
        "worker_syncs_seen": len(swaps),
        "seconds": time.time() - progress.started,
        "seconds_run": progress.seconds(),
        "warm_start": progress.warm_start,
        "reward_by_version": {v: progress.version_reward(v) for v in sorted(progress.rewards)},
        "search_rate_by_version": {v: progress.version_search_rate(v) for v in sorted(progress.tool_calls)},
        "patch_bytes_by_version": dict(sorted(progress.patch_bytes.items())),
        "logprob_gap_by_version": dict(sorted(progress.gap_by_version.items())),
    }
