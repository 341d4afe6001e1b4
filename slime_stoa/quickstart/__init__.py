"""`stoa quickstart`: the whole loop on one machine (tiny model, local bucket, `macd run`
workers, the CPU learner)."""
