"""Benchmark the PULSE codec on a model-shaped state updated by simulated AdamW steps.

Workload: Qwen2.5-1.5B tensor shapes (hidden 1536, MLP 8960, 12 query / 2 KV heads of 128, tied
embeddings), with the number of layers and the vocabulary scaled down together (default 4 of 28
layers and 4/28 of the 151,936-token vocabulary, 0.22B parameters, ~5 GB of RAM; `--quick` keeps
1 layer, 55M parameters; `--layers 28` is the real size and needs ~40 GB). fp32 master weights
take AdamW steps (betas 0.9/0.999, weight decay 0.01, lr 1e-6 by default) on noisy gradients:
each element has a persistent signal (`--snr` times the noise) plus fresh Gaussian noise every
step, and the optimizer state starts at its steady state, as deep into a run. After every step
the published state is the round-to-nearest-even bf16 cast of the masters. Caveat: changes here
accumulate faster with staleness than on real runs (published: ~2.3x the k=1 density at k=32),
so the k=4 and k=16 rows are denser than real ones.

For k = 1, 4 and 16 versions behind, the patch from version v-k to v is encoded in "abs" mode,
"rel" mode and a baseline layout (one zstd-1 frame over int32 delta-coded flat indices and raw
bf16 values, as deployed elsewhere), then decoded and applied in place. The same patch is also
applied into a state 4x larger (3x extra untouched tensors): receive work must track the patch,
not the model. A last row measures the synthetic reference step of the research notes (5.1),
whose published bits per change the layouts can be compared with.

Usage: python scripts/bench_pulse.py [--quick] [--layers N] [--lr LR] [--snr S] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import zstandard

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from slime_stoa.protocol.pulse.apply import apply_patch
from slime_stoa.protocol.pulse.codec import (
    Delta,
    bf16_bits_to_float32,
    diff,
    float32_to_bf16_bits,
    rel_codes,
)
from slime_stoa.protocol.pulse.digest import state_digest
from slime_stoa.protocol.pulse.frames import PatchIndex, encode_patch, frame_slice

State = dict[str, np.ndarray]
HIDDEN, MLP, HEADS, KV_HEADS, HEAD_DIM, VOCAB, LAYERS = 1536, 8960, 12, 2, 128, 151936, 28


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


def simulate(shapes, steps: int, keep: set[int], lr: float, snr: float, seed: int) -> dict[int, State]:
    """Run `steps` AdamW steps; return the bf16 states after the steps listed in `keep`."""
    rng = np.random.default_rng(seed)
    masters = init_masters(shapes, rng)
    optims = {name: AdamW(w, rng, snr) for name, w in masters.items()}

    def snap() -> State:
        return {n: float32_to_bf16_bits(w) for n, w in masters.items()}

    versions = {0: snap()} if 0 in keep else {}
    for step in range(1, steps + 1):
        for opt in optims.values():
            opt.step(rng, lr)
        if step in keep:
            versions[step] = snap()
    return versions


def baseline_patch(delta: Delta, level: int = 1) -> bytes:
    """One zstd frame over a JSON header plus, per tensor, int32 delta-coded flat indices
    (first absolute) and raw bf16 values: the layout deployed before PULSE frames."""
    header = json.dumps([[n, int(i.size)] for n, (i, _) in delta.items()]).encode()
    parts = [len(header).to_bytes(4, "little"), header]
    for indices, values in delta.values():
        parts.append(np.diff(indices, prepend=0).astype("<i4").tobytes())
        parts.append(values.astype("<u2").tobytes())
    return zstandard.ZstdCompressor(level=level).compress(b"".join(parts))


def timed(fn: Callable[[], object], repeat: int) -> tuple[float, object]:
    """Best wall time of `repeat` runs, and the last result."""
    best, result = math.inf, None
    for _ in range(repeat):
        start = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - start)
    return best, result


def time_apply(state: State, index: PatchIndex, body: bytes, repeat: int) -> float:
    """Best decode+apply time; the state is rolled back after each run."""
    frames = {i: frame_slice(index, i, body) for i in range(len(index.frames))}
    best = math.inf
    for _ in range(repeat):
        start = time.perf_counter()
        undo = apply_patch(state, index, frames)
        best = min(best, time.perf_counter() - start)
        undo.rollback(state)
    return best


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


def run_case(label: str, base: State, new: State, repeat: int) -> dict:
    """Encode and apply the patch base -> new in every layout, and measure it."""
    state_bytes = sum(a.nbytes for a in new.values())
    elements = state_bytes // 2
    delta = diff(base, new)
    changed = sum(i.size for i, _ in delta.values())
    abs_floor, rel_floor = floors(base, delta, elements)
    row: dict = {"case": label, "state_mb": state_bytes / 1e6, "changed": changed,
                 "density": changed / elements, "abs_floor_bits": abs_floor, "rel_floor_bits": rel_floor}
    for mode in ("abs", "rel"):
        enc_s, (index, body) = timed(lambda mode=mode: encode_patch(base, new, mode=mode, threads=1), repeat)
        enc_mt_s, (index_mt, body_mt) = timed(lambda mode=mode: encode_patch(base, new, mode=mode), repeat)
        assert body_mt == body and index_mt == index, "encoding must not depend on threads"
        size = len(body) + len(json.dumps(index.to_json(), separators=(",", ":")))
        work = {n: a.copy() for n, a in base.items()}
        apply_s = time_apply(work, index, body, max(repeat, 3))
        apply_patch(work, index, {i: frame_slice(index, i, body) for i in range(len(index.frames))})
        assert all(np.array_equal(work[n], new[n]) for n in new), f"{mode} round trip differs"
        row[f"{mode}_bytes"] = size
        row[f"{mode}_frames"] = len(index.frames)
        row[f"{mode}_bits_per_changed"] = 8 * size / max(changed, 1)
        row[f"{mode}_encode_mb_s"] = state_bytes / 1e6 / enc_s
        row[f"{mode}_encode_mb_s_mt"] = state_bytes / 1e6 / enc_mt_s
        row[f"{mode}_apply_s"] = apply_s
        row[f"{mode}_apply_mb_s"] = state_bytes / 1e6 / apply_s
        if mode == "abs":
            # The same patch into a state 4x the size: 3x extra tensors the patch never touches.
            large = {n: a.copy() for n, a in base.items()}
            for j in range(3):
                large |= {f"extra{j}.{n}": a for n, a in new.items()}
            row["apply_s_small"] = apply_s
            row["apply_s_large"] = time_apply(large, index, body, max(repeat, 3))
    base_s, blob = timed(lambda: baseline_patch(diff(base, new)), repeat)
    row["baseline_bytes"] = len(blob)
    row["baseline_bits_per_changed"] = 8 * len(blob) / max(changed, 1)
    row["baseline_encode_mb_s"] = state_bytes / 1e6 / base_s
    row["ratio_vs_full"] = state_bytes / row["abs_bytes"]
    row["rel_ratio_vs_full"] = state_bytes / row["rel_bytes"]
    row["abs_gain_vs_baseline"] = row["baseline_bytes"] / row["abs_bytes"]
    row["rel_gain_vs_baseline"] = row["baseline_bytes"] / row["rel_bytes"]
    return row


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


COLUMNS = [
    ("case", "case", "{}"),
    ("density", "density", "{:.3%}"),
    ("abs_bytes", "abs MB", "{:.2f}", 1e-6),
    ("abs_bits_per_changed", "abs b/chg", "{:.2f}"),
    ("rel_bits_per_changed", "rel b/chg", "{:.2f}"),
    ("baseline_bits_per_changed", "base b/chg", "{:.2f}"),
    ("abs_floor_bits", "abs floor", "{:.2f}"),
    ("rel_floor_bits", "rel floor", "{:.2f}"),
    ("abs_gain_vs_baseline", "abs gain", "{:.2f}x"),
    ("rel_gain_vs_baseline", "rel gain", "{:.2f}x"),
    ("ratio_vs_full", "abs vs full", "{:.0f}x"),
    ("abs_encode_mb_s", "enc MB/s 1t", "{:.0f}"),
    ("abs_encode_mb_s_mt", "enc MB/s mt", "{:.0f}"),
    ("rel_encode_mb_s", "rel enc 1t", "{:.0f}"),
    ("baseline_encode_mb_s", "base enc", "{:.0f}"),
    ("abs_apply_mb_s", "apply MB/s", "{:.0f}"),
    ("apply_s_small", "apply s", "{:.3f}"),
    ("apply_s_large", "apply 4x s", "{:.3f}"),
]


def print_table(rows: list[dict]) -> None:
    cells = [[fmt.format(r[key] * (scale[0] if scale else 1)) for key, _, fmt, *scale in COLUMNS]
             for r in rows]
    heads = [head for _, head, *_ in COLUMNS]
    widths = [max(len(h), *(len(c[j]) for c in cells)) for j, h in enumerate(heads)]
    print("  ".join(h.rjust(w) for h, w in zip(heads, widths, strict=False)))
    for c in cells:
        print("  ".join(v.rjust(w) for v, w in zip(c, widths, strict=False)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="1 layer, 1 synthetic tensor, one timing run")
    parser.add_argument("--layers", type=int, help="Qwen2.5-1.5B layers to keep (default 4, 28 = full)")
    parser.add_argument("--lr", type=float, default=1e-6, help="AdamW learning rate (default 1e-6)")
    parser.add_argument("--snr", type=float, default=0.1, help="gradient signal / noise (default 0.1)")
    parser.add_argument("--repeat", type=int, help="timing runs, best taken (default 2, quick 1)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    layers = args.layers or (1 if args.quick else 4)
    repeat = args.repeat or (1 if args.quick else 2)
    lags = (1, 4, 16)
    head = max(lags)

    shapes = qwen_shapes(layers)
    params = sum(math.prod(s) for s in shapes.values())
    print(f"Qwen2.5-1.5B shapes, {layers}/{LAYERS} layers, vocab {shapes['model.embed_tokens.weight'][0]}: "
          f"{params / 1e6:.1f}M params ({2 * params / 1e6:.0f} MB bf16); AdamW lr {args.lr:g}, snr {args.snr:g}")
    start = time.perf_counter()
    versions = simulate(shapes, head, {head - k for k in lags} | {head}, args.lr, args.snr, args.seed)
    print(f"simulated {head} AdamW steps in {time.perf_counter() - start:.1f} s")

    # Bind the state now: `versions` is deleted below to free memory before the synthetic case.
    hash_s, _ = timed(lambda state=versions[head]: state_digest(state), repeat)
    rows = [run_case(f"adam k={k}", versions[head - k], versions[head], repeat) for k in lags]
    del versions
    synth = run_case("synthetic", *synthetic_step(1 if args.quick else 3, 1.2e-6, args.seed), repeat)
    print_table(rows + [synth])
    state_mb = rows[0]["state_mb"]
    print(f"adam k=N: patch v-N -> v; synthetic: one reference step (research notes 5.1). "
          f"b/chg = bits per changed element, patch body + JSON index; floor = order-0 bound.\n"
          f"enc 1t = diff + encode on one thread, mt = thread pool; apply = verify + decode + "
          f"apply in place, MB/s of model state; state digest {state_mb / hash_s:.0f} MB/s.")

    first = rows[0]
    summary = {
        "scale": {"layers": layers, "params": params, "lr": args.lr, "snr": args.snr},
        "density": first["density"],
        "abs_bits_per_changed": first["abs_bits_per_changed"],
        "rel_bits_per_changed": first["rel_bits_per_changed"],
        "baseline_bits_per_changed": first["baseline_bits_per_changed"],
        "ratio_vs_full": first["ratio_vs_full"],
        "encode_mb_s": first["abs_encode_mb_s"],
        "apply_s_small": first["apply_s_small"],
        "apply_s_large": first["apply_s_large"],
        "hash_mb_s": state_mb / hash_s,
        "synthetic": synth,
        "cases": rows,
    }
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
