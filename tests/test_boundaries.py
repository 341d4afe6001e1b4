"""Package boundaries, read from the source with `ast` (nothing is imported).

Every import in every .py file under slime_stoa/ and macd/ counts: module-level and lazy (inside a
function), under `if TYPE_CHECKING:` or `try:`, `import x`, `from x import y`, relative imports
(resolved to absolute names) and `importlib.import_module("literal")` / `__import__("literal")`.
A name matches a rule's module `m` when it is `m` or starts with `m.`, so `slime` never matches
`slime_stoa` and `mlx_lm` never matches `mlx`. `import_module(a_variable)` cannot be followed.

    protocol/, tasks/   no torch, mlx, mlx_lm, transformers or slime; none of stoa's other halves
    macd/               from this project, only slime_stoa.protocol and slime_stoa.tasks
    slime               only from slime_stoa/trainer/slime/
    macd                never from slime_stoa
    aiobotocore, botocore, aiohttp   only from slime_stoa/protocol/store/s3.py (and the test S3 server)
    mlx_lm              only from macd/generate.py
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("slime_stoa", "macd")


@dataclass(frozen=True)
class Import:
    path: str  # relative to the scanned root, with forward slashes
    line: int
    module: str  # the absolute module named (for `from m import a, b`: m)
    targets: tuple[str, ...]  # the modules it loads: `from m import a` is m.a when a is a submodule of m


def module_name(rel: Path) -> str:
    """`slime_stoa/protocol/store/s3.py` -> `slime_stoa.protocol.store.s3`; a package's
    `__init__.py` is the package itself."""
    parts = list(rel.with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve(name: str | None, level: int, this_module: str, is_package: bool) -> str:
    if level == 0:
        return name or ""
    package = this_module.split(".") if is_package else this_module.split(".")[:-1]
    base = package[: len(package) - (level - 1)] if level > 1 else package
    return ".".join([*base, name] if name else base)


def _literal_import_call(node: ast.Call) -> str | None:
    """The module of `importlib.import_module("m")`, `import_module("m")` or `__import__("m")`."""
    func = node.func
    if isinstance(func, ast.Attribute):
        called = func.attr
    elif isinstance(func, ast.Name):
        called = func.id
    else:
        return None
    if called not in ("import_module", "__import__") or not node.args:
        return None
    arg = node.args[0]
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return arg.value
    return None


def _is_project_module(root: Path, name: str) -> bool:
    path = root.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _from_targets(root: Path, module: str, names: Iterable[str]) -> tuple[str, ...]:
    """`from m import a, b`: the submodules among a, b (so `from slime_stoa import trainer` is an
    import of slime_stoa.trainer), and m itself when something else (an attribute) is taken."""
    subs = [f"{module}.{n}" for n in names if n != "*" and _is_project_module(root, f"{module}.{n}")]
    attrs = [n for n in names if f"{module}.{n}" not in subs]
    return (module, *subs) if attrs else tuple(subs)


def imports_in(path: Path, root: Path) -> list[Import]:
    rel = path.relative_to(root)
    this, is_package = module_name(rel), rel.name == "__init__.py"
    shown = rel.as_posix()
    found: list[Import] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [Import(shown, node.lineno, a.name, (a.name,)) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = _resolve(node.module, node.level, this, is_package)
            targets = _from_targets(root, module, [a.name for a in node.names])
            found.append(Import(shown, node.lineno, module, targets))
        elif isinstance(node, ast.Call) and (literal := _literal_import_call(node)):
            level = len(literal) - len(literal.lstrip("."))
            module = _resolve(literal[level:] or None, level, this, is_package)
            found.append(Import(shown, node.lineno, module, (module,)))
    return found


def import_graph(root: Path, packages: Iterable[str] = PACKAGES) -> list[Import]:
    """Every import of every .py file under `root/<package>/` for each package, in file order."""
    graph: list[Import] = []
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            graph += imports_in(path, root)
    return sorted(graph, key=lambda i: (i.path, i.line, i.module))


def _under(name: str, modules: Iterable[str]) -> bool:
    return any(name == m or name.startswith(m + ".") for m in modules)


def _in(path: str, folders: Iterable[str]) -> bool:
    """`path` is one of `folders` (a file) or lies below one (a folder ending in '/')."""
    return any(path == f or (f.endswith("/") and path.startswith(f)) for f in folders)


def violations(
    graph: Iterable[Import],
    *,
    files: Iterable[str],
    forbidden: Iterable[str],
    allowed: Iterable[str] = (),
    except_files: Iterable[str] = (),
) -> list[str]:
    """`path:line: imports X` for each import, from a file under `files` (and not under
    `except_files`), of a module under `forbidden` but not under `allowed`."""
    files, forbidden, allowed, except_files = list(files), list(forbidden), list(allowed), list(except_files)
    out = []
    for imp in graph:
        if not _in(imp.path, files) or _in(imp.path, except_files):
            continue
        bad = [t for t in imp.targets if _under(t, forbidden) and not _under(t, allowed)]
        if bad:
            out.append(f"{imp.path}:{imp.line}: imports {', '.join(bad)}")
    return out


# Each rule: arguments for `violations`.
BOUNDARIES: dict[str, dict[str, list[str]]] = {
    "protocol_tasks_no_ml": dict(
        files=["slime_stoa/protocol/", "slime_stoa/tasks/"],
        forbidden=["torch", "mlx", "mlx_lm", "transformers", "slime"],
    ),
    "protocol_tasks_no_other_halves": dict(
        files=["slime_stoa/protocol/", "slime_stoa/tasks/"],
        forbidden=["slime_stoa.trainer", "slime_stoa.quickstart", "slime_stoa.cli", "macd"],
    ),
    "macd_uses_only_protocol_and_tasks": dict(
        files=["macd/"],
        forbidden=["slime_stoa"],
        allowed=["slime_stoa.protocol", "slime_stoa.tasks"],
    ),
    "only_trainer_slime_imports_slime": dict(
        files=["slime_stoa/", "macd/"],
        forbidden=["slime"],
        except_files=["slime_stoa/trainer/slime/"],
    ),
    "slime_stoa_never_imports_macd": dict(
        files=["slime_stoa/"],
        forbidden=["macd"],
        # `stoa eval --local` runs the worker's own MLX generation path in-process (worker extra),
        # so a local score and a fleet score come from the same code.
        except_files=["slime_stoa/evaluation/local.py"],
    ),
    "only_s3_backend_imports_boto": dict(
        files=["slime_stoa/", "macd/"],
        forbidden=["aiobotocore", "botocore", "aiohttp"],
        except_files=[
            "slime_stoa/protocol/store/s3.py",
            # The test S3 server makes buckets with a plain sync botocore client: test set-up,
            # not a second S3 client in the product.
            "slime_stoa/testing/s3server.py",
        ],
    ),
    "only_macd_generate_imports_mlx_lm": dict(
        files=["slime_stoa/", "macd/"],
        forbidden=["mlx_lm"],
        except_files=["macd/generate.py"],
    ),
}
RULES = list(BOUNDARIES)


def check_boundaries(root: Path) -> dict[str, list[str]]:
    """Each rule's violations in the tree at `root` (the folder holding slime_stoa/ and macd/)."""
    graph = import_graph(root)
    return {rule: violations(graph, **spec) for rule, spec in BOUNDARIES.items()}


