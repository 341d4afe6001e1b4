"""Options shared by the `stoa` commands."""

from __future__ import annotations

import argparse
import os
import shlex


def add_store_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--store",
        default=os.environ.get("STOA_STORE"),
        help="bucket URL (file:///dir, s3://bucket/prefix?endpoint=..., r2://account/bucket/prefix); "
        "default $STOA_STORE",
    )


def add_run_options(parser: argparse.ArgumentParser) -> None:
    add_store_option(parser)
    parser.add_argument("--run", default=os.environ.get("STOA_RUN"), help="run name; default $STOA_RUN")


def require_store(args: argparse.Namespace) -> str:
    if not args.store:
        raise SystemExit("error: no bucket given: pass --store URL or set STOA_STORE")
    return str(args.store)


def os_error_text(exc: OSError) -> str:
    """`PATH: no such file or directory`, not `[Errno 2] No such file or directory: 'PATH'`."""
    if exc.filename is None or not exc.strerror:
        return str(exc)
    where = f"{exc.filename} -> {exc.filename2}" if exc.filename2 else str(exc.filename)
    return f"{where}: {exc.strerror[0].lower()}{exc.strerror[1:]}"


def shell_command(*argv: str | os.PathLike[str]) -> str:
    """`argv` as one line a person can paste into bash or zsh (macOS's shell) and get exactly these
    arguments back: every word that needs it is quoted. Unquoted, zsh takes the `?` of an
    `s3://...?endpoint=...` URL for a glob and stops with "no matches found", and both shells
    split at `&` or a space. Every command line stoa prints for someone to run goes through here."""
    return shlex.join(os.fspath(a) for a in argv)


def require_run_options(args: argparse.Namespace) -> tuple[str, str]:
    require_store(args)
    if not args.run:
        raise SystemExit("error: no run given: pass --run NAME or set STOA_RUN")
    return args.store, args.run


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")
