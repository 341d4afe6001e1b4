"""The launchd agent that keeps `macd run` going on a Mac, the way `brew services` does.

    macd install   write ~/Library/LaunchAgents/dev.stoa.macd.plist (loaded at every login)
    macd start     launchctl enable + bootstrap (or kickstart -k when already loaded)
    macd stop      launchctl bootout + disable (stays stopped across logins)
    macd status    launchctl print, parsed: state, pid, last exit code (without launchd, on
                   Linux: the worker's heartbeat decides)
    macd logs      tail ~/Library/Logs/stoa/macd.log

Everything that decides something is a pure function (the plist, every launchctl argv);
`Launchctl` runs the commands or, in a dry run, prints them.

Domains: `gui/<uid>` when this user owns the console (logged in at the screen), else
`user/<uid>` (e.g. over SSH on a Mac nobody is logged into), like Homebrew does. The plist may
load in both (LimitLoadToSessionType Aqua and Background).

Restart policy: KeepAlive {SuccessfulExit: false} restarts the daemon when it crashes (non-zero
exit or a signal) but not when it exits 0, which it does after a SIGTERM once the spool is
flushed; launchd waits ExitTimeOut seconds for that before it sends SIGKILL. ThrottleInterval
spaces restarts so a crash loop does not hammer the bucket.
"""

from __future__ import annotations

import os
import plistlib
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from slime_stoa.protocol.shell import shell_command

BASE_LABEL = "dev.stoa.macd"
DOMAIN_KINDS = ("gui", "user")
#: Seconds launchd waits after SIGTERM before SIGKILL: room to flush the upload spool.
EXIT_TIMEOUT_S = 60
#: Least seconds between two launches: a crash loop retries twice a minute, not continuously.
THROTTLE_INTERVAL_S = 30
#: Standard (the default class, written out for clarity) rather than Background or Adaptive:
#: Background puts the job under the Darwin background policy (lowest CPU priority, throttled
#: disk I/O, efficiency cores only on Apple silicon), which would starve MLX's dispatch thread
#: and the spool on a Mac whose job is generating rollouts; Adaptive is meant for XPC services
#: and is treated as Background while no XPC request is in flight, which for macd is always.
#: `macd install --background` picks Background for a Mac that a person also works on.
PROCESS_TYPES = ("Standard", "Background", "Adaptive", "Interactive")
DEFAULT_PROCESS_TYPE = "Standard"
SYSTEM_PATH = "/opt/homebrew/bin:/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin"
LAUNCHCTL_MISSING = (
    "macd install/start need macOS's launchctl; on this system run `macd run` in the foreground "
    "or under your own supervisor"
)
_INSTANCE = re.compile(r"^[a-z0-9][a-z0-9-]{0,31}$")


class ServiceError(Exception):
    """A launchd operation failed; the message says what to do."""


# -- names and places ---------------------------------------------------------------------------


def label_for(instance: str | None = None) -> str:
    """`dev.stoa.macd`, or `dev.stoa.macd.<instance>` for a second daemon on the same Mac."""
    if instance is None:
        return BASE_LABEL
    if not _INSTANCE.match(instance):
        raise ValueError(f"invalid instance name {instance!r}: use 1-32 lowercase letters, digits or '-'")
    return f"{BASE_LABEL}.{instance}"


def plist_path(label: str, home: Path | None = None) -> Path:
    """`~/Library/LaunchAgents/<label>.plist`."""
    return (home or Path.home()) / "Library" / "LaunchAgents" / f"{label}.plist"


def log_dir(home: Path | None = None) -> Path:
    """`~/Library/Logs/stoa`."""
    return (home or Path.home()) / "Library" / "Logs" / "stoa"


def log_path(label: str, home: Path | None = None) -> Path:
    """The agent's log (stdout and stderr together): `macd.log`, `macd.<instance>.log`."""
    return log_dir(home) / f"{label.removeprefix('dev.stoa.')}.log"


