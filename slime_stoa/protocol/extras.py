"""Which of stoa's optional extras brings a module, and the one line that says how to get it.

`pip install -e .` installs what the protocol, the bucket and `stoa --help` need; the trainer's
learner (torch, transformers), a worker's MLX and the tasks' graders come with the extras
(pyproject.toml: ``[trainer]``, ``[worker]``, ``[wandb]``). A command reached without its extra
stops at its first import of one of them; both command lines (`stoa`, `macd`) turn that into
`missing_line` instead of a traceback, naming the command that adds the extra
(`shell.extra_install_command`).
"""

from __future__ import annotations

from dataclasses import dataclass

from .shell import extra_install_command

__all__ = ["OPTIONAL", "Optional", "missing_line"]


@dataclass(frozen=True, slots=True)
class Optional:
    """A module that only an extra installs: the package pip knows it by, and the extras with it."""

    package: str
    extras: tuple[str, ...]


#: Top-level module -> where it comes from (pyproject.toml's optional dependencies).
OPTIONAL: dict[str, Optional] = {
    "torch": Optional("torch", ("trainer",)),
    "transformers": Optional("transformers", ("trainer",)),
    "matplotlib": Optional("matplotlib", ("trainer",)),
    "yaml": Optional("pyyaml", ("trainer",)),
    "mlx": Optional("mlx", ("worker",)),  # with mlx-lm
    "mlx_lm": Optional("mlx-lm", ("worker",)),
    "tomli_w": Optional("tomli-w", ("worker",)),
    "bm25s": Optional("bm25s", ("worker", "trainer")),
    "Stemmer": Optional("PyStemmer", ("worker", "trainer")),
    "math_verify": Optional("math-verify", ("worker", "trainer")),
    "wandb": Optional("wandb", ("wandb",)),
}


def missing_line(exc: ModuleNotFoundError) -> str | None:
    """One line naming the missing package and the extra that installs it, when `exc` is the
    import of a module only an extra brings; None otherwise (a bug to report as it is)."""
    found = OPTIONAL.get((exc.name or "").split(".")[0])
    if found is None:
        return None
    extra = found.extras[0]
    others = "".join(f" (or [{other}])" for other in found.extras[1:])
    return f"{found.package} is not installed; it comes with stoa's [{extra}] extra{others}: {extra_install_command(extra)}"
