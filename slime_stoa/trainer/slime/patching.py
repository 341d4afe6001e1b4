"""Apply stoa's patches to a slime checkout, idempotently and without git.

    python scripts/apply_slime_patches.py <slime-checkout> [--check] [--patch FILE ...]

(`scripts/apply_slime_patches.py` is a thin main around this module; `stoa preflight` uses its
`patch_status` to check a checkout.)

By default every `patches/slime_*.patch` of this repository is used. Each patch is a unified
diff (paths relative to slime's root, `a/` and `b/` prefixes) whose added lines carry a marker
comment `stoa-patch: <name>`. Hunks are applied with *exact* context: the context and removed
lines must match slime's file line for line (only the position may differ), so a patch never
lands in code it was not written for.

For each patch the status is one of:

- `applied`        — the patched code is already there (the marker and every hunk's new side);
- `not applied`    — slime's code matches every hunk's old side, so the patch applies cleanly;
- `not applicable` — neither: slime's code changed since the patch was written (or the file was
                     edited after patching). Nothing is written; the message names the file,
                     the hunk and what to do.

Without `--check` the script applies every `not applied` patch, but only if no patch is
`not applicable` (all or nothing). Running it again changes nothing.

Exit codes:
    0  every patch is applied (now, or already before)
    1  `--check` only: at least one patch is not applied yet, and all of them apply cleanly
    2  usage error (bad arguments, checkout folder missing, unreadable patch)
    3  at least one patch is not applicable; nothing was changed
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from slime_stoa.protocol.fsutil import atomic_write

REPO_ROOT = Path(__file__).resolve().parents[3]  # the stoa checkout: slime_stoa/trainer/slime/ is 3 below
PATCH_DIR = REPO_ROOT / "patches"
PATCH_GLOB = "slime_*.patch"

APPLIED, NOT_APPLIED, NOT_APPLICABLE = "applied", "not applied", "not applicable"
EXIT_OK, EXIT_NOT_APPLIED, EXIT_USAGE, EXIT_NOT_APPLICABLE = 0, 1, 2, 3

_HUNK_HEADER = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")
_MARKER = re.compile(r"stoa-patch:\s*[\w.-]+")
_COMMIT = re.compile(r"\bcommit ([0-9a-f]{40})\b")


class PatchFormatError(ValueError):
    """The patch file is not a unified diff this script understands."""


@dataclass
class Hunk:
    old_start: int  # 1-based line number in the original file
    old: list[str] = field(default_factory=list)  # context + removed lines, without line ends
    new: list[str] = field(default_factory=list)  # context + added lines, without line ends


@dataclass
class FilePatch:
    path: str  # relative to the checkout root
    hunks: list[Hunk] = field(default_factory=list)


@dataclass
class Patch:
    name: str
    files: list[FilePatch]
    marker: str | None  # e.g. "stoa-patch: publish_weights"
    commit: str | None  # the slime commit the patch was written against


@dataclass
class Status:
    state: str  # APPLIED, NOT_APPLIED or NOT_APPLICABLE
    message: str = ""


# -- parsing ------------------------------------------------------------------------------------
def _strip_prefix(path: str) -> str:
    """`a/x/y.py` -> `x/y.py` (like `patch -p1`); the timestamp after a tab is dropped."""
    path = path.split("\t", 1)[0].strip()
    if path.startswith(("a/", "b/")):
        return path[2:]
    return path


def parse_patch(text: str, name: str = "<patch>") -> Patch:
    """Parse a unified diff (leading commentary is allowed, as `git apply` allows it)."""
    lines = text.splitlines()
    files: list[FilePatch] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("--- ") and i + 1 < len(lines) and lines[i + 1].startswith("+++ "):
            files.append(FilePatch(_strip_prefix(lines[i + 1][4:])))
            i += 2
            continue
        match = _HUNK_HEADER.match(line)
        if match:
            if not files:
                raise PatchFormatError(f"{name}: hunk at line {i + 1} comes before any file header")
            hunk, i = _parse_hunk(lines, i, match, name)
            files[-1].hunks.append(hunk)
            continue
        i += 1
    if not files or not all(f.hunks for f in files):
        raise PatchFormatError(f"{name}: no file with hunks found; is it a unified diff?")
    added = [ln for f in files for h in f.hunks for ln in h.new if ln not in h.old]
    markers = [m.group(0) for ln in added if (m := _MARKER.search(ln))]
    commit = _COMMIT.search(text)
    return Patch(name, files, markers[0] if markers else None, commit.group(1) if commit else None)


def _parse_hunk(lines: list[str], i: int, match: re.Match[str], name: str) -> tuple[Hunk, int]:
    old_count = int(match.group(2) or 1)
    new_count = int(match.group(4) or 1)
    hunk = Hunk(old_start=int(match.group(1)))
    i += 1
    while len(hunk.old) < old_count or len(hunk.new) < new_count:
        if i >= len(lines):
            raise PatchFormatError(f"{name}: hunk at line {match.group(0)!r} ends early")
        line = lines[i]
        tag, body = (line[:1], line[1:]) if line else (" ", "")  # a blank line is blank context
        if tag == " ":
            hunk.old.append(body)
            hunk.new.append(body)
        elif tag == "-":
            hunk.old.append(body)
        elif tag == "+":
            hunk.new.append(body)
        elif tag != "\\":  # "\ No newline at end of file" is ignored
            raise PatchFormatError(f"{name}: unexpected line {i + 1} in hunk: {line!r}")
        i += 1
    return hunk, i


# -- matching -----------------------------------------------------------------------------------
def _find_block(lines: list[str], block: list[str], hint: int, start: int = 0) -> int | None:
    """Index of `block` in `lines` at or after `start`, nearest to `hint`; None if absent."""
    n = len(block)
    found = [i for i in range(start, len(lines) - n + 1) if lines[i : i + n] == block]
    return min(found, key=lambda i: abs(i - hint)) if found else None


def _locate(lines: list[str], hunks: list[Hunk], side: str) -> list[int] | None:
    """Positions of every hunk's `old` or `new` side, in order; None if one is missing."""
    positions, start, offset = [], 0, 0
    for hunk in hunks:
        block = hunk.old if side == "old" else hunk.new
        hint = hunk.old_start - 1 + offset
        at = _find_block(lines, block, hint, start)
        if at is None:
            return None
        positions.append(at)
        start, offset = at + len(block), at - (hunk.old_start - 1)
    return positions


