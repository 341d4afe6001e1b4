"""The MATH grader's child process: ``python -m slime_stoa.tasks.math_verify_process SECONDS``.

It imports math-verify, writes ``ready``, then answers one line per question: it reads a JSON array
``[gold, pred]`` of two normalised answers and writes ``1`` when math-verify finds them
equivalent, else ``0``. It runs math-verify's own per-step timeouts (SIGALRM works here: this is
the process's main thread) of SECONDS each; the parent's kill after its own deadline bounds
what a signal cannot interrupt (a long integer power in C). On Linux its address space is capped
at `MEMORY_LIMIT_BYTES` so a runaway computation fails with MemoryError instead of swapping.
It exits when its stdin closes.
"""

from __future__ import annotations

import contextlib
import json
import sys

MEMORY_LIMIT_BYTES = 4 << 30


def _limit_memory() -> None:
    if sys.platform != "linux":  # macOS does not enforce RLIMIT_AS
        return
    import resource

    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT_BYTES, MEMORY_LIMIT_BYTES))


def main(argv: list[str]) -> int:
    seconds = max(1, int(float(argv[0]))) if argv else 5
    protocol = sys.stdout
    sys.stdout = sys.stderr  # nothing but answers goes to the parent's pipe
    _limit_memory()
    from math_verify import LatexExtractionConfig, parse, verify

    config = [LatexExtractionConfig()]

    def equivalent(gold: str, pred: str) -> bool:
        parsed_gold = parse(f"${gold}$", extraction_config=config, parsing_timeout=seconds)
        parsed_pred = parse(f"${pred}$", extraction_config=config, parsing_timeout=seconds)
        return bool(verify(parsed_gold, parsed_pred, timeout_seconds=seconds))

    protocol.write("ready\n")
    protocol.flush()
    for line in sys.stdin:
        try:
            gold, pred = json.loads(line)
            answer = equivalent(str(gold), str(pred))
        except Exception:  # a math-verify error, MemoryError included, grades 0
            answer = False
        protocol.write("1\n" if answer else "0\n")
        protocol.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