def domain_target(kind: str, uid: int) -> str:
    """`gui/<uid>` or `user/<uid>`."""
    if kind not in DOMAIN_KINDS:
        raise ValueError(f"unknown launchd domain {kind!r}; expected one of {DOMAIN_KINDS}")
    return f"{kind}/{uid}"


def auto_domain_kind(uid: int, console_uid: int | None) -> str:
    """`gui` when this user owns the console (a screen login), else `user`."""
    return "gui" if console_uid == uid else "user"


def console_uid() -> int | None:
    """Owner of /dev/console (the user logged in at the screen; root at the login window)."""
    try:
        return os.stat("/dev/console").st_uid
    except OSError:
        return None


@dataclass(frozen=True, kw_only=True)
class Agent:
    """One launchd agent of macd: its label, domain and files."""

    label: str
    domain: str  # gui/<uid> or user/<uid>
    plist: Path
    log: Path

    @property
    def service(self) -> str:
        """`<domain>/<label>`, how launchctl names the loaded service."""
        return f"{self.domain}/{self.label}"


def agent_for(
    instance: str | None = None,
    *,
    domain_kind: str = "auto",
    uid: int | None = None,
    home: Path | None = None,
) -> Agent:
    """The agent for `instance` in this user's gui or user domain (`auto`: see auto_domain_kind)."""
    uid = os.getuid() if uid is None else uid
    kind = auto_domain_kind(uid, console_uid()) if domain_kind == "auto" else domain_kind
    label = label_for(instance)
    return Agent(label=label, domain=domain_target(kind, uid), plist=plist_path(label, home), log=log_path(label, home))


# -- the plist ----------------------------------------------------------------------------------


def build_plist(
    *,
    label: str,
    config_path: Path,
    python: str,
    working_dir: Path,
    log_file: Path,
    process_type: str = DEFAULT_PROCESS_TYPE,
    exit_timeout: int = EXIT_TIMEOUT_S,
    throttle_interval: int = THROTTLE_INTERVAL_S,
) -> dict[str, Any]:
    """The launchd job running `<python> -m macd run --config <config_path>`."""
    paths = {"python": Path(python), "config_path": config_path, "working_dir": working_dir, "log_file": log_file}
    for name, path in paths.items():
        if not path.is_absolute():
            raise ValueError(f"{name} must be an absolute path, got {str(path)!r}")
    if process_type not in PROCESS_TYPES:
        raise ValueError(f"process_type must be one of {PROCESS_TYPES}, got {process_type!r}")
    if exit_timeout < 1 or throttle_interval < 1:
        raise ValueError("exit_timeout and throttle_interval must be at least 1 second")
    return {
        "Label": label,
        "ProgramArguments": [python, "-m", "macd", "run", "--config", str(config_path)],
        "RunAtLoad": True,
        "KeepAlive": {"SuccessfulExit": False},
        "ThrottleInterval": throttle_interval,
        "ExitTimeOut": exit_timeout,
        "ProcessType": process_type,
        "LimitLoadToSessionType": ["Aqua", "Background"],
        "WorkingDirectory": str(working_dir),
        "StandardOutPath": str(log_file),
        "StandardErrorPath": str(log_file),
        "EnvironmentVariables": {
            # The venv's bin first, so tools the daemon spawns come from the same install.
            "PATH": f"{Path(python).parent}:{SYSTEM_PATH}",
            "PYTHONUNBUFFERED": "1",
        },
        "Umask": 0o077,  # logs and spool readable by this user only
    }


def plist_bytes(plist: dict[str, Any]) -> bytes:
    """The plist as launchd reads it (XML property list)."""
    return plistlib.dumps(plist, fmt=plistlib.FMT_XML, sort_keys=False)


# -- launchctl commands (argv lists) ------------------------------------------------------------


def bootstrap_cmd(agent: Agent) -> list[str]:
    """Load the agent (RunAtLoad starts it)."""
    return ["launchctl", "bootstrap", agent.domain, str(agent.plist)]


