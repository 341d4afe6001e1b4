"""Options shared by the `stoa` commands."""

from __future__ import annotations

import argparse
import contextlib
import difflib
import os
from collections.abc import Iterator, Sequence
from typing import Any, NoReturn

# Every command line stoa prints for someone to run goes through it (bash and zsh run it as printed).
from slime_stoa.protocol.shell import shell_command as shell_command


class _ParseError(Exception):
    """An error `StoaParser` holds back while it looks for unknown arguments to report first."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class StoaParser(argparse.ArgumentParser):
    """The parser of `stoa` and, as argparse makes sub-parsers of their parent's class, of every
    sub-command. An argument a command does not know is reported by that command, with its usage
    and the closest flag it has (`--stroe`: did you mean --store?), and before any other error:
    argparse hands unknown arguments up to `stoa` itself, whose usage does not help, and a typo'd
    required flag would otherwise read as that flag missing."""

    _holding_errors = False

    def error(self, message: str) -> NoReturn:
        if self._holding_errors:
            raise _ParseError(message)
        super().error(message)

    @contextlib.contextmanager
    def _errors_held(self) -> Iterator[None]:
        self._holding_errors = True
        try:
            yield
        finally:
            self._holding_errors = False

    def parse_known_args(  # type: ignore[override]  # typeshed overloads it on the namespace type
        self, args: Sequence[str] | None = None, namespace: Any = None
    ) -> tuple[argparse.Namespace, list[str]]:
        try:
            with self._errors_held():
                parsed, extras = super().parse_known_args(args, namespace)
        except _ParseError as exc:
            extras = self._unknown_arguments(args)
            self.error(unknown_arguments_text(self, extras) if extras else exc.message)
        if extras:
            self.error(unknown_arguments_text(self, extras))
        return parsed, extras

    def _unknown_arguments(self, args: Sequence[str] | None) -> list[str]:
        """The arguments of `args` this parser does not know, found by parsing them again with
        nothing required (what is missing is beside the point when a flag was mistyped)."""
        saved = [(a, a.required) for a in self._actions] + [(g, g.required) for g in self._mutually_exclusive_groups]
        try:
            for item, _ in saved:
                item.required = False
            with self._errors_held():
                return super().parse_known_args(args, None)[1]
        except _ParseError:
            return []
        finally:
            for item, required in saved:
                item.required = required


def unknown_arguments_text(parser: argparse.ArgumentParser, extras: list[str]) -> str:
    """`unrecognized arguments: --stroe x; did you mean --store?` (the hint when a flag is close)."""
    known = [option for action in parser._actions for option in action.option_strings]
    hints = []
    for extra in extras:
        flag = extra.split("=", 1)[0]
        close = difflib.get_close_matches(flag, known, n=1) if flag.startswith("-") else []
        if close:
            hints.append((close[0], flag))
    text = f"unrecognized arguments: {' '.join(extras)}"
    if len(hints) == 1:
        return f"{text}; did you mean {hints[0][0]}?"
    if hints:
        return f"{text}; did you mean {', '.join(f'{good} for {bad}' for good, bad in hints)}?"
    return text


#: The exit status of input stoa refuses before doing anything (argparse's for a bad command line).
REFUSED = 2


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
