"""What `stoa quickstart` does, field by field (torch-free, so `stoa --help` stays fast).

Every field is a `setting` (`slime_stoa.protocol.cli_fields`) and a command-line option of
`stoa quickstart` (`--max-versions` for `max_versions`), with the default and the help text
given here: `slime_stoa/cli/quickstart_cmd.py` builds its parser from these fields.
"""

from __future__ import annotations

import dataclasses
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from slime_stoa.protocol.cli_fields import HELP, option_fields, option_name, setting
from slime_stoa.protocol.hf.architectures import unsupported_model
from slime_stoa.protocol.shell import shell_command

TaskName = Literal["synthetic", "search", "gsm8k", "math"]
TASKS: tuple[TaskName, ...] = ("synthetic", "search", "gsm8k", "math")
REAL_TASKS = ("gsm8k", "math")  # tasks of public data, for a real model (--model)
FamilyName = Literal["qwen2", "lfm2", "lfm2_moe", "llama"]
FAMILIES: tuple[FamilyName, ...] = ("qwen2", "lfm2", "lfm2_moe", "llama")
PACKAGED_MODEL = "smollm2"  # --model smollm2: the real model built from a package (`real_model`)
GSM8K_DIR_ENV = "STOA_GSM8K_DIR"  # where --task gsm8k finds train.jsonl and test.jsonl without --data

#: The defaults that depend on --task (a field whose default is `_BY_TASK` takes its value here).
#: The real tasks have no warm start (a real instruct model already answers in words) and are
#: evaluated on more prompts, one sample each: a 95% interval of a pass@1 near 0.1 over 256
#: prompts is about +-0.04.
TASK_DEFAULTS: dict[str, dict[str, Any]] = {
    "synthetic": {"max_tokens": 4, "warmup_steps": 600, "warmup_lr": 1e-3, "eval_prompts": 64, "eval_samples": 4},
    # a call, a one-passage observation and an answer fit in 64 tokens; copying takes more steps
    "search": {"max_tokens": 64, "warmup_steps": 600, "warmup_lr": 3e-3, "eval_prompts": 64, "eval_samples": 4},
    "gsm8k": {"max_tokens": 256, "warmup_steps": 0, "warmup_lr": 0.0, "eval_prompts": 256, "eval_samples": 1},
    "math": {"max_tokens": 384, "warmup_steps": 0, "warmup_lr": 0.0, "eval_prompts": 256, "eval_samples": 1},
}
_BY_TASK = None  # a field's default when --task decides it (TASK_DEFAULTS)
#: The defaults that depend on whether --model is given: the tiny random model learns at a rate
#: that would wreck a pretrained one; 1e-6 is the rate of slime's own GRPO recipes.
MODEL_DEFAULTS: dict[str, dict[str, Any]] = {"tiny": {"lr": 3e-4}, "real": {"lr": 1e-6}}


def _by_task(name: str, help: str) -> str:
    """The help of the field `name`, whose default depends on --task (TASK_DEFAULTS): it lists them."""
    shown = ", ".join(f"{task} {values[name]}" for task, values in TASK_DEFAULTS.items())
    return f"{help} (default by --task: {shown})"


def _by_model(name: str, help: str) -> str:
    """The help of the field `name`, whose default depends on whether --model is given (MODEL_DEFAULTS)."""
    tiny, real = MODEL_DEFAULTS["tiny"][name], MODEL_DEFAULTS["real"][name]
    return f"{help} (default: {tiny} for the tiny model, {real} with --model)"


class QuickstartError(Exception):
    """Bad input (a model folder, a bucket) found at the start: the message says what to do."""


