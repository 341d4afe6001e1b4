"""Benchmark PULSE: patch size against a full sync and the closest peer's layout, and receive time
against a fresh anchor fetch, all in one run.

Trajectories (bf16 casts of fp32 master weights after each optimizer step):

- `adam`: Qwen2.5-1.5B tensor shapes (hidden 1536, MLP 8960, 12 query / 2 KV heads of 128, tied
  embeddings) with the layers and the vocabulary scaled down together (default 2 of 28 layers,
  109M parameters, 218 MB of bf16; `--quick` 1 layer, 110 MB), updated by simulated AdamW steps
  (betas 0.9/0.999, weight decay 0.01, lr 1e-6) on noisy gradients: a persistent signal (`--snr`
  times the noise) plus fresh Gaussian noise every step, the optimizer state at its steady state.
  Changes accumulate faster with staleness here than on real runs (published: ~2.3x the k=1
  density at k=32), so its k=4 and k=16 rows are denser than real ones.
- `torch`: a sparse "pretrained-like" trajectory: a small torch transformer LM (3.4M parameters)
  trained for real with torch's AdamW — a warm-up (40 steps) at lr 1e-3 on a synthetic bigram language
  (pretraining), then steps on a shifted language at a learning rate calibrated so that ~0.9% of
  the bf16 weights change per step.
- `synthetic`: the one reference step of the research notes (5.1).

Layouts, for the patch from version v-k to v (k = 1, 4, 16): PULSE with base-relative values
(`rel`: what step patches carry) and with new values (`abs`: what catch-up patches carry), the
deployed layout of the closest peer (grail's
sparse_codec v3.1, reimplemented here from its description: per tensor 2-D COO coordinates,
rows gap-coded, columns gap-coded within a row, each downcast to the smallest of uint8 / uint16 /
int32 that holds it, raw bf16 values, a JSON header, everything in one zstd-1 frame), and a flat
int32 gap-coded layout with raw bf16 values. Bits per changed element count the patch body and
its index as it travels in the version manifest.

Receive case (`adam` trajectory, through a local store by default, `--s3` a loopback S3 server):
a real Publisher (base-relative steps, catch-up patches, anchors at v0 and at the head v17)
publishes every version while a follower syncs each one: `sync_s_step` is the median wall time
of `Subscriber.sync()` (pointer GET, manifest, patch GET, verify, apply, digest), `apply_s_step`
the best time of verify + decode + apply of the same patches already in memory. Subscribers that
followed until 4 and 16 versions behind then reach the head: path choice picks one; every alternative path is
timed too (each on its own copy of the state). `anchor_s`: a fresh subscriber syncing to the
head, which is an anchor, timed in the same rounds. Receive times are medians (with min and max)
of `--repeat` interleaved rounds (every path, then the anchor, per round; the machine may be
shared); `sync_over_apply_median` is the median 1-step sync over the median in-memory apply.
`lagger_download_over_best_measured`: per lag (1, 4, 16), the bytes the lagger's chosen path
downloads over the cheapest of the chain, the catch-up and the anchor, and their max.

Lag sweep (`adam` trajectory again, its own run with the default `PublisherConfig`: catch-ups at
powers of two from the anchor within 1.5x the step bytes): versions 0..33, one anchor interval.
`catchup_bytes_over_step`: the catch-up bytes published over v1..v33 over the step bytes;
`lagger_download_over_best`: for every lag 1..32 from the head v33, the bytes of the path the
subscriber picks (planned from the manifests, with the follower's measured speeds) over the
cheapest of the chain, each catch-up plus the steps after it, and the anchor path, computed here
from the manifests alone; the max over the lags. The codec table's encode / apply speeds are
best-of.

Usage: python scripts/bench_pulse.py [--quick] [--layers N] [--s3] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import dataclasses
import json
import math
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import zstandard

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchlib import (
    Incomplete,
    Session,
    exit_code,
    exit_on_signals,
    on_signal_exit,
    print_spreads,
    ratio,
    require,
    spread,
    write_json,
)

from slime_stoa.protocol.pulse.apply import ChangedIndices, apply_patch
from slime_stoa.protocol.pulse.codec import (
    Delta,
    bf16_bits_to_float32,
    diff,
    float32_to_bf16_bits,
    rel_codes,
    shapes_of,
)
from slime_stoa.protocol.pulse.digest import state_digest
from slime_stoa.protocol.pulse.frames import MODES, PatchIndex, encode_patch, frame_slice
from slime_stoa.protocol.pulse.publisher import Publisher, PublisherConfig
from slime_stoa.protocol.pulse.subscriber import Subscriber
from slime_stoa.protocol.pulse.version_patches import STEP_MODE
from slime_stoa.protocol.store import open_store

State = dict[str, np.ndarray]
HIDDEN, MLP, HEADS, KV_HEADS, HEAD_DIM, VOCAB, LAYERS = 1536, 8960, 12, 2, 128, 151936, 28
LAGS = (1, 4, 16)
HEAD = max(LAGS) + 1  # the head version; v0 is the first anchor
RUN = "bench"


# ---------------------------------------------------------------------------------------------
# Trajectories


def qwen_shapes(layers: int) -> dict[str, tuple[int, ...]]:
    """Qwen2.5-1.5B parameter shapes with `layers` layers and the vocabulary scaled alike."""
    vocab = math.ceil(VOCAB * layers / LAYERS)
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    shapes = {"model.embed_tokens.weight": (vocab, HIDDEN), "model.norm.weight": (HIDDEN,)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (HIDDEN,),
            p + "self_attn.q_proj.weight": (q, HIDDEN),
            p + "self_attn.q_proj.bias": (q,),
            p + "self_attn.k_proj.weight": (kv, HIDDEN),
            p + "self_attn.k_proj.bias": (kv,),
            p + "self_attn.v_proj.weight": (kv, HIDDEN),
            p + "self_attn.v_proj.bias": (kv,),
            p + "self_attn.o_proj.weight": (HIDDEN, q),
            p + "post_attention_layernorm.weight": (HIDDEN,),
            p + "mlp.gate_proj.weight": (MLP, HIDDEN),
            p + "mlp.up_proj.weight": (MLP, HIDDEN),
            p + "mlp.down_proj.weight": (HIDDEN, MLP),
        }
    return shapes


class AdamW:
    """AdamW on the fp32 masters of one tensor, with a steady-state optimizer state."""

    CHUNK = 1 << 16  # elements per pass: temporaries stay in cache

    def __init__(self, master: np.ndarray, rng: np.random.Generator, snr: float) -> None:
        self.w = master.reshape(-1)
        n = self.w.size
        # Gradient = persistent signal + unit noise; moments start at their steady state.
        self.signal = snr * rng.standard_normal(n, dtype=np.float32)
        m_std = math.sqrt((1 - 0.9) / (1 + 0.9))
        self.m = self.signal + m_std * rng.standard_normal(n, dtype=np.float32)
        self.v = np.square(self.signal) + np.float32(1.0)

    def step(self, rng: np.random.Generator, lr: float, b1=0.9, b2=0.999, eps=1e-8, wd=0.01) -> None:
        """One step (bias corrections are ~1 deep into a run)."""
        g = np.empty(self.CHUNK, dtype=np.float32)
        t = np.empty(self.CHUNK, dtype=np.float32)
        for start in range(0, self.w.size, self.CHUNK):
            part = slice(start, start + self.CHUNK)
            w, m, v = self.w[part], self.m[part], self.v[part]
            gg, tt = g[: w.size], t[: w.size]
            rng.standard_normal(dtype=np.float32, out=gg)
            gg += self.signal[part]
            m *= b1
            np.multiply(gg, 1 - b1, out=tt)
            m += tt
            np.square(gg, out=gg)
            gg *= 1 - b2
            v *= b2
            v += gg
            np.sqrt(v, out=tt)
            tt += eps
            np.divide(m, tt, out=tt)
            tt *= lr
            w *= 1 - lr * wd
            w -= tt


def init_masters(shapes: dict[str, tuple[int, ...]], rng: np.random.Generator) -> State:
    """fp32 masters: N(0, 0.02) matrices and biases, ~1 norm gains. They are not rounded to
    bf16, as deep into a run, so the published bf16 cast sits anywhere between two steps."""
    masters = {}
    for name, shape in shapes.items():
        if name.endswith("norm.weight"):
            masters[name] = rng.lognormal(0.0, 0.3, shape).astype(np.float32)
        else:
            masters[name] = rng.normal(0.0, 0.02, shape).astype(np.float32)
    return masters


def simulate(shapes, steps: int, lr: float, snr: float, seed: int) -> Iterator[State]:
    """The bf16 states of versions 0..steps of simulated AdamW."""
    rng = np.random.default_rng(seed)
    masters = init_masters(shapes, rng)
    optims = [AdamW(w, rng, snr) for w in masters.values()]
    for step in range(steps + 1):
        if step:
            for opt in optims:
                opt.step(rng, lr)
        yield {n: float32_to_bf16_bits(w) for n, w in masters.items()}


def torch_trajectory(steps: int, *, warmup: int, density: float, seed: int) -> tuple[list[State], dict]:
    """States 0..steps of a small torch LM fine-tuned with AdamW after a pretraining warm-up.

    The fine-tuning learning rate is calibrated (two trial steps, rolled back) so that about
    `density` of the bf16 weights change per step."""
    import torch

    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    vocab, dim, layers, seq, batch = 2048, 256, 3, 32, 8
    torch.set_num_threads(min(4, torch.get_num_threads()))

    class TinyLM(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(vocab, dim)
            self.layers = torch.nn.ModuleList(
                torch.nn.TransformerEncoderLayer(dim, 4, 4 * dim, dropout=0.0, batch_first=True, norm_first=True)
                for _ in range(layers)
            )
            self.norm = torch.nn.LayerNorm(dim)
            self.head = torch.nn.Linear(dim, vocab, bias=False)

        def forward(self, x):
            mask = torch.nn.Transformer.generate_square_subsequent_mask(x.shape[1])
            h = self.embed(x)
            for layer in self.layers:
                h = layer(h, src_mask=mask, is_causal=True)
            return self.head(self.norm(h))

    def language(k: int = 8) -> np.ndarray:
        """A bigram language: each token is followed by one of k tokens (table of successors)."""
        return rng.integers(0, vocab, (vocab, k))

    def sample(successors: np.ndarray) -> torch.Tensor:
        x = np.empty((batch, seq + 1), dtype=np.int64)
        x[:, 0] = rng.integers(0, vocab, batch)
        for t in range(seq):
            x[:, t + 1] = successors[x[:, t], rng.integers(0, successors.shape[1], batch)]
        return torch.from_numpy(x)

    model = TinyLM()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.999), weight_decay=0.01)

    def step(x: torch.Tensor) -> float:
        logits = model(x[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), x[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        return float(loss.detach())

    def snap() -> State:
        return {n: float32_to_bf16_bits(p.detach().numpy()) for n, p in model.named_parameters()}

    def set_lr(lr: float) -> None:
        for group in opt.param_groups:
            group["lr"] = lr

    pretrain = language()
    start = time.perf_counter()
    losses = [step(sample(pretrain)) for _ in range(warmup)]
    finetune = np.where(rng.random((vocab, 8)) < 0.5, pretrain, language())  # a shifted language
    # Calibrate (secant steps on log density against log lr; each trial step is rolled back).
    saved = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    before, probe = snap(), sample(finetune)
    elements = sum(a.size for a in before.values())
    trials: list[tuple[float, float]] = []
    lr = 1e-5
    for _ in range(4):
        set_lr(lr)
        step(probe)
        got = max(sum(i.size for i, _ in diff(before, snap()).values()) / elements, 1e-9)
        model.load_state_dict(saved[0])
        opt.load_state_dict(saved[1])
        trials.append((math.log(lr), math.log(got)))
        slope = 1.0
        if len(trials) > 1 and trials[-1][0] != trials[-2][0]:
            slope = (trials[-1][1] - trials[-2][1]) / (trials[-1][0] - trials[-2][0])
            slope = min(max(slope, 0.5), 2.0)
        lr = math.exp(trials[-1][0] + (math.log(density) - trials[-1][1]) / slope)
    # Burn-in steps, each correcting the rate: density drifts as Adam's moments adapt to the new
    # data (proportional corrections: the local slope is close to 1 and noisy to estimate).
    for _ in range(3):
        set_lr(lr)
        before = snap()
        step(sample(finetune))
        got = max(sum(i.size for i, _ in diff(before, snap()).values()) / elements, 1e-9)
        lr *= density / got
    set_lr(lr)
    states = [snap()]
    for _ in range(steps):
        step(sample(finetune))
        states.append(snap())
    info = {
        "params": int(sum(p.numel() for p in model.parameters())), "warmup_steps": warmup,
        "warmup_loss": [losses[0], losses[-1]] if losses else [], "finetune_lr": lr,
        "seconds": time.perf_counter() - start,
    }
    return states, info


def synthetic_step(tensors: int, lr: float, seed: int) -> tuple[State, State]:
    """The reference synthetic workload (research notes 5.1): N(0, 0.02) bf16 weights, one step
    of lr * min(|N(0, 0.7)|, 1.41) with a random sign, on 4096 x 4096 tensors."""
    rng = np.random.default_rng(seed)
    base, new = {}, {}
    for t in range(tensors):
        w = float32_to_bf16_bits(rng.normal(0.0, 0.02, (4096, 4096)).astype(np.float32))
        step = lr * np.minimum(np.abs(rng.normal(0.0, 0.7, w.shape)), 1.41) * rng.choice([-1, 1], w.shape)
        base[f"w{t}"] = w
        new[f"w{t}"] = float32_to_bf16_bits(bf16_bits_to_float32(w) + step.astype(np.float32))
    return base, new


# ---------------------------------------------------------------------------------------------
# Baseline layouts


def _smallest(codes: np.ndarray, choices: tuple[type, ...]) -> type:
    top = int(codes.max()) if codes.size else 0
    return next(t for t in choices if top <= np.iinfo(t).max)


def peer_v31_patch(delta: Delta, shapes: dict[str, tuple[int, ...]], level: int = 1) -> bytes:
    """The closest peer's deployed layout (grail sparse_codec v3.1), from its description: per
    tensor (sorted by name) a 2-D view [shape[0], rest] (1-D: [n, 1]); rows gap-coded (first
    absolute); columns absolute at each row start and gap-coded within a row; rows downcast to
    uint8/uint16/int32 and columns to uint16/int32, whichever is smallest for the tensor; values
    raw bf16; a length-prefixed JSON header; the whole buffer in one zstd frame."""
    meta, chunks, offset = [], [], 0
    for name in sorted(delta):
        flat, values = delta[name]
        shape = shapes[name]
        per_row = math.prod(shape[1:]) if len(shape) >= 2 else 1
        rows, cols = np.divmod(flat, per_row)
        row_codes = np.diff(rows, prepend=0)
        starts = np.ones(rows.size, dtype=bool)
        starts[1:] = row_codes[1:] != 0
        col_codes = np.where(starts, cols, np.diff(cols, prepend=0))
        row_t = _smallest(row_codes, (np.uint8, np.uint16, np.int32))
        col_t = _smallest(col_codes, (np.uint16, np.int32))
        parts = [row_codes.astype(row_t).tobytes(), col_codes.astype(col_t).tobytes(), values.astype("<u2").tobytes()]
        meta.append({"name": name, "shape": list(shape), "num_nonzero": int(flat.size), "value_dtype": "bfloat16",
                     "row_dtype": np.dtype(row_t).name, "col_dtype": np.dtype(col_t).name, "offset": offset,
                     "sizes": [len(p) for p in parts]})
        chunks += parts
        offset += sum(len(p) for p in parts)
    header = json.dumps({"version": 31, "tensors": meta}, separators=(",", ":")).encode()
    raw = len(header).to_bytes(4, "little") + header + b"".join(chunks)
    return zstandard.ZstdCompressor(level=level).compress(raw)


def peer_v31_apply(blob: bytes, state: State) -> None:
    """Decode `peer_v31_patch` (vectorised) and assign the values in place."""
    raw = zstandard.ZstdDecompressor().decompress(blob)
    size = int.from_bytes(raw[:4], "little")
    data = memoryview(raw)[4 + size :]
    for t in json.loads(raw[4 : 4 + size])["tensors"]:
        n, (rs, cs, vs), at = t["num_nonzero"], t["sizes"], t["offset"]
        row_codes = np.frombuffer(data[at : at + rs], dtype=t["row_dtype"]).astype(np.int64)
        col_codes = np.frombuffer(data[at + rs : at + rs + cs], dtype=t["col_dtype"]).astype(np.int64)
        values = np.frombuffer(data[at + rs + cs : at + rs + cs + vs], dtype="<u2")
        rows = np.cumsum(row_codes)
        starts = np.ones(n, dtype=bool)
        starts[1:] = row_codes[1:] != 0
        run = np.cumsum(col_codes)
        first = np.flatnonzero(starts)
        cols = run - (run[first] - col_codes[first])[np.cumsum(starts) - 1]  # cumsum restarted per row
        shape = t["shape"]
        per_row = math.prod(shape[1:]) if len(shape) >= 2 else 1
        state[t["name"]].reshape(-1)[rows * per_row + cols] = values


def flat_patch(delta: Delta, level: int = 1) -> bytes:
    """One zstd frame over a JSON header plus, per tensor, int32 gap-coded flat indices (first
    absolute) and raw bf16 values."""
    header = json.dumps([[n, int(i.size)] for n, (i, _) in delta.items()]).encode()
    parts = [len(header).to_bytes(4, "little"), header]
    for indices, values in delta.values():
        parts.append(np.diff(indices, prepend=0).astype("<i4").tobytes())
        parts.append(values.astype("<u2").tobytes())
    return zstandard.ZstdCompressor(level=level).compress(b"".join(parts))


# ---------------------------------------------------------------------------------------------
# Measurements


def timed(fn: Callable[[], Any], repeat: int) -> tuple[float, Any]:
    """Best wall time of `repeat` runs, and the last result."""
    best, result = math.inf, None
    for _ in range(repeat):
        start = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - start)
    return best, result


def all_frames(index: PatchIndex, body: bytes) -> dict[int, bytes]:
    return {i: frame_slice(index, i, body) for i in range(len(index.frames))}


def apply_times(state: State, index: PatchIndex, body: bytes, repeat: int) -> list[float]:
    """verify + decode + apply times of `repeat` runs; the state is rolled back after each run."""
    frames = all_frames(index, body)
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        undo = apply_patch(state, index, frames)
        times.append(time.perf_counter() - start)
        undo.rollback(state)
    return times


def time_apply(state: State, index: PatchIndex, body: bytes, repeat: int) -> float:
    """Best verify + decode + apply time."""
    return min(apply_times(state, index, body, repeat))


def index_bytes(index: PatchIndex) -> int:
    """Bytes the index adds to the version manifest."""
    return len(json.dumps(index.to_json(), separators=(",", ":")))


def entropy_bits(counts: np.ndarray) -> float:
    """Order-0 entropy in bits per symbol of a histogram."""
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log2(p)).sum())


def floors(base: State, delta: Delta, elements: int) -> tuple[float, float]:
    """Order-0 floors in bits per changed element: index bound H(p)/p plus the entropy of the
    new values ("abs") or of the relative codes ("rel")."""
    changed = sum(i.size for i, _ in delta.values())
    p = changed / elements
    index = entropy_bits(np.array([p, 1 - p])) / p if 0 < p < 1 else 0.0
    new_hist = np.zeros(1 << 16, dtype=np.int64)
    rel_hist = np.zeros(1 << 16, dtype=np.int64)
    for name, (indices, values) in delta.items():
        new_hist += np.bincount(values, minlength=1 << 16)
        rel_hist += np.bincount(rel_codes(base[name].reshape(-1)[indices], values), minlength=1 << 16)
    return index + entropy_bits(new_hist), index + entropy_bits(rel_hist)


def run_case(label: str, base: State, new: State, repeat: int, *, speed: bool = True) -> dict:
    """Encode the patch base -> new in every layout (and time encode and apply if `speed`)."""
    state_bytes = sum(a.nbytes for a in new.values())
    elements = state_bytes // 2
    delta = diff(base, new)
    changed = max(1, sum(i.size for i, _ in delta.values()))
    abs_floor, rel_floor = floors(base, delta, elements)
    row: dict = {"case": label, "state_mb": state_bytes / 1e6, "changed": changed,
                 "density": changed / elements, "abs_floor_bits": abs_floor, "rel_floor_bits": rel_floor}
    work = {n: a.copy() for n, a in base.items()}
    for key in MODES:  # "abs" and "rel"
        index, body = encode_patch(base, new, threads=1, mode=key)
        row[f"{key}_bytes"] = len(body) + index_bytes(index)
        row[f"{key}_index_bits"] = 8 * index_bytes(index) / changed
        row[f"{key}_bits_per_changed"] = 8 * row[f"{key}_bytes"] / changed
        undo = apply_patch(work, index, all_frames(index, body))
        require(all(np.array_equal(work[n], new[n]) for n in new), f"{label}: the {key} round trip differs")
        undo.rollback(work)
        if speed:
            enc_s, _ = timed(partial(encode_patch, base, new, threads=1, mode=key), repeat)
            enc_mt_s, mt = timed(partial(encode_patch, base, new, mode=key), repeat)
            require(mt == (index, body), f"{label}: the {key} encoding depends on the thread count")
            row[f"{key}_encode_mb_s"] = state_bytes / 1e6 / enc_s
            row[f"{key}_encode_mb_s_mt"] = state_bytes / 1e6 / enc_mt_s
            row[f"{key}_apply_s"] = time_apply(work, index, body, max(repeat, 3))
    shapes = shapes_of(new)
    peer_s, blob = timed(lambda: peer_v31_patch(diff(base, new), shapes), repeat if speed else 1)
    check = {n: a.copy() for n, a in base.items()}
    peer_apply_s, _ = timed(lambda: peer_v31_apply(blob, check), 1)
    require(all(np.array_equal(check[n], new[n]) for n in new), f"{label}: the peer v3.1 round trip differs")
    row["peer_v31_bytes"] = len(blob)
    row["peer_v31_bits_per_changed"] = 8 * len(blob) / changed
    row["flat_bits_per_changed"] = 8 * len(flat_patch(delta)) / changed
    row["rel_ratio_vs_full"] = state_bytes / row["rel_bytes"]
    row["peer_ratio_vs_full"] = state_bytes / row["peer_v31_bytes"]
    row["rel_gain_vs_peer"] = row["peer_v31_bytes"] / row["rel_bytes"]
    row["abs_gain_vs_peer"] = row["peer_v31_bytes"] / row["abs_bytes"]
    if speed:
        row["peer_encode_mb_s"] = state_bytes / 1e6 / peer_s
        row["peer_apply_s"] = peer_apply_s
    return row


# ---------------------------------------------------------------------------------------------
# Receive case


@asynccontextmanager
async def bench_store(use_s3: bool):
    """A local store in a temp folder, or a bucket on a loopback S3 server."""
    with tempfile.TemporaryDirectory(prefix="stoa-bench-") as tmp:
        if not use_s3:
            async with open_store(f"file://{tmp}") as store:
                yield store, "local store (file://, temp folder)"
            return
        from tests.s3server import LocalS3Server

        with LocalS3Server() as server:
            on_signal_exit(server.stop)  # SIGTERM / SIGHUP end the process without unwinding
            bucket = server.create_bucket()
            creds = server.credentials()
            env = {"AWS_ACCESS_KEY_ID": creds.access_key_id, "AWS_SECRET_ACCESS_KEY": creds.secret_access_key}
            async with open_store(f"s3://{bucket}/bench?endpoint={server.endpoint_url}", environ=env) as store:
                yield store, "loopback S3 server (SeaweedFS)"


def clone(sub: Subscriber) -> Subscriber:
    """A subscriber at the same verified state, with the same measured speeds."""
    twin = Subscriber(sub.store, sub.layout.run, sub.config)
    assert sub.state is not None
    twin.state = {n: a.copy() for n, a in sub.state.items()}
    twin.version, twin.digest, twin.current = sub.version, sub.digest, sub.current
    twin.meter.speeds = sub.meter.speeds
    return twin


async def download_over_best(sub: Subscriber, target) -> dict[str, Any]:
    """Bytes of the path `sub` takes to the target over the cheapest of the chain of step patches
    (walked whether or not path choice considered it), the catch-up patch and the anchor path."""
    plans = await sub._plans(target)
    assert sub.version is not None
    options: dict[str, int] = {}
    for p in plans:  # the cheapest plan of each name (catch-ups at several versions share one)
        options[p.name] = min(p.cost, options.get(p.name, p.cost))
    chain = await sub._chain(target, sub.version)
    if chain:
        options["chain"] = sum(ref.bytes for ref in chain)
    best = min(options.values())
    return {"taken": plans[0].name, "bytes": plans[0].cost, "options": options, "best_bytes": best,
            "ratio": plans[0].cost / best}


async def reach_head(sub: Subscriber, target, expected: str, repeat: int) -> tuple[list[dict], list[float]]:
    """Every path `sub` could take to the target, ranked as path choice ranks them (the first is
    the one it takes), each timed on a copy of the state, and a fresh subscriber's sync (pointer,
    manifest, anchor): `repeat` rounds, interleaved; min / median / max of each."""
    plans = await sub._plans(target)  # the ranked plans, as sync() would try them
    speeds = sub.meter.speeds  # what they were ranked with
    times: list[list[float]] = [[] for _ in range(len(plans) + 1)]
    for _ in range(repeat):
        for i, plan in enumerate(plans):
            twin = clone(sub)
            start = time.perf_counter()
            await twin._execute(plan, target, None)  # a plain subscriber: it writes its own state
            times[i].append(time.perf_counter() - start)
            require(twin.digest is not None and twin.digest.root() == expected,
                    f"the {plan.name} path did not reach the head's state digest")
            del twin
        fresh = Subscriber(sub.store, RUN)
        start = time.perf_counter()
        got = await fresh.sync()
        times[-1].append(time.perf_counter() - start)
        require(got is not None and got.path == "anchor" and fresh.digest is not None,
                f"a fresh subscriber did not reach the head by its anchor ({got.path if got else 'nothing synced'})")
        del fresh
    rows = [{"path": plan.name, "taken": i == 0, "bytes": plan.cost, "seconds": statistics.median(times[i]),
             "spread": spread(times[i]), "estimate_s": plan.estimate_s, "speeds": dataclasses.asdict(speeds)}
            for i, plan in enumerate(plans)]
    return rows, times[-1]


SWEEP_HEAD = 33  # lags 1..32 behind it, all after the anchor at v0


def cheapest_bytes(manifests: dict[int, Any], base: int, head: int) -> int:
    """The fewest bytes from version `base` to `head` by the manifests alone: the chain of step
    patches, a catch-up covering `base` plus the steps after it, or the anchor plus the cheapest
    of those from it."""

    def steps(lo: int) -> int:
        return sum(manifests[v].patch("step").bytes for v in range(lo + 1, head + 1))

    def from_state(b: int) -> int:
        options = [steps(b)]
        for c in range(b + 1, head + 1):
            cu = manifests[c].patch("catchup")
            if cu is not None and cu.covers(b):
                options.append(cu.bytes + steps(c))
        return min(options)

    target = manifests[head]
    a = target.anchor.version
    return min(from_state(base), target.anchor_bytes + (from_state(a) if a < head else 0))


async def lag_sweep(layers: int, lr: float, snr: float, seed: int, use_s3: bool) -> dict[str, Any]:
    """Publish v0..SWEEP_HEAD with the default publisher config; the upload bound and, for every
    lag 1..SWEEP_HEAD - 1, the chosen path's bytes over the cheapest (module docstring)."""
    async with bench_store(use_s3) as (store, _):
        pub, follower = Publisher(store, "sweep"), Subscriber(store, "sweep")
        digests, manifests = {}, {}
        step_bytes = catchup_bytes = 0
        for v, state in enumerate(simulate(qwen_shapes(layers), SWEEP_HEAD, lr, snr, seed)):
            result = await pub.publish(state)
            require(not result.anchored or v == 0, f"the lag sweep published an anchor at v{v}: it must stay "
                    "within one anchor interval")
            step_bytes += result.patch_bytes
            catchup_bytes += result.catchup_bytes
            await follower.sync()
            digests[v], manifests[v] = follower.digest, follower.current
        target = manifests[SWEEP_HEAD]
        lags = {}
        for lag in range(1, SWEEP_HEAD):
            planner = Subscriber(store, "sweep")
            planner.version, planner.digest, planner.current = SWEEP_HEAD - lag, digests[SWEEP_HEAD - lag], manifests[SWEEP_HEAD - lag]
            planner.meter.speeds = follower.meter.speeds
            chosen = (await planner._plans(target))[0]
            best = cheapest_bytes(manifests, SWEEP_HEAD - lag, SWEEP_HEAD)
            lags[str(lag)] = {"taken": chosen.name, "bytes": chosen.cost, "best_bytes": best, "ratio": chosen.cost / best}
        return {
            "catchup_versions": [v for v in range(1, SWEEP_HEAD + 1) if manifests[v].patch("catchup")],
            "step_bytes": step_bytes, "catchup_bytes": catchup_bytes,
            "catchup_bytes_over_step": catchup_bytes / step_bytes,
            "lags": lags, "lagger_download_over_best": max(d["ratio"] for d in lags.values()),
        }