@pytest.fixture(scope="module")
def repo_violations() -> dict[str, list[str]]:
    return check_boundaries(REPO)


@pytest.mark.parametrize("rule", RULES)
def test_boundary(rule: str, repo_violations: dict[str, list[str]]) -> None:
    found = repo_violations[rule]
    assert not found, f"{rule}: {len(found)} violation(s):\n" + "\n".join(found)


def test_scan_sees_the_whole_tree() -> None:
    """The scan reads both packages and finds their known imports (a guard against a checker
    that passes because it reads nothing)."""
    graph = import_graph(REPO)
    paths = {i.path for i in graph}
    assert "slime_stoa/protocol/store/s3.py" in paths and "macd/worker.py" in paths
    assert any(i.path == "slime_stoa/protocol/store/s3.py" and i.module.startswith("aiobotocore") for i in graph)
    assert any(i.path == "macd/generate.py" and i.module.startswith("mlx_lm") for i in graph)


def _write(root: Path, rel: str, text: str) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")


def _clean_tree(root: Path) -> None:
    for rel in [
        "slime_stoa/__init__.py",
        "slime_stoa/protocol/__init__.py",
        "slime_stoa/protocol/store/__init__.py",
        "slime_stoa/trainer/__init__.py",
        "slime_stoa/trainer/slime/__init__.py",
        "macd/__init__.py",
    ]:
        _write(root, rel, "")
    _write(root, "slime_stoa/protocol/store/s3.py", "import aiohttp\nfrom botocore.exceptions import ClientError\n")
    _write(root, "slime_stoa/trainer/slime/rollout.py", "def f():\n    from slime.utils.types import Sample\n")
    _write(root, "macd/generate.py", "from mlx_lm.generate import BatchGenerator\n")
    _write(root, "macd/worker.py", "from slime_stoa.protocol.store import Store\nfrom . import generate\n")


