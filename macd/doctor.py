"""`macd doctor`: what this machine can do as a rollout worker (the tiers: `macd.machine`), the
memory plan of the joined run's model on it (a search task's index counted at the size its
manifest in the bucket gives, `macd.index_plan`, unless `--plan-index-gb` says), and with
`--plan-for` the plan of a model shape (LFM2.5-8B-A1B unless `--plan-config`) on Macs of other
sizes (`macd.memory_plan`)."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import json
import platform
import shutil
import sys
from pathlib import Path
from typing import Any, Literal

from slime_stoa.protocol.cli_fields import Flag, add_field_options, option_name, setting
from slime_stoa.protocol.shell import extra_install_command

from .config import default_data_dir
from .machine import memory_bytes, tier_for


def package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def report(data_dir: Path) -> list[tuple[str, str, bool]]:
    """(check, finding, ok) rows."""
    rows: list[tuple[str, str, bool]] = []
    py_ok = sys.version_info >= (3, 11)
    rows.append(("python", f"{platform.python_version()} ({sys.executable})", py_ok))
    mem = memory_bytes()
    tier = tier_for(mem)
    rows.append(
        (
            "memory",
            f"{mem / 2**30:.0f} GiB -> up to {tier.model} models, batch {tier.batch}, group size {tier.group_size}",
            True,
        )
    )
    for pkg in ("mlx", "mlx-lm"):
        version = package_version(pkg)
        fix = f"install the worker extra: {extra_install_command('worker')}"
        rows.append((pkg, version or f"missing: {fix}", version is not None))
    probe = data_dir if data_dir.exists() else Path.home()
    free = shutil.disk_usage(probe).free
    rows.append(("disk", f"{free / 2**30:.0f} GiB free at {probe} (anchor cache and spool)", free > 20 * 2**30))
    machine = f"{platform.system()} {platform.machine()}"
    apple = platform.system() == "Darwin" and platform.machine() == "arm64"
    rows.append(("platform", machine + ("" if apple else " (not Apple silicon: MLX runs on the CPU)"), True))
    return rows


async def bucket_rows(config) -> list[tuple[str, str, bool]]:
    """Credentials, reachability and latency of the joined run's bucket (one small GET, timed)."""
    import time

    from slime_stoa.protocol.layout import RunLayout
    from slime_stoa.protocol.store import NotFound, StoreError

    try:
        async with config.open_store() as store:
            start = time.perf_counter()
            try:
                await store.head(RunLayout(config.run).run_manifest)
            except NotFound:
                return [("bucket", f"reachable, but run {config.run!r} is missing: create it with `stoa run create`", False)]
            latency = 1000 * (time.perf_counter() - start)
            start = time.perf_counter()
            await store.head(RunLayout(config.run).run_manifest)
            latency = min(latency, 1000 * (time.perf_counter() - start))
    except (StoreError, ValueError) as exc:
        return [("bucket", f"{config.store}: {exc}", False)]
    return [("bucket", f"{config.store} run {config.run!r}: credentials ok, {latency:.0f} ms per request", True)]


async def plan_rows(config: Any, index_gb: float | None = None) -> list[tuple[str, str, bool]]:
    """The memory plan of the joined run's model on this Mac (`join_cmd.memory_plan_lines`), one
    row per line; not ok when the plane this Mac serves does not fit, or when its search index's
    size is unknown (a worker could not fetch that index either). The index is counted as its manifest in
    the bucket says (`index_plan.run_index_plan`), or at `index_gb` GiB when given. Nothing when
    the run cannot be read."""
    from slime_stoa.protocol.store import StoreError

    from .config import RunNotFound, probe_run
    from .index_plan import override_plan, run_index_plan
    from .join_cmd import memory_plan_lines
    from .shared_dir import machine_shared_dir

    try:
        async with config.open_store() as store:
            info = await probe_run(store, config.run, pinned=config.run_key or None)
            index = (override_plan(index_gb, INDEX_FLAG) if index_gb is not None
                     else await run_index_plan(store, info.manifest, machine_shared_dir()))
    except (StoreError, ValueError, RunNotFound):
        return []
    lines, warning = memory_plan_lines(config, info, memory_bytes(), index)
    unknown = "" if index is None or index.known else index.line
    rows = [("plan", text, text != unknown) for text in (line.strip().removeprefix("memory plan").strip() for line in lines)]
    return rows + ([("plan", warning.removeprefix("warning: "), False)] if warning else [])


@dataclasses.dataclass(frozen=True, kw_only=True)
class DoctorInputs:
    """The options of `macd doctor`: the data folder whose disk it checks, and with `--plan-for`
    the model shape and Mac sizes it plans for (checked by `print_plan`, which names a bad one)."""

    data_dir: Path = setting(
        "anchor cache and spool folder (default: ~/Library/Application Support/stoa on macOS, "
        "$XDG_DATA_HOME/stoa or ~/.local/share/stoa elsewhere)",
        default_factory=default_data_dir,  # read when macd starts: the environment of this call
        doctor=True,
    )
    plan_for: str | None = setting(
        "print the memory plan of LFM2.5-8B-A1B (or --plan-config) on Macs of these sizes, e.g. 16,24,32,64",
        None,
        doctor=Flag(metavar="GB[,GB...]"),
    )
    plan_config: Path | None = setting("a model's config.json to plan for instead", None, doctor=True)
    plan_device: Literal["gpu", "cpu"] = setting(
        "where MLX computes: gpu (a Mac's Metal GPU) or cpu (MLX's CPU device, e.g. Linux: float32 "
        "compute, float32 copies of the bf16 weights)",
        "gpu",
        doctor=True,
    )
    plan_planes: str = setting(
        "quantized planes the run publishes (int8, int4), each planned as a Mac holds it: alone, "
        "without the bf16 master (default: none)",
        "",
        doctor=Flag(metavar="PLANE[,PLANE...]"),
    )
    plan_group_size: int = setting("samples per prompt", 8, doctor=True)
    plan_batch: int = setting("prompts decoding at once", 2, doctor=True)
    plan_prompt_tokens: int = setting("longest prompt", 512, doctor=True)
    plan_response_tokens: int = setting("longest response", 1536, doctor=True)
    plan_index_gb: float | None = setting(
        "the search index's size in GiB, counted instead of what the joined run's index manifest in "
        "the bucket says (default: that size; 0 with --plan-for)",
        None,
        doctor=True,
    )


