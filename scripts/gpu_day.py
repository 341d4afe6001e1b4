"""One GPU, one afternoon, no internet: prove the trainer's GPU-side parts on a bare CUDA box.

    python scripts/gpu_day.py [--device auto|cuda|cpu] [--wheels DIR] [--budget 480] [--json PATH]
                              [--delta-shape published|smoke] [--delta-sample quick|full]
                              [--delta-versions 2] [--delta-density 0.015] [--threads N]

Needs torch (and numpy); no slime, no Megatron-LM checkout, no TransformerEngine. Prints one line per
check, PASS / FAIL / SKIP with why, and writes every figure to the JSON (default gpu-day.json):

  wheels          with --wheels DIR: every *.whl in DIR installed by `pip install --no-index --no-deps`
                  before the checks (SKIP without --wheels); scripts/gpu_day_wheels.txt and
                  gpu_day_wheels_transformers.txt list what a box with only torch needs
  cuda            torch sees a CUDA device (SKIP without one, FAIL with --device cuda)
  device_delta    `trainer.device_delta` as the slime publisher runs it by delta (the torch diff and
                  its old bits, each int8/int4 plane's step quantized where the weights live, the
                  new digests from each changed tensor read once; the previous version about half
                  on the device and half in pinned host memory) bit for bit the numpy path's
                  (`codec.diff`, `plane.updated_plane_bits`, `StateDigest.update`) at the LFM2.5-8B-A1B
                  shape (`macd.memory_plan.LFM2_5_8B_A1B`; `--delta-shape smoke`: a tiny width),
                  streamed tensor by tensor (host memory: one tensor's versions and planes), random
                  bf16 weights and `--delta-versions` sparse updates (`--delta-density` of the elements
                  move 1-3 units in the last place). Figures per version of the whole model: seconds and
                  bytes device -> host of each path (numpy: the whole bf16 state crosses, as the publisher
                  gathers it). `--delta-sample quick` streams the top-level tensors and the first layer of
                  each kind and counts each for the layers of its kind (`bench_stream8b.plan_units`);
                  `full` streams every tensor. Runs on the CPU too (the same code; PASS there).
  dppo_step       the CPU learner's DPPO step (`trainer.learner`, `trainer.loss`) on a tiny Qwen2: its
                  forward, token-mean DPPO loss and backward on the device vs on the CPU (loss, logprobs,
                  every gradient, the loss metrics), after proving the CPU computation equals
                  `Learner.step`'s own loss and gradient norm. Needs transformers.
  published_bits  the weight path end to end through the code the slime hook runs: the tiny Qwen2
                  learner steps on the device, a `DeviceCollector` diffs each version against the
                  `DevicePath`'s copy (half on the device, half pinned), `Publisher.publish_delta`
                  publishes it with its int8 and int4 planes to a local bucket; real Subscribers
                  install bf16 and each plane: bit for bit the learner's weights and `plane_bits` of
                  them, and a CPU reader of the installed bits gives the learner's logprobs.
  megatron_local  the LFM2 and LFM2-MoE Megatron providers (`trainer.slime.lfm2.spec`, Megatron's local
                  layer spec: no TransformerEngine) on tiny random models, float32: logits vs
                  transformers' on the same device, then one backward on both and every gradient mapped
                  to the HF names (`convert.iter_hf`, `param_map.checkpoint_slots`) compared; the fp32
                  expert biases unchanged. Needs megatron-core (SKIP without it: its 2.5 MB wheel,
                  `pip install --no-deps megatron_core-0.16.1-cp311-*.whl`, or put it in --wheels DIR).

Without a CUDA device, dppo_step and megatron_local run their comparison CPU against CPU (a
rehearsal of the code, figures in the JSON) and report SKIP "no CUDA device"; a rehearsal that does
not check out is a FAIL. A check whose package is missing is a SKIP naming it (the JSON lists every
missing package); a check that raises is a FAIL with the error (the traceback in the JSON).

Time: each check has its own cap (device_delta 300 s, dppo_step 90 s, megatron_local 150 s) and the
run a budget (`--budget`, 480 s): a check is cut between tensors or steps when either is spent (a
FAIL: raise --budget, or use --delta-sample quick), and a check with no time left is a FAIL "not
run". Not yet timed on a GPU box: the quick sample streams ~1.1 B of the model's 8.5 B weights, and
the numpy baseline took ~25 ns a weight a version on one CPU core here, so the defaults should take
two to four minutes there; the JSON has each check's seconds.

Exit status: 0 when every check that could run passed (SKIPs allowed), 1 otherwise, 2 for bad
arguments. docs/gpu-day.md has the commands for a bare GPU box and what each line does not prove.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.metadata
import importlib.util
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import traceback
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

REPO = Path(__file__).resolve().parents[1]
for _path in (REPO, REPO / "scripts"):  # stoa itself, and bench_stream8b beside this script
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from slime_stoa.protocol.fsutil import atomic_write  # the standard library only

CHECKS = ("wheels", "cuda", "device_delta", "dppo_step", "published_bits", "megatron_local")
#: Each check's own cap, seconds (the run's budget cuts it shorter).
CAPS = {"wheels": 120.0, "cuda": 30.0, "device_delta": 300.0, "dppo_step": 90.0, "published_bits": 60.0,
        "megatron_local": 150.0}
DEFAULT_BUDGET = 480.0
#: What the checks import besides the standard library (module -> the package to put in --wheels).
PACKAGES = {
    "numpy": "numpy", "torch": "torch", "xxhash": "xxhash", "zstandard": "zstandard", "msgspec": "msgspec",
    "cryptography": "cryptography", "_cffi_backend": "cffi", "transformers": "transformers",
    "tokenizers": "tokenizers", "safetensors": "safetensors", "megatron.core": "megatron-core",
}
#: The wheel sets for a box with only torch (docs/gpu-day.md): what every run needs (numpy included), and
#: transformers with its own for a box without it. Pinned requirements, one `pip download -r` each.
WHEEL_LISTS = (REPO / "scripts" / "gpu_day_wheels.txt", REPO / "scripts" / "gpu_day_wheels_transformers.txt")
WHEEL_HINT = "scripts/gpu_day_wheels*.txt list them"
MODEL_TYPE = "lfm2_moe"
QUANT: tuple[Literal["int8", "int4"], ...] = ("int8", "int4")  # the quantized planes
PLANES = ("bf16", *QUANT)
NO_CUDA = "no CUDA device"
#: float32 on both sides, different kernels (TF32 off): logprobs and logits in nats, gradients
#: relative to each tensor's largest gradient.
DPPO_TOLERANCE = {"loss": 1e-5, "logprob": 1e-4, "grad": 1e-3}
MEGATRON_TOLERANCE = {"logit": 1e-3, "grad": 1e-3}
#: The learner (bf16-rounded weights, float32 compute on the device, TF32 off) against a reader of
#: the published bits (float32 compute on the CPU): the same weights, so only the kernels differ,
#: as in dppo_step; the CPU rehearsal gives 0.
PUBLISHED_LOGPROB_BOUND = DPPO_TOLERANCE["logprob"]


class Skip(Exception):
    """The check cannot run here (a missing package, no CUDA device); its message says why."""


class OutOfTime(Exception):
    """The check's cap or the run's budget is spent."""


@dataclass
class Deadline:
    """When a check must stop: checked between units of work, never inside one."""

    end: float
    why: str

    def check(self, done: str) -> None:
        if time.monotonic() > self.end:
            raise OutOfTime(f"stopped: {self.why} is spent ({done})")


@dataclass
class Result:
    status: str  # PASS, FAIL or SKIP
    detail: str
    figures: dict[str, Any] = field(default_factory=dict)


def verdict(ok: bool, detail: str, figures: dict[str, Any], why_not_cuda: str | None) -> Result:
    """A comparison's result: on a CUDA device PASS or FAIL; on the CPU (`why_not_cuda`: a
    rehearsal of the comparison) SKIP when it checked out, FAIL when even the rehearsal did not."""
    if not ok:
        return Result("FAIL", detail, figures)
    if why_not_cuda is not None:
        return Result("SKIP", f"{why_not_cuda} (CPU rehearsal: {detail})", figures)
    return Result("PASS", detail, figures)


# -- the environment ------------------------------------------------------------------------------
def environment() -> dict[str, Any]:
    """Python, each package's version (None: not importable) and the missing ones."""
    versions: dict[str, str | None] = {}
    for module, dist in PACKAGES.items():
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:  # a parent package is missing
            found = False
        if not found:
            versions[dist] = None
            continue
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            versions[dist] = "unknown"
    return {"python": sys.version.split()[0], "executable": sys.executable, "packages": versions,
            "missing": sorted(d for d, v in versions.items() if v is None)}



