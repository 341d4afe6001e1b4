"""macd: the Mac rollout daemon of stoa (MLX generation, PULSE weight sync, lossless upload)."""
