"""stoa's trainer side and shared protocol.

The protocol modules (`store`, `layout`, `records`, `validate`, `pulse`) import neither torch,
mlx nor slime, so a Mac worker uses them too.
"""

__version__ = "0.1.0"


def __getattr__(name: str):
    """`slime_stoa.generate_rollout` (slime's `--rollout-function-path`), imported on first use."""
    if name == "generate_rollout":
        from .rollout import generate_rollout

        return generate_rollout
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
