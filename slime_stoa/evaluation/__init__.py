"""Held-out evaluation: pass@1 / pass@k of weight versions on a split of the run's task.

`passk` (the unbiased estimator), `collect` (judging and re-scoring the eval records that answer
a request), `fleet` (posting a request and waiting for the fleet's answers), `local` (sampling a
version on this machine: macd's MLX path in a `python -m macd.eval_process` process, or transformers), `report` (per-version rows, CSV, JSON, PNG). The
request document itself is `slime_stoa.protocol.eval_request`; workers answer in `macd.evaluate`.
"""