def bootout_cmd(agent: Agent) -> list[str]:
    """Stop (SIGTERM, then SIGKILL after ExitTimeOut) and unload the agent."""
    return ["launchctl", "bootout", agent.service]


def kickstart_cmd(agent: Agent, *, kill: bool = True) -> list[str]:
    """Start the loaded agent; `-k` first stops a running instance (a restart)."""
    return ["launchctl", "kickstart", *(["-k"] if kill else []), agent.service]


def print_cmd(agent: Agent) -> list[str]:
    """Describe the loaded agent (exit status 113 when it is not loaded)."""
    return ["launchctl", "print", agent.service]


def enable_cmd(agent: Agent) -> list[str]:
    """Allow the agent to load (also at the next login)."""
    return ["launchctl", "enable", agent.service]


def disable_cmd(agent: Agent) -> list[str]:
    """Keep the agent from loading, across logins and reboots, until enabled again."""
    return ["launchctl", "disable", agent.service]


# -- running them -------------------------------------------------------------------------------


def has_launchctl() -> bool:
    """Whether this system has launchd's launchctl (macOS)."""
    return shutil.which("launchctl") is not None



class Launchctl:
    """Runs launchctl argv lists, or prints them (`dry_run`)."""

    def __init__(self, *, dry_run: bool = False, echo: Callable[[str], None] = print) -> None:
        self.dry_run = dry_run
        self.echo = echo

    def require(self) -> None:
        """ServiceError with the `macd run` advice when launchctl is not on this system."""
        if not self.dry_run and not has_launchctl():
            raise ServiceError(LAUNCHCTL_MISSING)

    def __call__(self, argv: list[str], *, check: bool = True) -> subprocess.CompletedProcess[str]:
        """Run `argv`; with `check`, ServiceError (the command, its status, its stderr) on failure."""
        if self.dry_run:
            self.echo(shell_command(*argv))
            return subprocess.CompletedProcess(argv, 0, "", "")
        self.require()
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
        except FileNotFoundError:
            raise ServiceError(LAUNCHCTL_MISSING) from None
        if check and done.returncode != 0:
            detail = (done.stderr or done.stdout).strip()
            raise ServiceError(f"`{shell_command(*argv)}` failed (exit {done.returncode}){': ' + detail if detail else ''}")
        return done

    def loaded(self, agent: Agent) -> bool:
        """Whether the agent is loaded in its domain (False in a dry run)."""
        return not self.dry_run and self(print_cmd(agent), check=False).returncode == 0


# -- operations ---------------------------------------------------------------------------------


def write_plist(agent: Agent, plist: dict[str, Any]) -> bool:
    """Write the agent's plist atomically; True when it changed."""
    from slime_stoa.protocol.fsutil import atomic_write

    data = plist_bytes(plist)
    if agent.plist.exists() and agent.plist.read_bytes() == data:
        return False
    agent.log.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(agent.plist, data, mode=0o644, parents_mode=0o700)
    return True


def install(agent: Agent, plist: dict[str, Any], launchctl: Launchctl) -> str:
    """Write the plist; reload a loaded agent whose plist changed. Says what it did."""
    launchctl.require()
    if launchctl.dry_run:
        launchctl.echo(f"# write {agent.plist}:")
        launchctl.echo(plist_bytes(plist).decode().rstrip())
        return "dry run"
    if not write_plist(agent, plist):
        return "unchanged"
    if launchctl.loaded(agent):  # launchd keeps the old definition until it is loaded again
        launchctl(bootout_cmd(agent))
        launchctl(bootstrap_cmd(agent))
        return "reloaded"
    return "written"


