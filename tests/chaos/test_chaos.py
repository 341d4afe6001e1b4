"""The chaos suite: a run survives a week, compressed into minutes.

Against the real local S3 server: the quickstart learner (consumer, CPU learner, PULSE
publisher) and `macd run` workers (MLX), each through its own fault-injecting proxy. While the
run trains, the proxies drop, delay and cut connections mid-request and mid-answer, answer
503 in bursts and go fully down; workers are SIGKILLed while generating, spooling, uploading
and swapping weights, and restarted; the learner is SIGKILLed mid-publish and mid-consume and
restarted; forged objects are planted (records, heartbeats, and, while the learner is down, a
malformed pointer, a malformed manifest and a corrupted patch).

Then everything is stopped cleanly and reconciled (`harness.reconcile`): every group a worker
finished is in the bucket exactly once, every group the learner trained on was an honest record
of a published version within staleness and used no more than the reuse limit, every worker
ends on the pointer's weights, no process is left. `STOA_CHAOS_JSON=<path>` writes the figures.
A second, calmer run kills the learner and restarts it from the checkpoint of an earlier version
(`--restart-from`), reconciled the same way along the weight lineage it then has.
The short form runs in the default suite (a few minutes); `--chaos-long` (or STOA_CHAOS_LONG=1)
runs for about 30 minutes. The seed is printed (`STOA_TEST_SEED` replays it).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("mlx_lm")
pytest.importorskip("torch")

from slime_stoa.protocol.layout import RunLayout
from slime_stoa.protocol.store import NotFound
from tests.chaos.harness import (
    FORGER,
    INTERRUPTED,
    LEARNER,
    REUSE,
    RUN,
    STALENESS,
    ChaosPlan,
    Forger,
    LearnerProcess,
    Process,
    WorkerProcess,
    child_env,
    key_of,
    processes_left,
    reconcile,
)
from tests.conftest import async_wait_until, random_seed
from tests.faultproxy import NO_FAULTS, FaultyProxy, Hold


class ChaosRun:
    """One run under chaos: the processes, their proxies, the acts and what they did."""

    def __init__(self, plan: ChaosPlan, seed: int, tmp: Path, server: Any, bucket: str) -> None:
        self.plan, self.seed, self.tmp = plan, seed, tmp
        self.rng = random.Random(seed)
        self.server = server
        self.prefix = f"chaos-{uuid.uuid4().hex[:8]}"
        self.direct = server.store(bucket, self.prefix)  # the test's own, fault-free view of the bucket
        self.layout = RunLayout(RUN)
        self.port = int(server.endpoint_url.rsplit(":", 1)[1])
        self.bucket = bucket
        creds = server.credentials()
        self.env = child_env({"AWS_ACCESS_KEY_ID": creds.access_key_id, "AWS_SECRET_ACCESS_KEY": creds.secret_access_key})
        self.faults: Counter[str] = Counter()
        self.proxies: list[FaultyProxy] = []
        self.workers: list[WorkerProcess] = []
        self.learner: LearnerProcess | None = None
        self.forger = Forger(self.direct, RUN, random.Random(self.rng.randrange(1 << 30)))
        self.crashes: Counter[str] = Counter()
        self.log: list[str] = []
        self.reserved: set[FaultyProxy] = set()  # an act is using it: the network task leaves it alone

    def note(self, text: str) -> None:
        line = f"{time.strftime('%H:%M:%S')} {text}"
        self.log.append(line)
        print(f"chaos: {line}", flush=True)

    def url(self, proxy: FaultyProxy) -> str:
        return f"s3://{self.bucket}/{self.prefix}?endpoint={proxy.endpoint}"

    async def proxy(self, stack: contextlib.AsyncExitStack, name: str) -> FaultyProxy:
        p = await stack.enter_async_context(FaultyProxy(self.port, seed=self.rng.randrange(1 << 30), name=name))
        self.proxies.append(p)
        return p

    @property
    def processes(self) -> list[Process]:
        return [*self.workers, *([self.learner] if self.learner else [])]

    # -- start -------------------------------------------------------------------------------
    async def start(self, stack: contextlib.AsyncExitStack) -> None:
        lp = await self.proxy(stack, "learner")
        config = {**LEARNER, "workers": self.plan.workers, "store": self.url(lp), "seed": self.rng.randrange(1000)}
        learner = self.learner = LearnerProcess(self.tmp / "learner", lp, config, self.env)
        learner.start()
        await async_wait_until(
            lambda: self.direct.exists(self.layout.pointer), message=self.learner_state, timeout=self.plan.wait_s * 2,
            interval=0.2,
        )
        self.note("the learner published v0")
        for i in range(self.plan.workers):
            wp = await self.proxy(stack, f"worker-{i}")
            # A signed run: the learner makes and registers its workers' keys, then starts them.
            await async_wait_until(lambda: learner.said("started"), message=self.learner_state, timeout=self.plan.wait_s)
            key = learner.worker_key(i)
            seed = self.rng.randrange(1000)
            w = WorkerProcess(i, self.tmp / f"worker-{i}", wp, self.url(wp), RUN, self.env, seed, key if key.exists() else None)
            await asyncio.to_thread(w.join)  # the proxies keep serving meanwhile
            w.start()
            self.workers.append(w)
        await async_wait_until(lambda: learner.last_version() >= 2, message=self.learner_state, timeout=self.plan.wait_s * 2)
        self.note(f"training: v{learner.last_version()}")

    def learner_state(self) -> str:
        assert self.learner is not None
        return f"the learner (log tail:\n{self.learner.tail()})"

    # -- the watchdog ------------------------------------------------------------------------
    async def watchdog(self) -> None:
        """A process that exits by itself is a crash: counted, then restarted (the run goes on)."""
        while True:
            for p in self.processes:
                if p.check_crash():
                    rc, _ = p.exits[-1]
                    self.crashes[p.name] += 1
                    self.note(f"CRASH: {p.name} exited with {rc}:\n{p.tail(40)}")
                    if self.crashes[p.name] <= 5:
                        p.start()  # type: ignore[attr-defined]
            await asyncio.sleep(0.2)

    # -- the network -------------------------------------------------------------------------
    async def network(self) -> None:
        """Outages and 503 bursts, on one proxy or on all at once (a store outage), one at a time.

        Not on the learner's proxy while the learner starts: the quickstart checks the bucket
        once at start and stops with a clear error when it does not answer (a bad --store)."""
        for p in self.proxies:
            p.faults = self.plan.faults
        while True:
            await asyncio.sleep(self.rng.uniform(*self.plan.network_gap_s))
            targets = self.proxies if self.rng.random() < 0.3 else [self.rng.choice(self.proxies)]
            if self.learner is not None and self.learner.starting():
                targets = [p for p in targets if p is not self.learner.proxy]
            targets = [p for p in targets if p not in self.reserved]
            if not targets:
                continue
            names = ", ".join(p.name for p in targets)
            if self.rng.random() < 0.6:
                length = self.rng.uniform(*self.plan.outage_s)
                self.note(f"outage of {length:.1f} s: {names}")
                for p in targets:
                    p.set_down()
                try:
                    await asyncio.sleep(length)
                finally:
                    for p in targets:
                        p.set_up()
            else:
                length = self.rng.uniform(*self.plan.burst_s)
                self.note(f"503 burst of {length:.1f} s: {names}")
                for p in targets:
                    p.set_busy(True)
                try:
                    await asyncio.sleep(length)
                finally:
                    for p in targets:
                        p.set_busy(False)

    def calm(self) -> None:
        for p in self.proxies:
            p.faults = NO_FAULTS
            p.set_up()
            p.set_busy(False)

    # -- worker kills ------------------------------------------------------------------------
    def pick_worker(self) -> WorkerProcess:
        alive = [w for w in self.workers if w.alive and w.spooled()] or self.workers
        return self.rng.choice(alive)

    async def restart_worker(self, w: WorkerProcess) -> None:
        await asyncio.sleep(self.rng.uniform(0.2, 2.0))
        if not w.alive:
            w.start()

    async def kill_worker(self, point: str) -> None:
        w = self.pick_worker()
        await async_wait_until(lambda: w.alive, message=f"{w.name} running", timeout=self.plan.wait_s)
        if point in ("upload", "swap"):
            prefix = self.layout.rollouts_prefix() if point == "upload" else self.layout.patches_prefix
            method = "PUT" if point == "upload" else "GET"
            trap = w.proxy.hold(lambda m, p: m == method and (key_of(p, self.prefix) or "").startswith(prefix))
            try:
                await async_wait_until(trap.hit.is_set, message=f"{w.name}'s next {method} under {prefix}", timeout=self.plan.wait_s)
            except AssertionError:
                w.proxy._holds.remove(trap)
                raise
            if point == "upload":
                land = self.rng.random() < 0.5  # killed once its upload reached the bucket, or before
                await self.kill_at(w, trap, land)
                point = f"upload ({'landed' if land else 'cut'})"
            else:
                trap.release()
                await asyncio.sleep(self.rng.uniform(0.0, 0.3))
                w.kill()
        else:
            seen = len(w.spooled())
            await async_wait_until(
                lambda: len(w.spooled()) > seen or not w.alive, message=f"{w.name} spooling", timeout=self.plan.wait_s
            )
            if point == "generation":
                await asyncio.sleep(self.rng.uniform(0.2, 1.0))
            if not w.alive:
                return
            w.kill()
        self.faults[f"kill_worker_{point.split()[0]}"] += 1
        self.note(f"SIGKILL {w.name} at {point}")
        await self.restart_worker(w)

    async def kill_at(self, process: Process, trap: Hold, land: bool) -> None:
        """SIGKILL `process` while its request `trap` holds: once the request reached the bucket
        whole (`land`: its answer may be lost), or before any of it did."""
        if land:
            trap.release()
            await async_wait_until(trap.done.is_set, message="the held request to reach the bucket", timeout=self.plan.wait_s)
            process.kill()
        else:
            process.kill()
            trap.drop()

    # -- learner kills -----------------------------------------------------------------------
    async def kill_learner(self, point: str) -> None:
        learner = self.learner
        assert learner is not None
        await async_wait_until(lambda: learner.alive, message="the learner running", timeout=self.plan.wait_s)
        layout = self.layout
        if point == "publish":
            target = self.rng.choice(["pointer", "manifest", "patch"])
            wanted = {"pointer": layout.pointer, "manifest": layout.versions_prefix, "patch": layout.patches_prefix}[target]
            trap = learner.proxy.hold(lambda m, p: m == "PUT" and (key_of(p, self.prefix) or "").startswith(wanted))
        else:
            target = "record download"
            rollouts = layout.rollouts_prefix()
            trap = learner.proxy.hold(lambda m, p: m == "GET" and (key_of(p, self.prefix) or "").startswith(rollouts))
        try:
            await async_wait_until(trap.hit.is_set, message=f"the learner's {target} request", timeout=self.plan.wait_s)
        except AssertionError:
            learner.proxy._holds.remove(trap)
            raise
        land = point == "publish" and self.rng.random() < 0.5
        await self.kill_at(learner, trap, land)
        self.faults[f"kill_learner_{point}"] += 1
        self.note(f"SIGKILL learner mid-{point} ({target}{', it lands' if land else ''})")
        if point == "publish" and (self.faults["kill_learner_publish"] == 1 or self.rng.random() < 0.5):
            await self.forger.pointer_faults(self.workers, self.plan.wait_s)
            self.note("planted a malformed pointer, a malformed manifest and a corrupted patch; pointer restored")
        await asyncio.sleep(self.rng.uniform(0.2, 2.0))
        learner.start()

    async def outage_in_learner_step(self, what: str) -> None:
        """A full outage that starts while the learner publishes (uploading a patch, or just as its
        pointer write landed: the answer is lost), or reads the workers' heartbeats after a publish:
        the learner must wait it out, as it does while it waits for a batch."""
        learner = self.learner
        assert learner is not None
        await async_wait_until(
            lambda: learner.alive and not learner.starting(), message="the learner training", timeout=self.plan.wait_s
        )
        wanted, method = {
            "publish": (self.layout.patches_prefix, "PUT"), "heartbeats": (self.layout.workers_prefix, "GET"),
            "pointer": (self.layout.pointer, "PUT"),
        }[what]  # fmt: skip
        trap = learner.proxy.hold(lambda m, p: m == method and (key_of(p, self.prefix) or "").startswith(wanted))
        try:
            await async_wait_until(trap.hit.is_set, message=f"the learner's {method} under {wanted}", timeout=self.plan.wait_s)
        except AssertionError:
            learner.proxy._holds.remove(trap)
            raise
        length = self.rng.uniform(*self.plan.outage_s)
        self.note(f"outage of {length:.1f} s at the learner's {what}")
        self.reserved.add(learner.proxy)
        try:
            if what == "pointer":  # the pointer moves, but the learner never hears so
                trap.lose_answer(then_down=True)
            else:
                learner.proxy.set_down()
                trap.drop()
            self.faults[f"outage_at_learner_{what}"] += 1
            await asyncio.sleep(length)
        finally:
            learner.proxy.set_up()
            self.reserved.discard(learner.proxy)

    # -- forged records ----------------------------------------------------------------------
    async def forge_records(self) -> None:
        assert self.learner is not None
        used = [g["key"] for e in self.learner.versions()[-3:] for g in e["groups"]]
        sample = await self.direct.get_bytes(self.rng.choice(used))  # fresh, and in the replay ledger
        await self.forger.records(sample)
        await self.forger.heartbeats(self.workers[0].worker_id)
        self.note(f"planted {len(self.forger.keys)} forged records so far, and two bad heartbeats")

    # -- the chaos phase ---------------------------------------------------------------------
    def acts(self) -> list[tuple[str, str]]:
        points = ["generation", "spooling", "upload", "swap"]
        worker = [("worker", points[i % 4]) for i in range(self.plan.worker_kills)]
        learner = [("learner", ["publish", "consume"][i % 2]) for i in range(self.plan.learner_kills)]
        forging = [("forge", "records")] * max(1, self.plan.learner_kills // 2)
        outages = [("outage", ["publish", "pointer", "heartbeats"][i % 3]) for i in range(max(3, self.plan.learner_kills))]
        acts = worker + learner + forging + outages
        self.rng.shuffle(acts)
        return acts

    async def chaos(self) -> None:
        acts = self.acts()
        deadline = time.monotonic() + self.plan.chaos_s
        for i, (who, what) in enumerate(acts):
            if who == "worker":
                await self.kill_worker(what)
            elif who == "learner":
                await self.kill_learner(what)
            elif who == "outage":
                await self.outage_in_learner_step(what)
            else:
                await self.forge_records()
            left = deadline - time.monotonic()
            await asyncio.sleep(max(left, 0) / (len(acts) - i) * self.rng.uniform(0.5, 1.0))
        await asyncio.sleep(max(deadline - time.monotonic(), 0))

    # -- the clean end -----------------------------------------------------------------------
    async def rejected(self) -> int:
        try:
            state = json.loads(await self.direct.get_bytes(self.layout.trainer_file("consumer.json")))
        except NotFound:
            return 0
        return sum(v for k, v in state.get("counters", {}).items() if k.startswith("rejected/"))

    async def finish(self) -> None:
        """Calm network; the learner judges every forged record and trains a few more versions;
        then it stops, every worker syncs to the final pointer, and the workers stop."""
        learner = self.learner
        assert learner is not None
        self.calm()
        for w in self.workers:
            if not w.alive:
                w.start()
        if not learner.alive:
            learner.start()
        sure = len(self.forger.keys) - self.forger.injected["record_wrong_digest"] - self.forger.injected["record_replay"]
        await async_wait_until(
            lambda: self._rejected_at_least(sure), message=f"{sure} forged records rejected", timeout=self.plan.wait_s * 2,
            interval=0.2,
        )
        target = learner.last_version() + 2
        await async_wait_until(
            lambda: learner.last_version() >= target, message=self.learner_state, timeout=self.plan.wait_s * 2
        )
        rc = await learner.stop(120)
        self.note(f"learner stopped ({rc}) at v{learner.last_version()}")
        found = await self.direct.get_bytes(self.layout.pointer)
        final = json.loads(found)
        await async_wait_until(
            lambda: self._all_on(final["version"], final["state_digest"]),
            message=f"every worker on v{final['version']}", timeout=self.plan.wait_s, interval=0.2,
        )
        for w in self.workers:
            rc = await w.stop(120)
            self.note(f"{w.name} stopped ({rc})")

    async def _rejected_at_least(self, n: int) -> bool:
        return await self.rejected() >= n

    async def _all_on(self, version: int, digest: str) -> bool:
        from slime_stoa.protocol.heartbeat import Heartbeat

        for w in self.workers:
            try:
                beat = Heartbeat.from_bytes(await self.direct.get_bytes(self.layout.heartbeat(w.worker_id)))
            except (NotFound, ValueError):
                return False
            if (beat.version, beat.state_digest) != (version, digest):
                return False
        return True

    def stop_all(self) -> None:
        for p in self.processes:
            if p.alive:
                p.kill()

    # -- the report --------------------------------------------------------------------------
    async def report(self) -> dict[str, Any]:
        assert self.learner is not None
        figures = await reconcile(
            self.direct, RUN, self.workers, self.learner, self.forger, staleness_limit=STALENESS, reuse_limit=REUSE
        )
        injected: Counter[str] = Counter(self.faults)
        for p in self.proxies:
            injected.update(p.faults_injected)
        injected.update(self.forger.injected)
        learner_exits = [(rc, how) for rc, how in self.learner.exits]
        worker_exits = [(w.name, rc, how) for w in self.workers for rc, how in w.exits]
        crashes = self.crashes["learner"] + sum(1 for rc, how in learner_exits if how == "stop" and rc != INTERRUPTED)
        worker_crashes = sum(v for k, v in self.crashes.items() if k != "learner")
        worker_crashes += sum(1 for _, rc, how in worker_exits if how == "stop" and rc != 0)
        return {
            "seed": self.seed,
            "plan": {"workers": self.plan.workers, "chaos_s": self.plan.chaos_s, "outage_s": list(self.plan.outage_s)},
            "faults_injected": dict(sorted(injected.items())),
            **figures,
            "trainer_crashes": crashes,
            "worker_crashes": worker_crashes,
            "processes_left": 0,
        }


def assert_reconciled(report: dict[str, Any], left: list[Any], seed: int, log: list[str]) -> str:
    """The end-of-run reconciliation every chaos test holds to: no process left, nothing lost,
    doubled, reused beyond the limit, mismatched or crashed, no invalid group used. Returns the
    seed-and-log text for the caller's own assertions."""
    where = f"seed {seed} (STOA_TEST_SEED={seed} replays it); log:\n" + "\n".join(log[-40:])
    assert left == [], f"{left}; {where}"
    for name in ("groups_lost", "duplicates", "reused_beyond_limit", "digest_mismatches", "trainer_crashes", "worker_crashes"):
        assert report[name] == 0, f"{name} = {report[name]}: {report['details']}; {where}"
    assert report["invalid_used"] == [], f"{report['invalid_used']}; {where}"
    return where


