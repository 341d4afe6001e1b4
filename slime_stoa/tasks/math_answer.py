"""MATH answers: the last ``\\boxed{}`` of a text, normalised as Hendrycks' MATH grader does, and
the bounds that decide which answers are worth a symbolic comparison.

Everything here is pure and linear in its input: extraction scans at most `MAX_BOXED_SCAN_CHARS`
past the last ``\\boxed``, and normalisation runs on at most that much text.

MATH's conventions, kept here: a percent sign is dropped (``10\\%`` is 10, not 0.1), units in a
trailing ``\\text{...}`` are dropped (``5\\text{ cm}`` is 5), ``\\dfrac``/``\\tfrac`` are ``\\frac``,
``\\left``/``\\right``, degree signs, dollar signs and LaTeX spacing are dropped, and a short
left-hand side is dropped (``x = 5`` is 5).
"""

from __future__ import annotations

import re
from fractions import Fraction

MAX_BOXED_SCAN_CHARS = 2048  # how far past "\boxed{" its closing brace is looked for
MAX_ANSWER_CHARS = 400  # a longer normalised answer is never graded symbolically
MAX_BRACE_DEPTH = 8
MAX_NUMBER_DIGITS = 100  # digits of one numeric literal
MAX_EXPONENT_DIGITS = 4  # digits of a numeric exponent (10^{9999} is fine, 10^{99999} is not)
MAX_FACTORIAL_DIGITS = 3  # 999! is fine, 10000! is not