def old_changed(logs) -> dict[str, np.ndarray]:
    """The bookkeeping this replaced: np.unique over each tensor's concatenated indices."""
    parts: dict[str, list[np.ndarray]] = {}
    for undo in logs:
        for entry in undo.entries:
            parts.setdefault(entry.name, []).append(entry.indices)
    return {name: np.unique(np.concatenate(p)) for name, p in parts.items()}


async def receive_case(layers: int, lr: float, snr: float, seed: int, repeat: int, use_s3: bool) -> tuple[dict, dict]:
    """Publish versions 0..HEAD of the adam trajectory and measure the receivers; returns the
    results and the states kept for the codec table (HEAD - k for k in LAGS, and HEAD)."""
    keep = {HEAD - k for k in LAGS} | {HEAD}
    kept: dict[int, State] = {}
    config = PublisherConfig(anchor_every=HEAD, anchor_fraction=100.0)
    async with bench_store(use_s3) as (store, where):
        pub, follower = Publisher(store, RUN, config), Subscriber(store, RUN)
        laggers = {k: Subscriber(store, RUN) for k in LAGS}  # lag 1: download bytes only
        sync_s, publish_s = [], []
        for v, state in enumerate(simulate(qwen_shapes(layers), HEAD, lr, snr, seed)):
            start = time.perf_counter()
            await pub.publish(state)
            publish_s.append(time.perf_counter() - start)
            start = time.perf_counter()
            result = await follower.sync()
            seconds = time.perf_counter() - start
            require(result is not None and result.version == v, f"the follower did not reach v{v}")
            if v:
                require(result is not None and result.path == "step",
                        f"the follower reached v{v} by {result.path if result else None}, not its step patch")
                sync_s.append(seconds)
            for k, sub in laggers.items():
                if v <= HEAD - k:  # follows (and measures its speeds) until it falls behind
                    await sub.sync()
            if v in keep:
                kept[v] = state
        target = follower.current
        if target is None or target.anchor.version != HEAD:
            raise Incomplete(f"the follower's head is not the anchor published at v{HEAD}")
        step = target.patch("step")
        if step is None or step.index.mode != STEP_MODE:
            raise Incomplete(f"v{HEAD} has no {STEP_MODE} step patch")
        body = await store.get_bytes(step.key)
        base = {n: a.copy() for n, a in kept[HEAD - 1].items()}
        apply_all = apply_times(base, step.index, body, max(repeat, 5))
        undo = apply_patch(base, step.index, all_frames(step.index, body))
        lazy_s, _ = timed(lambda: dict(ChangedIndices([undo]).items()), 3)
        unique_s, _ = timed(lambda: old_changed([undo]), 1)
        assert follower.digest is not None
        rehash_s, _ = timed(lambda: follower.digest.update(base, undo.touched), max(repeat, 5))
        downloads = {str(k): await download_over_best(sub, target) for k, sub in laggers.items()}
        paths: dict[int, list[dict]] = {}
        fresh_s: list[float] = []
        for k, sub in laggers.items():
            if k > 1:
                paths[k], fresh = await reach_head(sub, target, pub.state_digest or "", repeat)
                fresh_s += fresh
        sync_spread, apply_spread, anchor_spread = spread(sync_s), spread(apply_all), spread(fresh_s)
        out = {
            "store": where, "state_mb": target.elements * 2 / 1e6, "step_bytes": step.bytes,
            "step_changes": step.count, "sync_s_step": sync_spread["median"], "sync_s_best": sync_spread["min"],
            "sync_s_median": sync_spread["median"], "sync_s_all": sync_s, "sync_s_spread": sync_spread,
            "apply_s_step": apply_spread["median"], "apply_s_spread": apply_spread,
            "sync_over_apply_median": ratio(sync_spread["median"], apply_spread["median"]),
            "rehash_s_step": rehash_s, "anchor_s_spread": anchor_spread,
            "lagger_download_over_best_measured": {"lags": downloads,
                                                   "max": max(d["ratio"] for d in downloads.values())},
            "changed_s_lazy_all": lazy_s, "changed_s_np_unique": unique_s,
            "publish_s_median": statistics.median(publish_s[1:]), "anchor_s": anchor_spread["median"],
            "anchor_bytes": target.anchor_bytes, "paths": {str(k): rows for k, rows in paths.items()},
        }
        for k, rows in paths.items():
            taken = rows[0]
            out[f"catchup_s_{k}"] = taken["seconds"]
            out[f"catchup_path_{k}"] = taken["path"]
            out[f"catchup_best_s_{k}"] = min(r["seconds"] for r in rows)
            out[f"catchup_over_anchor_{k}"] = ratio(taken["seconds"], anchor_spread["median"])
        return out, kept