INDEX_FLAG = option_name("plan_index_gb")


def check_index_gb(value: float | None) -> str | None:
    """The error line for a bad `--plan-index-gb`, or None."""
    if value is not None and not 0 <= value <= 1 << 20:
        return f"error: {INDEX_FLAG} must be between 0 and {1 << 20} (got {value:g})"
    return None


def add_options(parser: argparse.ArgumentParser) -> None:
    """`macd doctor`'s options, one per `DoctorInputs` field. The parser's defaults are
    `DoctorInputs()`'s, so that a computed one (the data folder, read when macd starts) is a value
    in `args` too, not None."""
    add_field_options(parser, DoctorInputs, "doctor")
    parser.set_defaults(**dataclasses.asdict(DoctorInputs()))


def print_plan(inputs: DoctorInputs) -> int:
    """`macd doctor --plan-for`: the plan's lines on stdout; 1 with an error line on bad input."""
    from slime_stoa.protocol.layout import QUANT_PLANES

    from .index_plan import override_plan
    from .memory_plan import LFM2_5_8B_A1B, config_plan, describe

    try:
        sizes = tuple(float(x) for x in str(inputs.plan_for).split(",") if x.strip())
        if not sizes or min(sizes) <= 0:
            raise ValueError
    except ValueError:
        print(f"error: --plan-for {inputs.plan_for!r}: expected memory sizes in GB, e.g. 16,24,32,64", file=sys.stderr)
        return 1
    name, model = "LFM2.5-8B-A1B", LFM2_5_8B_A1B
    if inputs.plan_config is not None:
        try:
            model = json.loads(inputs.plan_config.read_bytes())
        except (OSError, ValueError) as exc:
            print(f"error: --plan-config {inputs.plan_config}: {exc}", file=sys.stderr)
            return 1
        name = str(inputs.plan_config)
    for option in ("plan_group_size", "plan_batch", "plan_prompt_tokens", "plan_response_tokens"):
        if getattr(inputs, option) < 1:
            print(f"error: {option_name(option)} must be 1 or more (got {getattr(inputs, option)})", file=sys.stderr)
            return 1
    if bad := check_index_gb(inputs.plan_index_gb):
        print(bad, file=sys.stderr)
        return 1
    planes = tuple(x.strip() for x in str(inputs.plan_planes).split(",") if x.strip())
    if unknown := [plane for plane in planes if plane not in QUANT_PLANES]:
        print(f"error: --plan-planes {inputs.plan_planes!r}: {', '.join(unknown)} is not a quantized plane "
              f"({', '.join(QUANT_PLANES)})", file=sys.stderr)
        return 1
    index = None if inputs.plan_index_gb is None else override_plan(inputs.plan_index_gb, INDEX_FLAG)
    plan = config_plan(
        model, group_size=inputs.plan_group_size, groups=inputs.plan_batch, prompt_tokens=inputs.plan_prompt_tokens,
        response_tokens=inputs.plan_response_tokens, mac_sizes_gb=sizes,
        index_bytes=0 if index is None else index.counted, index_line="" if index is None else index.line,
        device=inputs.plan_device, published=planes,
    ) if isinstance(model, dict) else None
    if plan is None:
        print(f"error: --plan-config {name}: not a model config with the sizes a plan needs", file=sys.stderr)
        return 1
    print(f"memory plan of {name}: {inputs.plan_batch} prompts x {inputs.plan_group_size} samples, "
          f"{inputs.plan_prompt_tokens} + {inputs.plan_response_tokens} tokens")
    for line in describe(plan):
        print(f"  {line}")
    return 0


def main(data_dir: Path, config_file: Path | None = None, index_gb: float | None = None) -> int:
    """The checks' rows on stdout; 1 when one needs fixing. `index_gb`: `--plan-index-gb`."""
    import asyncio

    if bad := check_index_gb(index_gb):
        print(bad, file=sys.stderr)
        return 1
    rows = report(data_dir)
    if config_file is not None and config_file.exists():
        from .config import load_config

        joined = load_config(config_file)
        rows += asyncio.run(bucket_rows(joined))
        if rows[-1][2]:  # the bucket answers: the plan of the run's model here
            rows += asyncio.run(plan_rows(joined, index_gb))
    else:
        rows.append(("bucket", "not joined yet: run `macd join <bucket-url> --run <run>`", True))
    for name, finding, ok in rows:
        print(f"{'ok ' if ok else 'FIX'}  {name:<9} {finding}")
    return 0 if all(ok for _, _, ok in rows) else 1