_BOXED = ("\\boxed", "\\fbox")
_TOKEN_RE = re.compile(r"[^\s$]{1,64}")
_THIN_SPACE_RE = re.compile(r"(?<!\\)\\!")  # "\!", not the "\\" of a new row before "!"
_SPACE_RE = re.compile(r"(?<!\\)\\(?:[,;: ]|q?quad)|~")
_TEXT_CMD = r"\\(?:text|textbf|textrm|mathrm|mbox)"
_UNITS_RE = re.compile(r"(?<=\S)\s{0,4}" + _TEXT_CMD + r"\{[^{}]*\}(?:\^\{?[0-9]\}?)?$")
_TEXT_RE = re.compile(_TEXT_CMD + r"\{([^{}]*)\}")
_SQRT_RE = re.compile(r"\\sqrt([0-9A-Za-z])")
_FRAC_SHORT_RE = re.compile(r"\\frac([0-9A-Za-z])([0-9A-Za-z])")
_FRAC_HALF_RE = re.compile(r"\\frac(\{[^{}]*\})([0-9A-Za-z])")
_LHS_RE = re.compile(r"^[A-Za-z][A-Za-z0-9_']{0,1}=(?!=)")
_THOUSANDS_RE = re.compile(r"-?[0-9]{1,3}(?:,[0-9]{3})+(?:\.[0-9]+)?")
_DECIMAL_RE = re.compile(r"-?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)")
_SLASH_RE = re.compile(r"(-?[0-9]+)/(-?[0-9]+)")
_FRAC_NUM_RE = re.compile(r"(-?)\\frac\{(-?[0-9]+)\}\{(-?[0-9]+)\}")
_DIGITS_RE = re.compile(r"[0-9]+")
_EXPONENT_RE = re.compile(r"\^\s*(?:\{\s*(-?[0-9]+)\s*\}|([0-9]+))")
_FACTORIAL_RE = re.compile(r"([0-9]*|[A-Za-z]|[)}\]])\s*!")


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` / ``\\fbox{...}`` (or ``\\boxed X``) in `text`, or
    None when there is none or it is not closed within `MAX_BOXED_SCAN_CHARS`."""
    if not isinstance(text, str):
        return None
    start, cmd = max((text.rfind(cmd), cmd) for cmd in _BOXED)
    if start < 0:
        return None
    i = start + len(cmd)
    spaced = text.startswith(" ", i)
    while text.startswith(" ", i) and i < start + len(cmd) + 8:
        i += 1
    if not text.startswith("{", i):  # "\boxed 5$": the token after the space, up to "$" or a space
        m = _TOKEN_RE.match(text, i) if spaced and cmd == "\\boxed" else None
        return m.group(0) if m else None
    depth = 0
    for j in range(i, min(len(text), i + MAX_BOXED_SCAN_CHARS)):
        c = text[j]
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j]
    return None


def normalize(answer: str) -> str:
    """`answer` in MATH's canonical spelling (see the module docstring); spaces removed. Linear
    time; callers bound the length (`MAX_BOXED_SCAN_CHARS`)."""
    s = answer.replace("\n", "").strip()
    s = _THIN_SPACE_RE.sub("", s)
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = s.replace("\\left", "").replace("\\right", "")
    for degree in ("^{\\circ}", "^\\circ", "\\circ", "°"):
        s = s.replace(degree, "")
    s = s.replace("\\$", "").replace("$", "")
    s = _UNITS_RE.sub("", s)
    s = _TEXT_RE.sub(r"\1", s)
    s = s.replace("\\%", "").replace("%", "")
    s = _SPACE_RE.sub(" ", s)
    s = s.replace(" .", " 0.").replace("{.", "{0.")
    s = "".join(s.split())
    if s.startswith("."):
        s = "0" + s
    if s.count("=") == 1 and _LHS_RE.match(s):
        s = s.split("=", 1)[1]
    s = _SQRT_RE.sub(r"\\sqrt{\1}", s)
    s = _FRAC_SHORT_RE.sub(r"\\frac{\1}{\2}", s)
    s = _FRAC_HALF_RE.sub(r"\\frac\1{\2}", s)
    if _THOUSANDS_RE.fullmatch(s.replace("{,}", ",")):
        s = s.replace("{,}", "").replace(",", "")
    return s


def as_number(answer: str) -> Fraction | None:
    """A normalised answer as an exact number ("-3", "0.25", "3/4", "\\frac{3}{4}",
    "-\\frac{3}{4}"), or None when it is anything else."""
    if len(answer) > MAX_NUMBER_DIGITS + 4:
        return None
    if _DECIMAL_RE.fullmatch(answer):
        return Fraction(answer)
    if m := _SLASH_RE.fullmatch(answer):
        num, den = int(m.group(1)), int(m.group(2))
        return Fraction(num, den) if den else None
    if m := _FRAC_NUM_RE.fullmatch(answer):
        num, den = int(m.group(2)), int(m.group(3))
        if not den:
            return None
        return -Fraction(num, den) if m.group(1) else Fraction(num, den)
    return None


def too_complex(answer: str) -> str | None:
    """Why a normalised answer is not worth a symbolic comparison (its size, nesting, a power
    tower, a huge exponent or factorial), or None when it is within the bounds."""
    if len(answer) > MAX_ANSWER_CHARS:
        return f"{len(answer)} characters (limit {MAX_ANSWER_CHARS})"
    depth = deepest = 0
    for c in answer:
        depth += (c == "{") - (c == "}")
        deepest = max(deepest, depth)
    if deepest > MAX_BRACE_DEPTH:
        return f"braces nested {deepest} deep (limit {MAX_BRACE_DEPTH})"
    if any(len(d) > MAX_NUMBER_DIGITS for d in _DIGITS_RE.findall(answer)):
        return f"a number over {MAX_NUMBER_DIGITS} digits"
    if _power_tower(answer):
        return "a power tower"
    for m in _EXPONENT_RE.finditer(answer):
        digits = (m.group(1) or m.group(2)).lstrip("-")
        if len(digits.lstrip("0")) > MAX_EXPONENT_DIGITS:
            return f"an exponent over {MAX_EXPONENT_DIGITS} digits"
    for m in _FACTORIAL_RE.finditer(answer):
        operand = m.group(1)
        if not operand or operand in ")}]" or len(operand.lstrip("0")) > MAX_FACTORIAL_DIGITS:
            return "a factorial of a large or compound operand"
    return None


def _power_tower(answer: str) -> bool:
    """Whether an exponent holds another exponent (``a^{b^c}``, ``a^b^c``, ``a^{(b)^c}``)."""
    i = answer.find("^")
    while i >= 0:
        j = i + 1
        while j < len(answer) and answer[j] == " ":
            j += 1
        if j < len(answer) and answer[j] == "{":
            depth, k = 0, j
            while k < len(answer):
                depth += (answer[k] == "{") - (answer[k] == "}")
                if depth == 0:
                    break
                k += 1
            exponent, after = answer[j : k + 1], k + 1
        else:
            m = re.match(r"\\?[0-9A-Za-z]+", answer[j:])
            exponent, after = (m.group(0) if m else answer[j : j + 1]), j + (len(m.group(0)) if m else 1)
        if "^" in exponent or answer[after : after + 1] == "^" or "\\uparrow" in exponent:
            return True
        i = answer.find("^", i + 1)
    return False


__all__ = [
    "MAX_ANSWER_CHARS",
    "MAX_BOXED_SCAN_CHARS",
    "as_number",
    "last_boxed",
    "normalize",
    "too_complex",
]