# ---------------------------------------------------------------------------------------------
# Output

SIZE_COLUMNS = [
    ("case", "case", "{}"),
    ("density", "density", "{:.3%}"),
    ("rel_bytes", "rel MB", "{:.3f}", 1e-6),
    ("rel_bits_per_changed", "rel b/chg", "{:.2f}"),
    ("abs_bits_per_changed", "abs b/chg", "{:.2f}"),
    ("peer_v31_bits_per_changed", "peer v3.1 b/chg", "{:.2f}"),
    ("flat_bits_per_changed", "flat b/chg", "{:.2f}"),
    ("rel_floor_bits", "rel floor", "{:.2f}"),
    ("abs_floor_bits", "abs floor", "{:.2f}"),
    ("rel_index_bits", "rel index b", "{:.3f}"),
    ("rel_gain_vs_peer", "rel vs peer", "{:.2f}x"),
    ("rel_ratio_vs_full", "rel vs full", "{:.0f}x"),
    ("peer_ratio_vs_full", "peer vs full", "{:.0f}x"),
]
SPEED_COLUMNS = [
    ("case", "case", "{}"),
    ("rel_encode_mb_s", "rel enc MB/s 1t", "{:.0f}"),
    ("rel_encode_mb_s_mt", "rel enc mt", "{:.0f}"),
    ("abs_encode_mb_s", "abs enc 1t", "{:.0f}"),
    ("peer_encode_mb_s", "peer enc 1t", "{:.0f}"),
    ("rel_apply_s", "rel apply s", "{:.3f}"),
    ("abs_apply_s", "abs apply s", "{:.3f}"),
    ("peer_apply_s", "peer apply s", "{:.3f}"),
]


