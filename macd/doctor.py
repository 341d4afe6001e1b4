"""`macd doctor`: what this machine can do as a rollout worker (the tiers: `macd.machine`)."""

from __future__ import annotations

import importlib.metadata
import platform
import shutil
import sys
from pathlib import Path

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
        fix = "install the worker extra: pip install 'stoa[worker]'"
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


def main(data_dir: Path, config_file: Path | None = None) -> int:
    import asyncio

    rows = report(data_dir)
    if config_file is not None and config_file.exists():
        from .config import load_config

        rows += asyncio.run(bucket_rows(load_config(config_file)))
    else:
        rows.append(("bucket", "not joined yet: run `macd join <bucket-url> --run <run>`", True))
    for name, finding, ok in rows:
        print(f"{'ok ' if ok else 'FIX'}  {name:<9} {finding}")
    return 0 if all(ok for _, _, ok in rows) else 1