@pytest.mark.slow  # ~1-2 minutes on two cores: the short form runs with --slow (the long form: --slow --chaos-long)
async def test_a_run_survives_chaos(s3_server: Any, tmp_path: Path, chaos_plan: ChaosPlan) -> None:
    seed = random_seed()
    bucket = s3_server.create_bucket()
    run = ChaosRun(chaos_plan, seed, tmp_path, s3_server, bucket)
    report: dict[str, Any] = {}
    try:
        async with contextlib.AsyncExitStack() as stack:
            await stack.enter_async_context(run.direct)
            await run.start(stack)
            watchdog = asyncio.ensure_future(run.watchdog())
            network = asyncio.ensure_future(run.network())
            try:
                await run.chaos()
            finally:
                network.cancel()
                await asyncio.gather(network, return_exceptions=True)
            try:
                await run.finish()
            finally:
                watchdog.cancel()
                await asyncio.gather(watchdog, return_exceptions=True)
            report = await run.report()
    finally:
        run.stop_all()
        left = processes_left(run.processes, str(tmp_path))
        report["processes_left"] = len(left)
        if os.environ.get("STOA_CHAOS_JSON"):
            Path(os.environ["STOA_CHAOS_JSON"]).write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
        print(json.dumps(report, indent=2, sort_keys=True))
    where = assert_reconciled(report, left, seed, run.log)
    # Every kill happened and the forged records were refused.
    kills = report["faults_injected"]
    for point in ("generation", "spooling", "upload", "swap"):
        assert kills.get(f"kill_worker_{point}", 0) >= 1, f"no worker kill at {point}; {where}"
    assert kills.get("kill_learner_publish", 0) >= 1 and kills.get("kill_learner_consume", 0) >= 1, where
    assert sum(report["records_rejected"].values()) >= 5, f"{report['records_rejected']}; {where}"
    assert report["groups_finished"] == report["groups_in_bucket"] > 0, where
    # The workers' own account (their spool's log) covers the bucket, but for a group finished by
    # a worker killed between its spool write and the log line; a reserved seq never finished
    # (a kill between the two) is the only kind of gap.
    worker_kills = sum(v for k, v in kills.items() if k.startswith("kill_worker_"))
    assert report["finished_unlogged"] <= worker_kills, where
    assert sum(report["sequence_gaps"].values()) <= worker_kills, where
    assert report["groups_used"] > 0 and FORGER not in " ".join(report["invalid_used"]), where