def print_table(rows: list[dict], columns) -> None:
    rows = [r for r in rows if all(key in r for key, *_ in columns)]
    cells = [[fmt.format(r[key] * (scale[0] if scale else 1)) for key, _, fmt, *scale in columns] for r in rows]
    heads = [head for _, head, *_ in columns]
    widths = [max(len(h), *(len(c[j]) for c in cells)) for j, h in enumerate(heads)]
    print("  ".join(h.rjust(w) for h, w in zip(heads, widths, strict=True)))
    for c in cells:
        print("  ".join(v.rjust(w) for v, w in zip(c, widths, strict=True)))


def print_receive(r: dict) -> None:
    print(f"\nReceive, {r['state_mb']:.0f} MB model through a {r['store']}, step patch {r['step_bytes'] / 1e6:.2f} MB "
          f"({r['step_changes']} changes, {STEP_MODE}):")
    lines = [
        ("1-step sync (median of {})".format(len(r["sync_s_all"])), "step", r["step_bytes"], r["sync_s_step"], None),
        ("  verify + decode + apply a step patch in memory (median)", "", r["step_bytes"], r["apply_s_step"], None),
        ("  re-hash the tensors it touched (sequential)", "", 0, r["rehash_s_step"], None),
        ("  changed indices, every tensor (was np.unique: {:.3f} s)".format(r["changed_s_np_unique"]), "", 0,
         r["changed_s_lazy_all"], None),
    ]
    for k, rows in r["paths"].items():
        for row in rows:
            mark = "taken" if row["taken"] else "alternative"
            lines.append((f"{k} behind: {mark}", row["path"], row["bytes"], row["seconds"], row["estimate_s"]))
    lines.append(("fresh subscriber: anchor fetch (the head is an anchor; median)", "anchor", r["anchor_bytes"],
                  r["anchor_s"], None))
    width = max(len(line[0]) for line in lines)
    print(f"{'':{width}}  {'path':>15}  {'MB':>8}  {'seconds':>8}  {'estimate':>8}")
    for what, path, nbytes, seconds, estimate in lines:
        est = f"{estimate:8.3f}" if estimate is not None else " " * 8
        print(f"{what:{width}}  {path:>15}  {nbytes / 1e6:8.2f}  {seconds:8.3f}  {est}")
    spreads = {"1-step sync": r["sync_s_spread"], "in-memory apply": r["apply_s_spread"],
               "anchor fetch": r["anchor_s_spread"]}
    for k, rows in r["paths"].items():
        spreads |= {f"{k} behind: {row['path']}": row["spread"] for row in rows}
    print_spreads("receive times, min / median / max (interleaved rounds)", spreads, digits=3)
    lag = r["lagger_download_over_best_measured"]
    print("lagger download / cheapest of chain, catch-up, anchor: " + ", ".join(
        f"{k} behind {d['ratio']:.2f} ({d['taken']})" for k, d in lag["lags"].items()) + f"; max {lag['max']:.2f}")