def _first_mismatch(lines: list[str], hunk: Hunk) -> str:
    """Describe the first differing line where the hunk's old side matches best."""
    n, hint = len(hunk.old), hunk.old_start - 1
    starts = range(-n + 1, len(lines))  # partial overlaps at both ends count too

    def score(i: int) -> tuple[int, int]:
        same = sum(0 <= i + k < len(lines) and lines[i + k] == want for k, want in enumerate(hunk.old))
        return same, -abs(i - hint)

    best = max(starts, key=score) if lines else 0
    for k, want in enumerate(hunk.old):
        have = lines[best + k] if 0 <= best + k < len(lines) else None
        if have != want:
            found = "the end of the file" if have is None else repr(have.strip())
            return f"line {best + k + 1}: expected {want.strip()!r}, found {found}"
    return f"near line {best + 1}: the lines match, but not in the hunk's order"


def _read_lines(path: Path) -> tuple[list[str], str, bool]:
    """The file's lines without line ends, its line end, and whether the last line has one."""
    text = path.read_bytes().decode("utf-8")  # no newline translation
    newline = "\r\n" if "\r\n" in text else "\n"
    return text.splitlines(), newline, text.endswith(("\n", "\r"))


def _file_status(root: Path, patch: Patch, fp: FilePatch) -> Status:
    target = root / fp.path
    if not target.is_file():
        return Status(
            NOT_APPLICABLE,
            f"{fp.path} does not exist under {root}: is this a slime checkout, and of a version "
            f"that still has this file?{_advice(patch, fp)}",
        )
    lines, _, _ = _read_lines(target)
    has_marker = patch.marker is not None and any(patch.marker in ln for ln in lines)
    if _locate(lines, fp.hunks, "new") is not None and (has_marker or patch.marker is None):
        return Status(APPLIED)
    if has_marker:
        return Status(
            NOT_APPLICABLE,
            f"{fp.path} carries the marker {patch.marker!r} but its code differs from the patch "
            f"(edited after patching?). Restore the file (e.g. `git checkout -- {fp.path}` in the "
            f"slime checkout) and run this script again.",
        )
    if _locate(lines, fp.hunks, "old") is not None:
        return Status(NOT_APPLIED)
    for number, hunk in enumerate(fp.hunks, 1):
        if _find_block(lines, hunk.old, hunk.old_start - 1) is None:
            where = f"hunk {number} (near line {hunk.old_start}): {_first_mismatch(lines, hunk)}"
            break
    else:
        where = "the hunks match only out of order"
    return Status(
        NOT_APPLICABLE,
        f"slime's code in {fp.path} no longer matches the context of {patch.name}; {where}."
        f"{_advice(patch, fp)}",
    )


