"""`macd`: the rollout daemon's command line (dispatch only).

One module per command group, each with `add_parser(sub)` setting `handler`: `join_cmd` (join),
`run_cmd` (run), `service_cmd` (install, uninstall, start, stop, status, logs); `doctor` is
`macd.doctor`; what they share (`--config`, the error line) is `macd.cmdline`. Handlers import
what they need lazily, so `macd --help` and `macd doctor` stay fast and work without MLX.
"""

from __future__ import annotations

import argparse
import contextlib
import sys

from slime_stoa.protocol.cli_fields import field_values
from slime_stoa.protocol.extras import missing_line

from . import doctor as doctor_cmd
from . import join_cmd, run_cmd, service_cmd
from .cmdline import add_config_option, config_path, error


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="macd",
        description=(
            "macd: turn this Mac into a stoa rollout worker. It follows a run's weights in the "
            "bucket, generates groups of rollouts with MLX, scores them and uploads them."
        ),
        epilog=(
            "Start with `macd doctor` to see what this machine can run, then "
            "`macd join <bucket-url> --run <run>` and `macd install && macd start`."
        ),
    )
    sub = parser.add_subparsers(title="commands", metavar="COMMAND", required=True)
    doctor = sub.add_parser(
        "doctor", help="check Python, MLX, memory and disk, and recommend a model size and batch"
    )
    add_config_option(doctor)
    doctor_cmd.add_options(doctor)
    doctor.set_defaults(handler=_doctor)
    join_cmd.add_parser(sub)
    run_cmd.add_parser(sub)
    service_cmd.add_parser(sub)
    return parser


def _doctor(args: argparse.Namespace) -> int:
    inputs = doctor_cmd.DoctorInputs(**field_values(args, doctor_cmd.DoctorInputs, "doctor"))
    if inputs.plan_for is not None:
        return doctor_cmd.print_plan(inputs)
    return doctor_cmd.main(inputs.data_dir, config_path(args), index_gb=inputs.plan_index_gb)


#: The exit status of a command stopped by Ctrl-C (128 + SIGINT), as shells report it.
INTERRUPTED = 130
INTERRUPTED_LINE = "macd: interrupted (Ctrl-C)"


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        return int(args.handler(args) or 0)
    except BrokenPipeError:  # `macd join ... | head`: the reader left; not an error of ours
        sys.stderr.close()
        return 0
    except KeyboardInterrupt:  # Ctrl-C at any point (a prompt, start-up): one line, no traceback
        return interrupted()
    except ModuleNotFoundError as exc:  # a command reached without the worker extra (mlx, ...): how to add it
        if (line := missing_line(exc)) is None:
            raise
        return error(line)


def interrupted() -> int:
    """Say that Ctrl-C stopped macd; the exit status 130."""
    with contextlib.suppress(OSError, ValueError):  # stderr gone (closed, a broken pipe)
        print(INTERRUPTED_LINE, file=sys.stderr)
    return INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