def start(agent: Agent, launchctl: Launchctl) -> str:
    """Enable and load the agent, or restart it when it is loaded; says which it did."""
    launchctl.require()
    if not launchctl.dry_run and not agent.plist.exists():
        raise ServiceError(f"{agent.plist} does not exist: run `macd install` first")
    launchctl(enable_cmd(agent))
    if launchctl.loaded(agent):
        launchctl(kickstart_cmd(agent))
        return "restarted"
    try:
        launchctl(bootstrap_cmd(agent))
    except ServiceError as exc:
        raise ServiceError(f"{exc}\ncheck the plist (`plutil -lint {agent.plist}`) and the log {agent.log}") from None
    if launchctl.dry_run:
        launchctl.echo("# when it is already loaded, instead of bootstrap (a restart):")
        launchctl.echo(shell_command(*kickstart_cmd(agent)))
    return "started"


def stop(agent: Agent, launchctl: Launchctl) -> bool:
    """Unload the agent (SIGTERM, spool flush) and keep it from loading at login; True if it was loaded."""
    launchctl.require()
    was_loaded = launchctl.dry_run or launchctl.loaded(agent)
    if was_loaded:
        launchctl(bootout_cmd(agent))
    launchctl(disable_cmd(agent))
    return was_loaded


def uninstall(agent: Agent, launchctl: Launchctl) -> bool:
    """Unload the agent if loaded and remove its plist; True when there was a plist."""
    launchctl.require()
    if launchctl.dry_run or launchctl.loaded(agent):
        launchctl(bootout_cmd(agent))
    launchctl(enable_cmd(agent))  # clear a `disable` left by `macd stop` from launchd's database
    if launchctl.dry_run:
        launchctl.echo(shell_command("rm", "-f", agent.plist))
        return agent.plist.exists()
    existed = agent.plist.exists()
    agent.plist.unlink(missing_ok=True)
    return existed


# -- status -------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class ServiceStatus:
    """The parts of `launchctl print` that say how the agent is doing."""

    loaded: bool
    state: str | None = None  # "running", "not running", "spawn scheduled", ...
    pid: int | None = None
    last_exit: str | None = None  # "0", "1", "(never exited)", ...
    runs: int | None = None
    last_signal: str | None = None  # "Terminated: 15" when a signal ended the last run

    @property
    def running(self) -> bool:
        return self.loaded and self.state == "running"


_TOP_KEY = re.compile(r"^\t([a-z][a-z ]*?) = (.*)$")


def parse_print(text: str) -> ServiceStatus:
    """Parse `launchctl print <service>` output (top-level `key = value` lines of its block)."""
    values: dict[str, str] = {}
    for line in text.splitlines():
        match = _TOP_KEY.match(line)
        if match and match[1] not in values:
            values[match[1]] = match[2].strip()

    def number(key: str) -> int | None:
        value = values.get(key, "")
        return int(value) if value.lstrip("-").isdigit() else None

    return ServiceStatus(
        loaded=True,
        state=values.get("state"),
        pid=number("pid"),
        last_exit=values.get("last exit code"),
        runs=number("runs"),
        last_signal=values.get("last terminating signal"),
    )


def status(agent: Agent, launchctl: Launchctl) -> ServiceStatus:
    """The agent's state, from `launchctl print` (not loaded when it fails)."""
    launchctl.require()
    done = launchctl(print_cmd(agent), check=False)
    if launchctl.dry_run or done.returncode != 0:
        return ServiceStatus(loaded=False)
    return parse_print(done.stdout)


# -- logs ---------------------------------------------------------------------------------------


def tail_lines(path: Path, count: int) -> list[str]:
    """The last `count` lines of `path` (reads at most the last MB)."""
    if count <= 0:
        return []
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        size = f.tell()
        f.seek(max(0, size - (1 << 20)))
        lines = f.read().decode(errors="replace").splitlines()
    return lines[-count:]


def follow(path: Path, out: TextIO = sys.stdout, *, poll_s: float = 0.5, stop: Callable[[], bool] = lambda: False) -> None:
    """Print what is appended to `path` until `stop()` (or Ctrl-C); survives truncation."""
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        while not stop():
            chunk = f.read()
            if chunk:
                out.write(chunk.decode(errors="replace"))
                out.flush()
                continue
            if path.exists() and path.stat().st_size < f.tell():
                f.seek(0)  # truncated: start over
            time.sleep(poll_s)
