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

__all__ = ["OPTIONAL", "FromExtra", "missing_line"]


@dataclass(frozen=True, slots=True)
class FromExtra:
    """A module that only an extra installs: the package pip knows it by, and the extras with it."""

    package: str
    extras: tuple[str, ...]


#: Top-level module -> where it comes from (pyproject.toml's optional dependencies).
OPTIONAL: dict[str, FromExtra] = {
    "torch": FromExtra("torch", ("trainer",)),
    "transformers": FromExtra("transformers", ("trainer",)),
    "matplotlib": FromExtra("matplotlib", ("trainer",)),
    "yaml": FromExtra("pyyaml", ("trainer",)),
    "mlx": FromExtra("mlx", ("worker",)),  # with mlx-lm
    "mlx_lm": FromExtra("mlx-lm", ("worker",)),
    "tomli_w": FromExtra("tomli-w", ("worker",)),
    "bm25s": FromExtra("bm25s", ("worker", "trainer")),
    "Stemmer": FromExtra("PyStemmer", ("worker", "trainer")),
    "math_verify": FromExtra("math-verify", ("worker", "trainer")),
    "wandb": FromExtra("wandb", ("wandb",)),
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
