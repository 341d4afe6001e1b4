"""The loss path of stoa 0.1 launch scripts, kept working: `slime_stoa.loss.dppo_loss`.

New scripts use `--custom-loss-function-path slime_stoa.dppo_loss`; the code is in
`slime_stoa.trainer.slime.loss` (adapter) and `slime_stoa.trainer.loss` (the math).
"""

from slime_stoa.trainer.slime.loss import dppo_loss

__all__ = ["dppo_loss"]