@pytest.mark.slow  # ~45 s: python -m pytest --slow tests/chaos (the chaos run itself stays in the default suite)
async def test_a_learner_restarted_from_an_earlier_checkpoint(s3_server: Any, tmp_path: Path, chaos_plan: ChaosPlan) -> None:
    """Kill the learner mid-consume, restart it from the checkpoint of an earlier version (its
    learner state and the consumer state of then: `--restart-from`), and reconcile as above with
    staleness along the lineage: restored groups no staler than they are, none from the
    abandoned branch used, none used twice on the final lineage, and the consumer's count of
    groups used is that of the final lineage (it went back to the checkpoint's state)."""
    seed = random_seed()
    bucket = s3_server.create_bucket()
    run = ChaosRun(chaos_plan, seed, tmp_path, s3_server, bucket)
    report: dict[str, Any] = {}
    head = back = -1
    try:
        async with contextlib.AsyncExitStack() as stack:
            await stack.enter_async_context(run.direct)
            await run.start(stack)
            learner = run.learner
            assert learner is not None
            watchdog = asyncio.ensure_future(run.watchdog())
            try:
                await async_wait_until(lambda: learner.last_version() >= 5, message=run.learner_state, timeout=chaos_plan.wait_s)
                rollouts = run.layout.rollouts_prefix()
                trap = learner.proxy.hold(lambda m, p: m == "GET" and (key_of(p, run.prefix) or "").startswith(rollouts))
                await async_wait_until(trap.hit.is_set, message="the learner's next record download", timeout=chaos_plan.wait_s)
                await run.kill_at(learner, trap, land=False)
                head = json.loads(await run.direct.get_bytes(run.layout.pointer))["version"]
                back = head - 2  # its checkpoint is kept whatever the kill cut short
                run.note(f"SIGKILL learner mid-consume at v{head}; restarting it from the checkpoint of v{back}")
                learner.start(restart_from=back)
                await async_wait_until(
                    lambda: learner.said("restarts from the checkpoint"), message=run.learner_state, timeout=chaos_plan.wait_s
                )
                await async_wait_until(lambda: learner.last_version() >= head + 4, message=run.learner_state,
                                       timeout=chaos_plan.wait_s)  # fmt: skip
                await run.finish()
            finally:
                watchdog.cancel()
                await asyncio.gather(watchdog, return_exceptions=True)
            report = await run.report()
            restored = [g for e in learner.versions() if e["trainer_version"] > head for g in e["groups"]]
            report["used_after_restore"] = len(restored)
            report["used_after_restore_from_before"] = sum(g["weight_version"] <= back for g in restored)
    finally:
        run.stop_all()
        left = processes_left(run.processes, str(tmp_path))
        report["processes_left"] = len(left)
        print(json.dumps(report, indent=2, sort_keys=True))
    where = assert_reconciled(report, left, seed, run.log)
    # v<head+1> restored v<back>: a new epoch, and what was trained in between is a branch left behind.
    assert (report["epoch"], report["abandoned"]) == (1, [[back + 1, head]]), where
    assert report["final_version"] >= head + 4 and report["used_after_restore"] > 0, where
    assert report["groups_used_abandoned"] > 0, where
    assert report["groups_used_by_consumer"] == report["groups_used"], where