@dataclass(frozen=True, kw_only=True)
class QuickstartConfig:
    out: Path = setting("run folder: bucket, model, worker data, logs, report", Path("stoa-quickstart"))
    store: str | None = setting("bucket URL (default: file://<out>/bucket)", None)
    run: str = setting("run name; rerunning the same name resumes it", "quickstart")
    task: TaskName = setting(
        "synthetic (name the digit the rule picks), search (a retrieval task: the answer is only in a "
        "corpus the workers search), gsm8k or math (public data, from --data; with a real --model)",
        "synthetic",
    )
    model: Path | None = setting(
        f"HF/MLX model folder, or {PACKAGED_MODEL!r} for SmolLM2-135M-Instruct built from its package "
        "(default: a tiny model built locally)",
        None,
    )
    data: Path | None = setting(
        f"the data of --task gsm8k (a folder with train.jsonl and test.jsonl; default ${GSM8K_DIR_ENV}) or "
        "--task math (a folder with train and test, each a MATH folder or a .jsonl file)",
        None,
    )
    family: FamilyName = setting(
        "the tiny model's family (when no --model is given): qwen2, llama, lfm2 (gated short convolutions "
        "and attention) or lfm2_moe (LFM2 with a routed mixture of experts, the family of LFM2.5-8B-A1B)",
        "qwen2",
    )
    model_hidden: int = setting("the tiny model's width (when no --model is given)", 96)
    model_layers: int = setting("the tiny model's depth", 3)
    workers: int = setting("`macd run` worker processes", 2)
    minutes: float = setting("time budget of the RL part", 10.0)
    max_versions: int = setting("stop after publishing this many versions", 300)
    target: float = setting("stop once the last --window versions' mean reward reaches this", 0.9)
    window: int = setting("versions averaged for the target and for the last-versions reward", 5)
    batch_groups: int = setting("prompt groups per learner step", 16)
    group_size: int = setting("samples per prompt", 8)
    max_tokens: int = setting(_by_task("max_tokens", "longest response, in tokens (tool tokens included)"), _BY_TASK)
    temperature: float = setting("sampling temperature of the workers", 1.0)
    lr: float = setting(_by_model("lr", "learner AdamW learning rate (RL)"), _BY_TASK)
    warmup_lr: float = setting(_by_task("warmup_lr", "learning rate of the supervised warm start"), _BY_TASK)
    staleness_limit: int = setting("versions a group may lag when used", 2)
    warmup_steps: int = setting(_by_task("warmup_steps", "supervised steps before RL (new runs only)"), _BY_TASK)
    no_warm_start: bool = setting("skip the supervised warm start: RL starts from the model as it is", False)
    worker_batch: int = setting("prompts per worker cohort", 4)
    eval_prompts: int = setting(
        _by_task("eval_prompts", "held-out test prompts evaluated at the first and the last version"), _BY_TASK
    )
    eval_samples: int = setting(
        _by_task("eval_samples", "samples per held-out prompt (pass@1 is their mean)"), _BY_TASK
    )
    no_eval: bool = setting("skip the held-out evals (the first and the last version's)", False)
    kill_worker_at: int | None = setting("SIGKILL worker 0 at this version, then restart it", None)
    seed: int = setting("seed of the model, the prompts and the workers", 0)
    wandb: bool = setting(
        "log train/*, rollout/* and worker/* to Weights & Biases (needs the wandb package; "
        "WANDB_MODE=offline keeps the run on this machine)",
        False,
    )
    wandb_project: str = setting("the Weights & Biases project of --wandb", "stoa-quickstart")
    restart_from: int | None = setting(
        "restart the run from the checkpoint of this earlier version (<out>/checkpoints/v<N>.pt; the last few are kept)",
        None,
    )
    json: Path | None = setting(
        "write the machine-readable summary here too (the run folder's summary.json is always written)", None
    )

    def __post_init__(self) -> None:
        """ValueError naming the option and the fix (the CLI prints it as one `error:` line); a
        field left to --task gets the task's default here."""
        if self.task not in TASKS:
            raise ValueError(f"--task must be one of {', '.join(TASKS)} (got {self.task!r})")
        if self.family not in FAMILIES:
            raise ValueError(f"--family must be one of {', '.join(FAMILIES)} (got {self.family!r})")
        for name, value in TASK_DEFAULTS[self.task].items():
            if getattr(self, name) is _BY_TASK:
                object.__setattr__(self, name, value)
        for name, value in MODEL_DEFAULTS["tiny" if self.model is None else "real"].items():
            if getattr(self, name) is _BY_TASK:
                object.__setattr__(self, name, value)
        if self.task in REAL_TASKS and self.model is None:
            raise ValueError(
                f"--task {self.task} is a real task for a real model: pass --model {PACKAGED_MODEL} "
                "(SmolLM2-135M-Instruct, built offline) or --model <an HF/MLX folder>"
            )
        for name, least in (("workers", 1), ("batch_groups", 1), ("group_size", 1), ("max_tokens", 1),
                            ("window", 1), ("worker_batch", 1), ("max_versions", 1), ("warmup_steps", 0),
                            ("eval_prompts", 1), ("eval_samples", 1)):
            value = getattr(self, name)
            if value < least:
                option = "--" + name.replace("_", "-")
                raise ValueError(f"{option} must be {least} or more (got {value}): pass e.g. {option} {max(least, 1)}")
        if self.minutes <= 0:
            raise ValueError(f"--minutes must be more than 0 (got {self.minutes}): pass e.g. --minutes 10")

    def check_model(self) -> None:
        """QuickstartError naming the folder and the problem when --model is given but is not a
        usable model folder (the CLI prints it), or a real task's data is missing: read before
        anything is written anywhere. `--model smollm2` (when no such folder exists) becomes the
        real model's folder, built on first use."""
        if self.model is not None and str(self.model) == PACKAGED_MODEL and not self.model.exists():
            from .real_model import RealModelUnavailable, smollm2_folder

            try:
                object.__setattr__(self, "model", smollm2_folder())
            except RealModelUnavailable as exc:
                raise QuickstartError(f"--model {PACKAGED_MODEL}: {exc}") from None
        if self.model is not None:
            check_model_folder(self.model)
        self.data_files()

    def data_files(self) -> list[Path]:
        """The train and test files of a real task (none for the others); QuickstartError naming
        what is missing and where it was looked for."""
        if self.task not in REAL_TASKS:
            return []
        folder = self.data
        if folder is None and self.task == "gsm8k" and os.environ.get(GSM8K_DIR_ENV):
            folder = Path(os.environ[GSM8K_DIR_ENV])
        if folder is None:
            where = f"--data DIR (or ${GSM8K_DIR_ENV})" if self.task == "gsm8k" else "--data DIR"
            raise QuickstartError(f"--task {self.task} reads its public data: pass {where}, a folder with its train and test splits")
        names = ("train.jsonl", "test.jsonl") if self.task == "gsm8k" else ("train", "test")
        files = []
        for name in names:
            found = [p for p in (folder / name, folder / f"{name}.jsonl") if p.exists()]
            if not found:
                raise QuickstartError(f"--data {folder}: no {name} in it (--task {self.task} needs {' and '.join(names)})")
            files.append(found[0])
        return files

    @property
    def store_url(self) -> str:
        return self.store or f"file://{(self.out / 'bucket').resolve()}"