def main(argv: list[str] | None = None) -> int:
    return exit_code(lambda: bench(argv), "bench_pulse")


def bench(argv: list[str] | None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="1 layer (110 MB), short torch warm-up, 1 synthetic tensor")
    parser.add_argument("--layers", type=int, help="Qwen2.5-1.5B layers to keep (default 2: 218 MB; 28 = full)")
    parser.add_argument("--lr", type=float, default=1e-6, help="simulated AdamW learning rate (default 1e-6)")
    parser.add_argument("--snr", type=float, default=0.1, help="simulated gradient signal / noise (default 0.1)")
    parser.add_argument("--density", type=float, default=0.009, help="torch trajectory target density per step")
    parser.add_argument("--warmup", type=int, help="torch pretraining steps (default 40, quick 20)")
    parser.add_argument("--s3", action="store_true", help="receive through a loopback S3 server, not a local store")
    parser.add_argument("--repeat", type=int, help="interleaved timing rounds (default 5, quick 3)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    layers = args.layers or (1 if args.quick else 2)
    repeat = args.repeat or (3 if args.quick else 5)
    started = time.perf_counter()
    session = Session()

    shapes = qwen_shapes(layers)
    params = sum(math.prod(s) for s in shapes.values())
    print(f"adam: Qwen2.5-1.5B shapes, {layers}/{LAYERS} layers, vocab {shapes['model.embed_tokens.weight'][0]}: "
          f"{params / 1e6:.1f}M params ({2 * params / 1e6:.0f} MB bf16); AdamW lr {args.lr:g}, snr {args.snr:g}")
    with exit_on_signals():
        receive, kept = asyncio.run(receive_case(layers, args.lr, args.snr, args.seed, repeat, args.s3))
    print(f"receive case: {HEAD + 1} versions simulated, published and synced ({time.perf_counter() - started:.0f} s)")
    with exit_on_signals():
        sweep = asyncio.run(lag_sweep(layers, args.lr, args.snr, args.seed, args.s3))
    print(f"lag sweep: {SWEEP_HEAD + 1} versions, catch-ups at {sweep['catchup_versions']}: catch-up / step bytes "
          f"{sweep['catchup_bytes_over_step']:.2f}; lagger download / cheapest, max over lags 1..{SWEEP_HEAD - 1}: "
          f"{sweep['lagger_download_over_best']:.2f} ({time.perf_counter() - started:.0f} s)")
    hash_s, _ = timed(partial(state_digest, kept[HEAD]), repeat)
    rows = [run_case(f"adam k={k}", kept[HEAD - k], kept[HEAD], repeat, speed=k == 1) for k in LAGS]
    state_mb = rows[0]["state_mb"]
    del kept
    print(f"adam cases encoded ({time.perf_counter() - started:.0f} s)")

    warmup = args.warmup if args.warmup is not None else (20 if args.quick else 40)
    states, torch_info = torch_trajectory(max(LAGS), warmup=warmup, density=args.density, seed=args.seed)
    print(f"torch: {torch_info['params'] / 1e6:.1f}M-param transformer LM, {warmup} AdamW warm-up steps "
          f"(loss {torch_info['warmup_loss'][0]:.2f} -> {torch_info['warmup_loss'][-1]:.2f}), then lr "
          f"{torch_info['finetune_lr']:.3g} ({torch_info['seconds']:.0f} s)" if warmup else "torch: no warm-up")
    last = len(states) - 1
    torch_rows = [run_case(f"torch k={k}", states[last - k], states[last], repeat, speed=False) for k in LAGS]
    del states
    synth = run_case("synthetic", *synthetic_step(1 if args.quick else 3, 1.2e-6, args.seed), repeat)
    table = rows + torch_rows + [synth]
    print()
    print_table(table, SIZE_COLUMNS)
    print("\nb/chg = bits per changed element (patch body + index as carried in the manifest); rel = base-relative "
          "(step patches), abs = new values (catch-up patches);\n"
          "peer v3.1 = grail sparse_codec v3.1 layout (reimplemented); flat = int32 gap-coded flat indices + raw "
          "bf16; floor = order-0 bound; vs full = full bf16 state / patch.\n")
    print_table(table, SPEED_COLUMNS)
    print(f"enc = diff + encode, MB/s of model state (1t: one thread, mt: thread pool); apply = verify + decode + "
          f"apply in place; state digest {state_mb / hash_s:.0f} MB/s.")
    print_receive(receive)
    head = torch_rows[0]
    print(f"\nheadline (torch k=1, {head['density']:.3%} density): step patches (rel) {head['rel_bits_per_changed']:.2f} "
          f"b/chg, {head['rel_ratio_vs_full']:.0f}x smaller than a full sync; peer v3.1 "
          f"{head['peer_v31_bits_per_changed']:.2f} b/chg. Medians: sync/apply = "
          f"{receive['sync_over_apply_median']:.2f}; catch-up 4 / anchor = "
          f"{receive['catchup_over_anchor_4']:.2f}, 16 / anchor = "
          f"{receive['catchup_over_anchor_16']:.2f}. Total {time.perf_counter() - started:.0f} s.")
    session.print_load()

    summary = {
        **session.meta(), "repeat": repeat,
        "scale": {"layers": layers, "params": params, "lr": args.lr, "snr": args.snr},
        "torch": torch_info,
        "default_mode": STEP_MODE,
        "density": head["density"],
        "default_bits_per_changed": head["rel_bits_per_changed"],
        "abs_bits_per_changed": head["abs_bits_per_changed"],
        "peer_v31_bits_per_changed": head["peer_v31_bits_per_changed"],
        "default_ratio_vs_full": head["rel_ratio_vs_full"],
        "sync_s_step": receive["sync_s_step"],
        "apply_s_step": receive["apply_s_step"],
        "sync_over_apply_median": receive["sync_over_apply_median"],
        "catchup_over_anchor_4": receive["catchup_over_anchor_4"],
        "catchup_over_anchor_16": receive["catchup_over_anchor_16"],
        "lagger_download_over_best_measured": receive["lagger_download_over_best_measured"]["max"],
        "catchup_bytes_over_step": sweep["catchup_bytes_over_step"],
        "lagger_download_over_best": sweep["lagger_download_over_best"],
        "lag_sweep": sweep,
        "catchup_s_4": receive["catchup_s_4"],
        "catchup_s_16": receive["catchup_s_16"],
        "anchor_s": receive["anchor_s"],
        "hash_mb_s": state_mb / hash_s,
        "receive": receive,
        "cases": table,
    }
    if args.json:
        write_json(args.json, summary)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
