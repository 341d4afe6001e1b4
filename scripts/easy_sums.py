"""One-step sums in GSM8K's format: the closest task to GSM8K that SmolLM2-135M-Instruct learns
on two CPU cores within the quickstart's 30 minutes (docs/real-model.md).

    python scripts/easy_sums.py DIR && stoa quickstart --task gsm8k --model smollm2 --data DIR ...

Writes DIR/train.jsonl and DIR/test.jsonl, GSM8K's layout ({"question", "answer" ending in
"#### <n>"}): "What is a + b?" for a in 1..60 and b in 1..9, shuffled with a fixed seed, the first
256 pairs held out as the test split, the other 284 for training (no pair in both). The model
answers these right in 16 tokens some of the time (held-out pass@1 ~0.05 at temperature 0.5), so
GRPO groups carry a signal from the first batch; on GSM8K itself it rewards ~1% of samples within
its token budget and groups rarely do.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

SEED = 0
TEST_PAIRS = 256


def sums(seed: int = SEED) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    """(train rows, test rows) in GSM8K's layout (module docstring)."""
    pairs = [(a, b) for a in range(1, 61) for b in range(1, 10)]
    random.Random(seed).shuffle(pairs)
    rows = [{"question": f"What is {a} + {b}?", "answer": f"{a} + {b} = {a + b}\n#### {a + b}"} for a, b in pairs]
    return rows[TEST_PAIRS:], rows[:TEST_PAIRS]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="folder to write train.jsonl and test.jsonl into")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    train, test = sums()
    for name, rows in (("train", train), ("test", test)):
        (args.out / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"{args.out}: {len(train)} train and {len(test)} test problems", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