def default_of(cfg: QuickstartConfig, name: str) -> Any:
    """The value field `name` takes when its option is not given, for `cfg`'s --task and --model."""
    by_model = MODEL_DEFAULTS["tiny" if cfg.model is None else "real"]
    if name in TASK_DEFAULTS[cfg.task]:
        return TASK_DEFAULTS[cfg.task][name]
    if name in by_model:
        return by_model[name]
    return next(f.default for f in dataclasses.fields(QuickstartConfig) if f.name == name)


def quickstart_command(cfg: QuickstartConfig, **changes: Any) -> str:
    """The `stoa quickstart` line that makes `cfg` with `changes` (fields by name, e.g.
    `restart_from=3`), to paste as printed: `--out` always, every other option whose value is
    not the one it takes when not given."""
    cfg = dataclasses.replace(cfg, **changes)
    argv = ["stoa", "quickstart"]
    for f, _flag in option_fields(QuickstartConfig, HELP):
        value = getattr(cfg, f.name)
        if f.name != "out" and value == default_of(cfg, f.name):
            continue
        if isinstance(value, bool):  # a flag: on when given (no field defaults to on)
            argv += [option_name(f.name)] if value else []
        elif value is not None:  # None is every optional field's default: nothing to say
            argv += [option_name(f.name), str(value)]
    return shell_command(*argv)


WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
_MAX_SAFETENSORS_HEADER = 100 << 20


def check_model_folder(folder: Path) -> None:
    """QuickstartError unless `folder` is an HF/MLX model folder: a config.json holding a JSON
    object, weight files (each .safetensors file's header readable) and a tokenizer."""
    what = "pass a local HF/MLX model folder (config.json, the weights, the tokenizer), or leave --model out for the tiny model"
    if not folder.is_dir():
        raise QuickstartError(f"--model {folder}: no such folder: {what}")
    config = folder / "config.json"
    if not config.is_file():
        raise QuickstartError(f"--model {folder}: no config.json in it, so it is not an HF/MLX model folder: {what}")
    try:
        doc = json.loads(config.read_bytes())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise QuickstartError(f"--model {folder}: {config.name} is not valid JSON ({exc}): {what}") from None
    if not isinstance(doc, dict):
        raise QuickstartError(f"--model {folder}: {config.name} is not a JSON object: {what}")
    weights = sorted({p for pattern in WEIGHT_PATTERNS for p in folder.glob(pattern)})
    if not weights:
        raise QuickstartError(f"--model {folder}: no weight files in it (*.safetensors or pytorch_model*.bin): {what}")
    for path in weights:
        if path.suffix == ".safetensors":
            problem = safetensors_problem(path)
            if problem:
                raise QuickstartError(f"--model {folder}: {path.name} is not a safetensors file ({problem}): {what}")
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise QuickstartError(f"--model {folder}: no tokenizer in it ({', '.join(TOKENIZER_FILES)}): {what}")
    if why := unsupported_model(folder):
        raise QuickstartError(f"--model {why}")


def safetensors_problem(path: Path) -> str:
    """Why `path` is not a readable safetensors file ("" when its header reads)."""
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                return "shorter than its header"
            (size,) = struct.unpack("<Q", head)
            if size > min(_MAX_SAFETENSORS_HEADER, path.stat().st_size - 8):
                return f"a header of {size} bytes does not fit"
            header = json.loads(f.read(size))
    except OSError as exc:
        return str(exc)
    except (UnicodeDecodeError, ValueError) as exc:
        return f"its header is not JSON: {exc}"
    return "" if isinstance(header, dict) else "its header is not a JSON object"