def _advice(patch: Patch, fp: FilePatch) -> str:
    written = f" (written against slime commit {patch.commit})" if patch.commit else ""
    return (
        f" To fix: port the change in patches/{patch.name}{written} to this slime version by hand "
        f"in {fp.path}, then regenerate the patch from `git diff` of the slime checkout; "
        f"or use the slime commit the patch was written against."
    )


def patch_status(root: Path, patch: Patch) -> Status:
    """The patch's status in the checkout at `root` (all files must agree)."""
    statuses = [_file_status(root, patch, fp) for fp in patch.files]
    bad = [s for s in statuses if s.state == NOT_APPLICABLE]
    if bad:
        return Status(NOT_APPLICABLE, " ".join(s.message for s in bad))
    states = {s.state for s in statuses}
    if states == {APPLIED}:
        return Status(APPLIED)
    if states == {NOT_APPLIED}:
        return Status(NOT_APPLIED)
    done = [fp.path for fp, s in zip(patch.files, statuses, strict=False) if s.state == APPLIED]
    return Status(
        NOT_APPLICABLE,
        f"{patch.name} is only partly applied (already patched: {', '.join(done)}). Restore those "
        f"files in the slime checkout (e.g. `git checkout -- <file>`) and run this script again.",
    )


# -- applying -----------------------------------------------------------------------------------
def patched_text(lines: list[str], newline: str, hunks: list[Hunk], final_newline: bool = True) -> str:
    """The file's text with every hunk applied (the old sides must all be found)."""
    positions = _locate(lines, hunks, "old")
    if positions is None:
        raise ValueError("the patch context does not match")
    out = list(lines)
    for at, hunk in sorted(zip(positions, hunks, strict=False), key=lambda p: p[0], reverse=True):
        out[at : at + len(hunk.old)] = hunk.new
    return newline.join(out) + (newline if final_newline else "")


def _write_atomic(path: Path, text: str) -> None:
    """Replace `path` with `text` (UTF-8, newlines as given), keeping the file's permissions."""
    atomic_write(path, text.encode("utf-8"), mode=path.stat().st_mode & 0o7777, durable=False)


def apply_patch(root: Path, patch: Patch) -> None:
    """Apply a patch whose status is NOT_APPLIED (every file's new text is computed first)."""
    texts = {}
    for fp in patch.files:
        lines, newline, final_newline = _read_lines(root / fp.path)
        texts[fp.path] = patched_text(lines, newline, fp.hunks, final_newline)
    for path, text in texts.items():
        _write_atomic(root / path, text)


# -- command line -------------------------------------------------------------------------------
def load_patches(paths: list[Path]) -> list[Patch]:
    return [parse_patch(p.read_text(encoding="utf-8"), p.name) for p in paths]


def run(root: Path, patches: list[Patch], *, check: bool, out: TextIO | None = None) -> int:
    """Report (and unless `check`, apply) every patch; returns the exit code."""
    out = out or sys.stdout
    statuses = [(p, patch_status(root, p)) for p in patches]
    for patch, status in statuses:
        print(f"{patch.name}: {status.state}" + (f"\n  {status.message}" if status.message else ""), file=out)
    if any(s.state == NOT_APPLICABLE for _, s in statuses):
        print("refusing to change anything: a patch does not match this slime checkout.", file=out)
        return EXIT_NOT_APPLICABLE
    pending = [p for p, s in statuses if s.state == NOT_APPLIED]
    if check:
        return EXIT_NOT_APPLIED if pending else EXIT_OK
    for patch in pending:
        apply_patch(root, patch)
        print(f"{patch.name}: patched {', '.join(fp.path for fp in patch.files)}", file=out)
    if not pending:
        print("nothing to do: every patch is already applied.", file=out)
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkout", type=Path, help="root of the slime source checkout")
    parser.add_argument("--check", action="store_true", help="report only; change nothing")
    parser.add_argument(
        "--patch", type=Path, action="append", dest="patches",
        help=f"a patch file (repeatable; default: {PATCH_GLOB} in this repository's patches/)",
    )
    args = parser.parse_args(argv)
    root: Path = args.checkout
    if not root.is_dir():
        print(f"error: slime checkout {root} is not a folder", file=sys.stderr)
        return EXIT_USAGE
    paths = args.patches or sorted(PATCH_DIR.glob(PATCH_GLOB))
    if not paths:
        print(f"error: no patches found ({PATCH_DIR / PATCH_GLOB})", file=sys.stderr)
        return EXIT_USAGE
    try:
        patches = load_patches(paths)
    except (OSError, UnicodeDecodeError, PatchFormatError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    return run(root, patches, check=args.check)