def test_checker_passes_a_clean_tree(tmp_path: Path) -> None:
    _clean_tree(tmp_path)
    assert check_boundaries(tmp_path) == {rule: [] for rule in RULES}


def test_checker_reports_lazy_import_with_file_and_line(tmp_path: Path) -> None:
    _clean_tree(tmp_path)
    _write(tmp_path, "slime_stoa/protocol/evil.py", '"""Looks harmless."""\n\n\ndef f():\n    import torch\n')
    found = check_boundaries(tmp_path)
    assert found["protocol_tasks_no_ml"] == ["slime_stoa/protocol/evil.py:5: imports torch"]
    assert sum(map(len, found.values())) == 1, found


def test_checker_resolves_relative_and_literal_imports(tmp_path: Path) -> None:
    _clean_tree(tmp_path)
    _write(tmp_path, "slime_stoa/protocol/store/sneaky.py", "from ...trainer import loss\n")
    _write(tmp_path, "slime_stoa/protocol/lazy.py", "import importlib\n\nimportlib.import_module('transformers')\n")
    _write(tmp_path, "slime_stoa/quickstart/__init__.py", "")
    _write(tmp_path, "macd/config.py", "from slime_stoa import quickstart\n")
    _write(tmp_path, "macd/spool.py", "from slime_stoa import protocol\nfrom slime_stoa.protocol import store\n")
    _write(tmp_path, "macd/uploader.py", "def f():\n    import mlx_lm\n")
    _write(tmp_path, "slime_stoa/trainer/learner.py", "import slime_stoa.protocol\nimport slime.utils\n")
    found = check_boundaries(tmp_path)
    assert found["protocol_tasks_no_other_halves"] == [
        "slime_stoa/protocol/store/sneaky.py:1: imports slime_stoa.trainer"
    ]
    assert found["protocol_tasks_no_ml"] == ["slime_stoa/protocol/lazy.py:3: imports transformers"]
    assert found["macd_uses_only_protocol_and_tasks"] == ["macd/config.py:1: imports slime_stoa.quickstart"]
    assert found["only_macd_generate_imports_mlx_lm"] == ["macd/uploader.py:2: imports mlx_lm"]
    assert found["only_trainer_slime_imports_slime"] == ["slime_stoa/trainer/learner.py:2: imports slime.utils"]


def test_relative_imports_resolve_from_modules_and_packages() -> None:
    assert _resolve("config", 1, "macd.cli", is_package=False) == "macd.config"
    assert _resolve(None, 1, "macd.cli", is_package=False) == "macd"
    assert _resolve("base", 1, "slime_stoa.protocol.store", is_package=True) == "slime_stoa.protocol.store.base"
    assert _resolve("layout", 2, "slime_stoa.protocol.store.s3", is_package=False) == "slime_stoa.protocol.layout"
