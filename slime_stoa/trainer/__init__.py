"""The trainer side: the rollout consumer, the DPPO loss, the CPU learner and `slime/`, the only
modules that talk to slime. Never imported by macd."""