def wheels_in(folder: Path) -> list[Path]:
    """The wheels of --wheels DIR; ValueError (one line) when there are none."""
    if not folder.is_dir():
        raise ValueError(f"--wheels {folder}: no such folder")
    found = sorted(folder.glob("*.whl"))
    if not found:
        raise ValueError(f"--wheels {folder}: no *.whl files in it")
    return found


def check_wheels(wheels: list[Path], deadline: Deadline) -> Result:
    cmd = [sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", *map(str, wheels)]
    timeout = max(1.0, deadline.end - time.monotonic())
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    importlib.invalidate_caches()
    names = [w.name for w in wheels]
    figures: dict[str, Any] = {"wheels": names, "pip_exit": proc.returncode, "pip_output_tail": proc.stdout[-2000:] + proc.stderr[-2000:]}
    installed: dict[str, str | None] = {}
    for wheel in wheels:
        dist = wheel.name.split("-")[0]
        try:
            installed[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            installed[dist] = None
    figures["installed"] = installed
    if proc.returncode != 0:
        last = (proc.stderr.strip() or proc.stdout.strip() or "no output").splitlines()[-1]
        return Result("FAIL", f"pip exited {proc.returncode}: {last}", figures)
    missing = sorted(d for d, v in installed.items() if v is None)
    if missing:
        return Result("FAIL", f"pip installed, but this Python does not find {', '.join(missing)}", figures)
    return Result("PASS", f"installed {len(wheels)} wheel(s): {', '.join(names)}", figures)


def check_cuda(device: str, why_not_cuda: str | None) -> Result:
    import torch

    figures: dict[str, Any] = {"torch": torch.__version__, "torch_cuda": torch.version.cuda, "device": device}
    if why_not_cuda is not None:
        return Result("SKIP", why_not_cuda, figures)
    props = torch.cuda.get_device_properties(0)
    figures.update(name=props.name, memory_bytes=int(props.total_memory), capability=f"{props.major}.{props.minor}")
    return Result("PASS", f"{props.name}, {props.total_memory / 2**30:.0f} GiB, torch {torch.__version__}", figures)


# -- device_delta ---------------------------------------------------------------------------------
def _sync(device: str) -> None:
    import torch

    if device != "cpu":
        torch.cuda.synchronize()


def first_version(name: str, shape: tuple[int, ...], gen: Any, device: str) -> Any:
    """Random bf16 weights on the device: norms near 1, other tensors N(0, 1/fan-in)."""
    import torch

    values = torch.randn(shape, generator=gen, device=device, dtype=torch.float32)
    if "norm" in name:
        values = values * 0.05 + 1.0
    else:
        values *= (shape[-1] if len(shape) > 1 else 16) ** -0.5
    return values.to(torch.bfloat16)


def next_version(weights: Any, density: float, gen: Any) -> Any:
    """`weights` with `density` of its elements (seeded positions) moved by 1-3 units in the last
    place, as an RL step's Adam update moves bf16 weights (a new tensor, on the same device)."""
    import torch

    bits = weights.view(torch.int16).reshape(-1).clone()
    k = round(bits.numel() * density)
    if k:
        where = torch.randint(0, bits.numel(), (k,), generator=gen, device=bits.device)
        flips = torch.randint(1, 4, (k,), generator=gen, device=bits.device, dtype=torch.int16)
        bits[where] = bits[where] ^ flips
    return bits.view(torch.bfloat16).reshape(weights.shape)


def check_device_delta(args: argparse.Namespace, device: str, deadline: Deadline) -> Result:
    import numpy as np
    import torch
    from bench_stream8b import SMOKE, param_shapes, plan_units, same_delta

    from macd.memory_plan import LFM2_5_8B_A1B
    from slime_stoa.protocol.pulse.codec import diff
    from slime_stoa.protocol.pulse.digest import StateDigest
    from slime_stoa.protocol.pulse.plane import plane_bits, updated_plane_bits
    from slime_stoa.protocol.pulse.step_diff import sparse_digest
    from slime_stoa.trainer.device_delta import DeviceDeltaConfig, PreviousState

    config = dict(LFM2_5_8B_A1B if args.delta_shape == "published" else SMOKE)
    shapes = param_shapes(config)
    # batches of at most --delta-batch-mib of bf16 (a larger tensor alone): the host holds one
    # batch's versions and planes at a time, and the numpy baseline runs a batch on its threads
    units, layers = plan_units(shapes, config, quick=args.delta_sample == "quick", batch_bytes=args.delta_batch_mib << 20)
    versions, threads = args.delta_versions, args.threads
    seconds = {"device": [0.0] * versions, "numpy": [0.0] * versions}
    to_host = {"device": [0] * versions, "numpy": [0] * versions}
    elements = changed = compared = mismatched = digests_off = streamed = on_device = kept_bytes = 0
    mismatched_names: list[str] = []

    def on_host(state: dict[str, Any]) -> dict[str, Any]:
        return {n: t.view(torch.int16).cpu().numpy().view(np.uint16) for n, t in state.items()}

    for unit in units:
        deadline.check(f"after {streamed} of {len(shapes) if args.delta_sample == 'full' else 'the sampled'} tensors")
        weight, size = unit.weight, sum(math.prod(shapes[n]) for n in unit.names)
        gens = {n: torch.Generator(device=device).manual_seed(args.seed * 2**32 + zlib.crc32(n.encode())) for n in unit.names}
        state = {n: first_version(n, shapes[n], gens[n], device) for n in unit.names}
        # the publisher's baseline on the host: the anchor's bf16 bits and planes (not timed)
        host = on_host(state)
        planes = {"bf16": host, **{q: plane_bits(host, q, MODEL_TYPE, threads=threads) for q in QUANT}}
        digests = {p: StateDigest.of(planes[p], threads=threads) for p in PLANES}  # the committed version's
        # about half of the batch kept beside the weights and the rest in pinned host memory (on a
        # GPU): the two places `stoa_device_budget_bytes` splits the previous version between
        previous = PreviousState(DeviceDeltaConfig(device_budget_bytes=size))
        previous.reset(state)
        on_device += weight * previous.device_bytes()
        kept_bytes += weight * 2 * size
        elements += weight * size
        streamed += len(unit.names)
        for v in range(versions):
            state = {n: next_version(t, args.delta_density, gens[n]) for n, t in state.items()}
            # the device path as the slime publisher runs it by delta: the diff, each plane's step
            # (both versions' planes quantized where the weights live), the old bits at the changed
            # indices, and each changed tensor (and plane tensor) read once for the new digest
            _sync(device)
            handed, started = previous.transfer.device_to_host, time.perf_counter()
            steps = {"bf16": previous.sparse_step(previous.diff(state))}
            for q in QUANT:
                steps[q] = previous.plane_step(q, MODEL_TYPE, device)
            ours = {p: sparse_digest(digests[p], steps[p], threads=threads) for p in PLANES}
            previous.commit()
            _sync(device)
            seconds["device"][v] += weight * (time.perf_counter() - started)
            to_host["device"][v] += weight * (previous.transfer.device_to_host - handed)
            # the numpy path: every bf16 weight to the host, then the diff, the planes' updates and
            # the digests there (`step_diff.diff_step`)
            started = time.perf_counter()
            new = {"bf16": on_host(state)}
            theirs = {"bf16": diff(host, new["bf16"], threads=threads)}
            touched = {n: indices for n, (indices, _) in theirs["bf16"].items()}
            for q in QUANT:
                new[q] = updated_plane_bits(planes[q], new["bf16"], touched, q, MODEL_TYPE, threads=threads)
                theirs[q] = diff(planes[q], new[q], threads=threads)
            expected = {p: digests[p].update(new[p], theirs[p].keys(), threads=threads) for p in PLANES}
            seconds["numpy"][v] += weight * (time.perf_counter() - started)
            to_host["numpy"][v] += weight * 2 * size
            # bit for bit: each plane's delta, the old bits at its indices, and the new digest
            for p in PLANES:
                compared += 1
                step, delta = steps[p], theirs[p]
                if not same_delta(step.delta, delta) or step.old.keys() != delta.keys() or any(
                        not np.array_equal(step.old[n], planes[p][n].reshape(-1)[delta[n][0]]) for n in delta):
                    mismatched += 1
                    names = sorted(set(step.delta) ^ set(delta) | {n for n in set(step.delta) & set(delta)
                                                                   if not same_delta({n: step.delta[n]}, {n: delta[n]})})
                    mismatched_names.append(f"v{v + 1} {p}: {', '.join(names[:3]) or 'old bits'}")
                digests_off += sum(ours[p].digests[n] != expected[p].digests[n] for n in expected[p].digests)
            changed += weight * sum(indices.size for indices, _ in theirs["bf16"].values())
            host, planes, digests = new["bf16"], new, expected
        del previous, state
    figures: dict[str, Any] = {
        "device": device, "shape": args.delta_shape, "sample": args.delta_sample, "layers_streamed": layers,
        "tensors_streamed": streamed, "batches": len(units), "batch_mib": args.delta_batch_mib, "model_tensors": len(shapes), "model_elements": sum(math.prod(s) for s in shapes.values()),
        "elements_per_version": elements, "versions": versions, "density": args.delta_density,
        "changed_fraction": changed / max(1, elements * versions), "threads": threads,
        "deltas_compared": compared, "deltas_mismatched": mismatched, "mismatched": mismatched_names[:20],
        "digests_mismatched": digests_off, "seconds_per_version": seconds, "bytes_device_to_host_per_version": to_host,
        "previous_on_device_fraction": on_device / max(1, kept_bytes),
        "scaling": "per version of the whole model: a sampled layer counts for every layer of its kind"
                   if args.delta_sample == "quick" else "every tensor streamed",
    }
    ok = compared > 0 and changed > 0 and mismatched == 0 and digests_off == 0 and elements == figures["model_elements"]
    med = {k: sorted(v)[len(v) // 2] for k, v in seconds.items()}
    mb = {k: sorted(v)[len(v) // 2] / 1e6 for k, v in to_host.items()}
    detail = (f"{device}: {compared - mismatched}/{compared} batch deltas bit-exact, {digests_off} digests off "
              f"({streamed} tensors x {versions} versions); per version (median) device {med['device']:.2f} s, "
              f"{mb['device']:.1f} MB to host; numpy {med['numpy']:.2f} s, {mb['numpy']:.1f} MB to host")
    if elements != figures["model_elements"]:
        detail += f"; the sample counts {elements} elements, the model has {figures['model_elements']}"
    return Result("PASS" if ok else "FAIL", detail, figures)


# -- dppo_step ------------------------------------------------------------------------------------
@dataclass
class StepTerms:
    loss: float
    grad_norm: float
    logprobs: list[Any]  # float32 numpy arrays, one per sequence
    grads: dict[str, Any]  # parameter name -> gradient (torch, on the CPU)
    metrics: dict[str, float]


def step_terms(learner: Any, groups: Sequence[Sequence[Any]], device: str) -> StepTerms:
    """`Learner.step`'s loss and gradients (one micro-batch, token mean) with the learner's model
    on `device`: its own forward (`_acting_params`, `_response_logprobs`) and `dppo_policy_loss`;
    no optimizer step."""
    import numpy as np
    import torch

    from slime_stoa.trainer.learner import group_advantages
    from slime_stoa.trainer.loss import dppo_policy_loss

    cfg = learner.config
    seqs = [s for g in groups for s in g]
    if len(seqs) > cfg.micro_batch or cfg.dppo.reduction != "token_mean":
        raise ValueError("step_terms reproduces one token-mean micro-batch")
    advantages = np.concatenate([group_advantages([s.reward for s in g], scale=cfg.scale_rewards) for g in groups])
    masks = [s.loss_mask() for s in seqs]
    total = int(sum(m.sum() for m in masks))
    learner.optimizer.zero_grad(set_to_none=True)
    with torch.device(device):  # the learner builds its token batch on the default device
        logps = learner._response_logprobs(seqs, learner._acting_params())
    lengths = [len(s.response) for s in seqs]

    def on(array: Any) -> Any:
        return torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32)).to(device)

    worker = on(np.concatenate([s.worker_logprobs for s in seqs]))
    per_token, metrics = dppo_policy_loss(torch.cat(logps), worker, on(np.repeat(advantages, lengths)),
                                          on(np.concatenate(masks)), cfg.dppo)
    loss = per_token.sum() / max(total, 1)
    loss.backward()
    grads = {n: p.grad.detach().cpu() for n, p in learner.model.named_parameters() if p.grad is not None}
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads.values()]))
    return StepTerms(float(loss.detach()), float(norm), [t.detach().cpu().numpy() for t in logps], grads,
                     {k: float(v) for k, v in metrics.items()})


def dppo_groups(learner: Any, vocab: int, seed: int) -> list[list[Any]]:
    """Two prompt groups of four: random tokens, rewards that differ within each group, worker
    logprobs the learner's own plus noise (ratios above the cap) and every fifth token one the
    worker found likely (probability 0.9: the trust region drops it where the advantage is
    negative), one sequence with tool tokens (mask 0)."""
    import numpy as np

    from slime_stoa.trainer.learner import TrainSequence

    rng = np.random.default_rng(seed)
    groups = []
    for rewards in ((1.0, 0.0, 0.0, 1.0), (0.0, 0.0, 1.0, 0.0)):
        prompt = rng.integers(3, vocab, size=int(rng.integers(4, 9)))
        group = []
        for i, reward in enumerate(rewards):
            response = rng.integers(3, vocab, size=int(rng.integers(5, 13)))
            mask = None if i else np.concatenate([np.ones(2), np.zeros(2), np.ones(len(response) - 4)]).astype(np.float32)
            own = learner.logprobs([TrainSequence(prompt, response, np.zeros(len(response), np.float32), reward)])[0]
            worker = np.minimum(own + rng.normal(0, 0.5, own.shape), -1e-3)
            worker[::5] = math.log(0.9)
            worker = worker.astype(np.float32)
            group.append(TrainSequence(prompt, response, worker, reward, mask))
        groups.append(group)
    return groups


def _rel_grad_diff(ours: dict[str, Any], theirs: dict[str, Any]) -> tuple[float, str]:
    """The largest gradient difference relative to its tensor's largest gradient, and where."""
    worst, where = 0.0, ""
    for name, want in theirs.items():
        got = ours[name].to(want.dtype)
        scale = float(want.abs().max()) or 1.0
        diff = float((got - want).abs().max()) / scale
        if diff > worst or not where:
            worst, where = max(worst, diff), name
    return worst, where


def check_dppo(args: argparse.Namespace, device: str, why_not_cuda: str | None, deadline: Deadline, workdir: Path) -> Result:
    import numpy as np
    import torch

    from slime_stoa.quickstart.tiny_model import build_tiny_model
    from slime_stoa.trainer.learner import Learner, LearnerConfig

    folder = build_tiny_model(workdir / "qwen2")
    vocab = int(json.loads((folder / "config.json").read_text())["vocab_size"])
    config = LearnerConfig()
    reference = Learner(folder, config)
    groups = dppo_groups(reference, vocab, args.seed)
    deadline.check("after building the model and the batch")
    cpu = step_terms(reference, groups, "cpu")
    stepped = reference.step(groups)  # the learner's own step: the CPU terms above must be its
    deadline.check("after the CPU step")
    other = Learner(folder, config)
    model: Any = other.model
    model.to(device)
    ours = step_terms(other, groups, device)
    with torch.device(device):  # the learner builds its token batch on the default device
        stepped_there = other.step(groups)  # Learner.step itself, its model on the device
    figures: dict[str, Any] = {"device": device, "sequences": sum(len(g) for g in groups), "tokens": stepped["tokens"],
                               "tolerances": DPPO_TOLERANCE, "cpu_loss": cpu.loss, "device_loss": ours.loss}
    figures["learner_step_loss"], figures["learner_step_grad_norm"] = stepped["loss"], stepped["grad_norm"]
    figures["cpu_terms_are_the_learner_step"] = (
        cpu.loss == stepped["loss"] and math.isclose(cpu.grad_norm, stepped["grad_norm"], rel_tol=1e-5))
    figures["loss_diff"] = abs(ours.loss - cpu.loss)
    figures["max_logprob_diff"] = max(float(np.abs(a - b).max()) for a, b in zip(ours.logprobs, cpu.logprobs, strict=True))
    figures["max_rel_grad_diff"], figures["max_rel_grad_diff_at"] = _rel_grad_diff(ours.grads, cpu.grads)
    figures["grad_norm"] = {"cpu": cpu.grad_norm, "device": ours.grad_norm}
    figures["metrics"] = {"cpu": cpu.metrics, "device": ours.metrics}
    figures["max_metric_diff"] = max(abs(ours.metrics[k] - v) for k, v in cpu.metrics.items())
    tokens = float(stepped["tokens"])
    figures["metric_allowance_used"] = max(metric_excess(k, ours.metrics[k], v, tokens) for k, v in cpu.metrics.items())
    figures["same_gradients"] = sorted(ours.grads) == sorted(cpu.grads)
    figures["learner_step"] = {"cpu": stepped, "device": stepped_there}
    figures["learner_step_allowance_used"] = {k: metric_excess(k, stepped_there[k], v, tokens)
                                              for k, v in stepped.items() if k in stepped_there}
    step_ok = stepped_there.keys() == stepped.keys() and all(u <= 1 for u in figures["learner_step_allowance_used"].values())
    ok = (step_ok and figures["cpu_terms_are_the_learner_step"] and figures["same_gradients"] and cpu.grad_norm > 0
          and figures["loss_diff"] <= DPPO_TOLERANCE["loss"] and figures["max_logprob_diff"] <= DPPO_TOLERANCE["logprob"]
          and figures["max_rel_grad_diff"] <= DPPO_TOLERANCE["grad"] and figures["metric_allowance_used"] <= 1)
    detail = (f"{device} vs cpu: loss diff {figures['loss_diff']:.1e}, logprobs {figures['max_logprob_diff']:.1e}, "
              f"gradients {figures['max_rel_grad_diff']:.1e} (relative), {len(cpu.grads)} tensors; "
              f"CPU terms {'are' if figures['cpu_terms_are_the_learner_step'] else 'are NOT'} Learner.step's; "
              f"Learner.step {'agrees' if step_ok else 'DIFFERS'} (loss, gradient norm, loss metrics)")
    return verdict(ok, detail, figures, why_not_cuda)


def metric_excess(key: str, ours: float, theirs: float, tokens: float) -> float:
    """How much of its allowance one loss metric's CPU-vs-device difference uses (at most 1 to
    agree): a count or a fraction of tokens (`*_frac`, `tokens`) may move by one token crossing a
    threshold; a ratio or gap statistic by the logprob tolerance, relative; the rest must be equal."""
    diff = abs(ours - theirs)
    if key.endswith("_frac"):
        return diff * tokens
    if key.startswith(("ratio_", "logprob_gap")):
        return diff / (DPPO_TOLERANCE["logprob"] * max(1.0, abs(theirs)))
    if key in ("loss", "grad_norm"):
        return diff / (DPPO_TOLERANCE["loss"] * (max(1.0, abs(theirs)) if key == "grad_norm" else 1.0))
    return 0.0 if diff == 0 else math.inf


# -- published_bits ------------------------------------------------------------------------------
def _device_logprobs(learner: Any, seqs: Sequence[Any], device: str) -> list[Any]:
    """The learner's tempered logprobs of each response with its model on `device` (`Learner.logprobs`
    reads them as numpy, which a CUDA tensor is not)."""
    import torch

    with torch.no_grad(), torch.device(device):
        params = {k: v.detach() for k, v in learner._acting_params().items()}
        return [t.detach().cpu().numpy() for t in learner._response_logprobs(list(seqs), params)]


def check_published_bits(args: argparse.Namespace, device: str, why_not_cuda: str | None, deadline: Deadline,
                         workdir: Path) -> Result:
    """The weight path end to end on the device, through the code the slime hook runs: the tiny
    Qwen2 learner steps on `device`; each version is gathered by a `DeviceCollector` (diffed there
    against the `DevicePath`'s copy of the published one, half of it kept on the device and half
    in pinned host memory) and published by delta with its int8 and int4 planes
    (`Publisher.publish_delta`, no host copy of the state or of a plane) to a local bucket. Real
    Subscribers install the bf16 weights and each plane: the bf16 state must equal the learner's
    weights bit for bit, each plane `plane.plane_bits` of them; a reader model on the CPU loaded
    with the installed bits must give the learner's logprobs within `PUBLISHED_LOGPROB_BOUND`."""
    import asyncio

    import numpy as np
    import torch

    from slime_stoa.protocol.pulse.plane import plane_bits
    from slime_stoa.protocol.pulse.publisher import Publisher, PublisherConfig
    from slime_stoa.protocol.pulse.subscriber import Subscriber
    from slime_stoa.protocol.store import open_store
    from slime_stoa.quickstart.tiny_model import build_tiny_model
    from slime_stoa.trainer.device_delta import bf16_view
    from slime_stoa.trainer.learner import Learner, LearnerConfig
    from slime_stoa.trainer.slime.device_publish import DeviceCollector, DevicePath
    from slime_stoa.trainer.slime.hf_names import HeadPlan

    folder = build_tiny_model(workdir / "qwen2-published")
    config_json = json.loads((folder / "config.json").read_text())
    vocab, model_type = int(config_json["vocab_size"]), str(config_json["model_type"])
    learner = Learner(folder, LearnerConfig())
    groups = dppo_groups(learner, vocab, args.seed)
    seqs = [s for g in groups for s in g]
    model: Any = learner.model
    model.to(device)
    reader = Learner(folder, LearnerConfig())  # a worker's model, on the CPU
    (workdir / "bucket").mkdir()
    figures: dict[str, Any] = {"device": device, "versions": args.delta_versions, "bound_nats": PUBLISHED_LOGPROB_BOUND,
                               "planes": list(QUANT), "bits_mismatched": [], "planes_mismatched": [],
                               "max_logprob_gap": [], "changed": [], "anchored": []}

    def weights() -> dict[str, Any]:
        return {n: p.detach() for n, p in model.named_parameters()}

    def trainer_bits() -> dict[str, Any]:
        return {n: bf16_view(n, t).cpu().numpy().view(np.uint16) for n, t in weights().items()}

    def mismatched(installed: dict[str, Any] | None, expected: dict[str, Any]) -> list[str]:
        got = installed or {}
        off = sorted(n for n, b in expected.items() if not np.array_equal(got.get(n), b))
        return (off + sorted(set(got) - set(expected)))[:5]

    async def run() -> None:
        async with open_store(f"file://{workdir / 'bucket'}") as store:
            publisher = Publisher(store, "gpu-day", PublisherConfig(anchor_every=2, planes=QUANT, model_type=model_type))
            await publisher.publish(trainer_bits())  # the first version: an anchor from a host copy
            size = sum(t.numel() * 2 for t in weights().values())
            path = DevicePath(device_budget_bytes=size // 2)  # half on the device, half pinned
            assert publisher.state_digest is not None
            path.adopt(publisher.release_baseline(), publisher.state_digest, planes=QUANT, model_type=model_type)
            subscribers = {"bf16": Subscriber(store, "gpu-day"),
                           **{q: Subscriber(store, "gpu-day", plane=q) for q in QUANT}}
            for v in range(1, args.delta_versions + 1):
                deadline.check(f"after {v - 1} versions")
                step_terms(learner, groups, device)  # the DPPO gradients, on the device
                learner.optimizer.step()
                collector = DeviceCollector(path, HeadPlan())
                collector.add(list(weights().items()))  # one chunk, as slime's iterator yields them
                handed = collector.finish()
                result = await publisher.publish_delta(handed.step, base=handed.base, planes=handed.planes)
                assert publisher.state_digest is not None
                path.published(handed, publisher.state_digest)
                for p, subscriber in subscribers.items():
                    if await subscriber.sync() is None or subscriber.state is None or subscriber.version != v:
                        raise AssertionError(f"the {p} subscriber did not install v{v}")
                expected = trainer_bits()
                figures["bits_mismatched"].append(mismatched(subscribers["bf16"].state, expected))
                figures["planes_mismatched"].append(
                    {q: mismatched(subscribers[q].state, plane_bits(expected, q, model_type)) for q in QUANT})
                figures["changed"].append(result.changed)
                figures["anchored"].append(result.anchored)
                installed_state = subscribers["bf16"].state
                assert installed_state is not None
                for name, p in reader.model.named_parameters():
                    installed = torch.from_numpy(installed_state[name].view(np.int16)).view(torch.bfloat16)
                    p.data.copy_(installed.to(torch.float32).reshape(p.shape))
                ours, theirs = _device_logprobs(learner, seqs, device), reader.logprobs(seqs)
                figures["max_logprob_gap"].append(
                    max(float(np.abs(a - b).max()) for a, b in zip(ours, theirs, strict=True)))
            figures["bytes_device_to_host"] = path.transfer.device_to_host
            figures["previous_on_device_bytes"] = path.previous.device_bytes()

    asyncio.run(run())
    gap = max(figures["max_logprob_gap"])
    bits_ok = not any(figures["bits_mismatched"])
    planes_ok = not any(off for by_plane in figures["planes_mismatched"] for off in by_plane.values())
    ok = bits_ok and planes_ok and gap <= PUBLISHED_LOGPROB_BOUND and all(figures["changed"]) \
        and any(figures["anchored"])
    detail = (f"{device}: {args.delta_versions} versions published by delta through the device path, installed "
              f"state {'==' if bits_ok else '!='} the learner's bf16 weights bit for bit, int8 and int4 planes "
              f"{'==' if planes_ok else '!='} plane_bits of them; logprob gap learner vs CPU reader {gap:.1e} nats "
              f"(bound {PUBLISHED_LOGPROB_BOUND:g})")
    return verdict(ok, detail, figures, why_not_cuda)


# -- megatron_local -------------------------------------------------------------------------------
@contextlib.contextmanager
def megatron_on(device: str) -> Iterator[None]:
    """Megatron's process groups (one process, parallelism 1/1) for a model on `device`: on the CPU
    `lfm2.cpu.megatron_on_cpu`; on CUDA an NCCL group of one and Megatron's CUDA RNG seeded."""
    from slime_stoa.trainer.slime.lfm2.cpu import _free_port, megatron_on_cpu

    if device == "cpu":
        with megatron_on_cpu():
            yield
        return
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    torch.cuda.set_device(0)
    started = not dist.is_initialized()
    if started:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ["MASTER_PORT"] = str(_free_port())
        dist.init_process_group("nccl", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(0)
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()
        if started:
            dist.destroy_process_group()


def megatron_family(family: str, device: str, workdir: Path) -> dict[str, Any]:
    """One family: logits and gradients of the provider's local-spec model vs transformers'."""
    import torch
    import transformers
    from safetensors.torch import load_file

    from slime_stoa.quickstart.tiny_model import build_tiny_family
    from slime_stoa.trainer.param_map import checkpoint_slots
    from slime_stoa.trainer.slime.lfm2 import spec
    from slime_stoa.trainer.slime.lfm2.convert import Lfm2Shape, iter_hf
    from slime_stoa.trainer.slime.lfm2.cpu import causal_mask

    folder = build_tiny_family(workdir / family, family)
    hf_cfg = json.loads((folder / "config.json").read_text())
    state = load_file(str(folder / "model.safetensors"))
    hf: Any = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    hf = hf.to(device).train()
    length = 24
    ids = torch.randint(0, hf_cfg["vocab_size"], (2, length), generator=torch.Generator().manual_seed(0)).to(device)

    def loss_of(logits: Any) -> Any:  # next-token cross-entropy, the same on both sides
        return torch.nn.functional.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))

    with megatron_on(device):
        config = spec.transformer_config(hf_cfg, use_cpu_initialization=True, params_dtype=torch.float32,
                                         moe_token_dispatcher_type="allgather")
        model: Any = spec.build_model(config, hf_cfg, vocab_size=hf_cfg["vocab_size"], max_sequence_length=256, use_te=False)
        shape = Lfm2Shape.from_hf(hf_cfg)
        spec.load_hf_state(model, state, shape)
        model = model.to(device).train()
        bias = {n: b.detach().clone() for n, b in model.named_buffers() if n.endswith("expert_bias")}
        positions = torch.arange(length, device=device)[None].expand(2, length)
        logits = model(ids, positions, attention_mask=causal_mask(length).to(device))
        want = hf(ids).logits
        logit_diff = float((logits.detach() - want.detach()).abs().max())
        loss_of(logits).backward()
        loss_of(want).backward()
        ours = dict(iter_hf([(n, p.grad.detach().cpu()) for n, p in model.named_parameters() if p.grad is not None], shape))
        kept = all(b.dtype == torch.float32 and torch.equal(b, bias[n]) for n, b in model.named_buffers() if n in bias)
    names = [n for n in state if not n.endswith("expert_bias")]  # buffers: no gradient
    slots = checkpoint_slots(hf, names, {n: tuple(state[n].shape) for n in names})
    grads = {n: p.grad for n, p in hf.named_parameters() if p.grad is not None}
    theirs = {n: slot.view(grads).detach().cpu() for n, slot in slots.items() if slot.tensor in grads}
    same_names = sorted(ours) == sorted(theirs) == sorted(names)
    grad_diff, at = _rel_grad_diff(ours, theirs) if same_names else (math.inf, "names differ")
    return {"logits_shape": list(logits.shape), "max_logit_diff": logit_diff, "max_rel_grad_diff": grad_diff,
            "max_rel_grad_diff_at": at, "tensors_compared": len(theirs), "same_names": same_names,
            "expert_bias_fp32_unchanged": kept, "expert_biases": len(bias),
            "pass": same_names and kept and logit_diff <= MEGATRON_TOLERANCE["logit"] and grad_diff <= MEGATRON_TOLERANCE["grad"]}


def check_megatron(device: str, why_not_cuda: str | None, deadline: Deadline, workdir: Path) -> Result:
    try:
        import megatron.core  # noqa: F401
    except ImportError as exc:
        raise Skip(f"megatron-core not importable ({exc}); install its wheel: pip install --no-deps "
                   "megatron_core-0.16.1-cp311-*.whl, or put it in --wheels DIR") from exc
    figures: dict[str, Any] = {"device": device, "layer_spec": "local", "tolerances": MEGATRON_TOLERANCE,
                               "megatron_core": importlib.metadata.version("megatron-core")}
    for family in ("lfm2", "lfm2_moe"):
        deadline.check(f"before {family}")
        figures[family] = megatron_family(family, device, workdir)
    ok = all(figures[f]["pass"] for f in ("lfm2", "lfm2_moe"))
    detail = ", ".join(f"{f}: logits {figures[f]['max_logit_diff']:.1e}, gradients {figures[f]['max_rel_grad_diff']:.1e}"
                       for f in ("lfm2", "lfm2_moe"))
    return verdict(ok, f"{device} vs transformers, local spec, float32: {detail}", figures, why_not_cuda)


# -- the run --------------------------------------------------------------------------------------
def run_check(name: str, fn: Callable[[Deadline], Result], run_end: float, budget: float) -> Result:
    """`fn` under its cap and the budget left; every way it can end becomes one Result."""
    now = time.monotonic()
    if run_end - now <= 0:
        return Result("FAIL", f"not run: the time budget (--budget {budget:g} s) is spent")
    cap_end = now + CAPS[name]
    deadline = Deadline(min(cap_end, run_end), f"its cap ({CAPS[name]:g} s)" if cap_end <= run_end
                        else f"the time budget (--budget {budget:g} s)")
    started = time.monotonic()
    try:
        result = fn(deadline)
    except Skip as exc:
        result = Result("SKIP", str(exc))
    except ModuleNotFoundError as exc:
        top = (exc.name or "").split(".")[0]
        if top in ("slime_stoa", "macd", "bench_stream8b", "benchlib") or not top:
            result = Result("FAIL", f"{type(exc).__name__}: {exc}", {"traceback": traceback.format_exc()})
        else:
            result = Result("SKIP", f"missing package {exc.name} (put its wheel in --wheels DIR; {WHEEL_HINT})")
    except OutOfTime as exc:
        result = Result("FAIL", str(exc))
    except Exception as exc:  # a broken check is reported, never hides the others
        result = Result("FAIL", f"{type(exc).__name__}: {exc}", {"traceback": traceback.format_exc()})
    result.figures["seconds"] = round(time.monotonic() - started, 3)
    return result


def report(name: str, result: Result) -> None:
    print(f"{result.status:<5} {name:<15} {result.detail}", flush=True)


def resolve_device(requested: str) -> tuple[str, str | None]:
    """The device the checks run on, and why CUDA is not it (None when it is)."""
    try:
        import torch
    except ImportError:
        return "cpu", "torch not importable"
    if requested == "cpu":
        return "cpu", "--device cpu"
    if torch.cuda.is_available():
        return "cuda", None
    return "cpu", NO_CUDA


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                        help="auto: CUDA when torch sees it; cuda: no CUDA device is a FAIL")
    parser.add_argument("--wheels", type=Path, help="install every *.whl here (pip --no-index --no-deps) first")
    parser.add_argument("--budget", type=float, default=DEFAULT_BUDGET, help="seconds for the whole run")
    parser.add_argument("--json", type=Path, default=Path("gpu-day.json"), help="write every figure here")
    parser.add_argument("--delta-shape", choices=("published", "smoke"), default="published")
    parser.add_argument("--delta-sample", choices=("quick", "full"), default="quick")
    parser.add_argument("--delta-versions", type=int, default=2)
    parser.add_argument("--delta-density", type=float, default=0.015)
    parser.add_argument("--delta-batch-mib", type=int, default=256, help="bf16 MiB streamed at a time")
    parser.add_argument("--threads", type=int, default=min(8, os.cpu_count() or 1),
                        help="threads of the numpy baseline (the publisher's `threads`)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", help="comma-separated checks to run (the others are not reported)")
    args = parser.parse_args(argv)
    if not args.budget > 0:
        parser.error(f"--budget must be positive, got {args.budget:g}")
    if min(args.delta_versions, args.threads, args.delta_batch_mib) < 1:
        parser.error("--delta-versions, --delta-batch-mib and --threads must be at least 1")
    if not 0 < args.delta_density <= 1:
        parser.error(f"--delta-density must be in (0, 1], got {args.delta_density:g}")
    args.only = tuple(args.only.split(",")) if args.only else CHECKS
    if unknown := sorted(set(args.only) - set(CHECKS)):
        parser.error(f"--only: unknown checks {unknown}; known: {', '.join(CHECKS)}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        wheels = wheels_in(args.wheels) if args.wheels is not None else None
    except ValueError as exc:
        print(f"gpu_day: error: {exc}", file=sys.stderr)
        return 2
    started = time.monotonic()
    run_end = started + args.budget
    results: dict[str, Result] = {}
    if "wheels" in args.only:  # before anything imports what the wheels bring
        results["wheels"] = (Result("SKIP", "no --wheels DIR given") if wheels is None else
                             run_check("wheels", lambda d: check_wheels(wheels, d), run_end, args.budget))
        report("wheels", results["wheels"])
    env = environment()
    device, why = resolve_device(args.device)
    if device == "cuda":  # float32 comparisons: no TF32 rounding in matrix products or convolutions
        import torch

        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    print(f"gpu_day: python {env['python']}, torch {env['packages']['torch']}, device {device}"
          f"{f' ({why})' if why else ''}; missing packages: {', '.join(env['missing']) or 'none'}", flush=True)
    with tempfile.TemporaryDirectory(prefix="stoa-gpu-day-") as tmp:
        workdir = Path(tmp)
        checks: dict[str, Callable[[Deadline], Result]] = {
            "cuda": lambda d: check_cuda(device, why),
            "device_delta": lambda d: check_device_delta(args, device, d),
            "dppo_step": lambda d: check_dppo(args, device, why, d, workdir),
            "published_bits": lambda d: check_published_bits(args, device, why, d, workdir),
            "megatron_local": lambda d: check_megatron(device, why, d, workdir),
        }
        for name in CHECKS[1:]:
            if name not in args.only:
                continue
            if device == "cpu" and args.device == "cuda":
                results[name] = Result("FAIL", f"{why} (--device cuda)" if name == "cuda" else f"not run: {why} (--device cuda)")
            else:
                results[name] = run_check(name, checks[name], run_end, args.budget)
            report(name, results[name])
    ok = all(r.status != "FAIL" for r in results.values())
    doc = {"pass": ok, "device": device, "why_not_cuda": why, "budget_s": args.budget,
           "seconds": round(time.monotonic() - started, 3), "environment": env,
           "arguments": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
           "checks": {n: {"status": r.status, "detail": r.detail, **r.figures} for n, r in results.items()}}
    atomic_write(args.json, (json.dumps(doc, indent=2, default=str) + "\n").encode(), durable=False)
    print(f"gpu_day: {'every check that could run passed' if ok else 'a check FAILED'} "
          f"({doc['seconds']:.0f} s); figures in {args.json}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
