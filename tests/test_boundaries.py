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
    aiobotocore, botocore, aiohttp   only from the S3 backend (slime_stoa/protocol/store/s3*.py)
    mlx_lm              only from macd/generate.py
    slime_stoa.cli      only from slime_stoa/cli/
    judging/            from this project, only slime_stoa.protocol and slime_stoa.tasks; no torch,
                        mlx, mlx_lm or slime (the trainer and evaluation both stand on it)
    slime_stoa.trainer.slime   never from slime_stoa/quickstart/

and no import cycles: none between files (modules), none between the subpackages of any package
(`slime_stoa.evaluation` and `slime_stoa.trainer`, say, counting every file below each).
"""

from __future__ import annotations

import ast
import itertools
from collections.abc import Callable, Iterable, Mapping
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
    "judging_uses_only_protocol_and_tasks": dict(
        files=["slime_stoa/judging/"],
        forbidden=["slime_stoa", "torch", "mlx", "mlx_lm", "slime"],
        allowed=["slime_stoa.protocol", "slime_stoa.tasks", "slime_stoa.judging"],
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
    ),
    "only_s3_backend_imports_boto": dict(
        files=["slime_stoa/", "macd/"],
        forbidden=["aiobotocore", "botocore", "aiohttp"],
        except_files=[
            "slime_stoa/protocol/store/s3.py",
            "slime_stoa/protocol/store/s3_connection.py",
            "slime_stoa/protocol/store/s3_errors.py",
            "slime_stoa/protocol/store/s3_write.py",
        ],
    ),
    "only_macd_generate_imports_mlx_lm": dict(
        files=["slime_stoa/", "macd/"],
        forbidden=["mlx_lm"],
        except_files=["macd/generate.py"],
    ),
    "only_cli_imports_cli": dict(
        files=["slime_stoa/", "macd/"],
        forbidden=["slime_stoa.cli"],
        except_files=["slime_stoa/cli/"],
    ),
    "quickstart_never_imports_trainer_slime": dict(
        files=["slime_stoa/quickstart/"],
        forbidden=["slime_stoa.trainer.slime"],
    ),
}


# -- cycles ---------------------------------------------------------------------------------------


Edges = dict[str, dict[str, str]]  # module -> {module it imports: where (`path:line`, the first)}


def _project_module(root: Path, name: str) -> str | None:
    """The module (file) of `root` that importing `name` names: `name` itself, else the nearest
    enclosing module (an attribute path); None outside the scanned packages."""
    parts = name.split(".")
    if parts[0] not in PACKAGES:
        return None
    while parts and not _is_project_module(root, ".".join(parts)):
        parts.pop()
    return ".".join(parts) or None


def module_edges(root: Path, graph: Iterable[Import]) -> Edges:
    """The project-internal import graph between modules (each file a node; a package is its
    `__init__.py`), every import counted (lazy ones too). Only the module named is an edge, not
    the packages above it that Python also initialises."""
    edges: Edges = {}
    for imp in graph:
        src = module_name(Path(imp.path))
        for target in imp.targets:
            dst = _project_module(root, target)
            if dst is not None and dst != src:
                edges.setdefault(src, {}).setdefault(dst, f"{imp.path}:{imp.line}")
    return edges


def _components(edges: Mapping[str, Mapping[str, str]]) -> list[list[str]]:
    """The strongly connected components of more than one node, each sorted (Tarjan, iterative)."""
    nodes = sorted(set(edges) | {d for out in edges.values() for d in out})
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in nodes:
        if start in index:
            continue
        work = [(start, iter(sorted(edges.get(start, ()))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return sorted(found)


def _shortest_cycle(edges: Mapping[str, Mapping[str, str]], start: str, within: set[str]) -> list[str]:
    """The shortest cycle from `start` back to it inside the component `within` (breadth first,
    neighbours in name order): [start, ..., start]."""
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for node in frontier:
            for child in sorted(edges.get(node, ())):
                if child not in within:
                    continue
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if child not in came_from:
                    came_from[child] = node
                    nxt.append(child)
        frontier = nxt
    raise AssertionError(f"{start} is on no cycle in {sorted(within)}")


def cycles(edges: Mapping[str, Mapping[str, str]]) -> list[str]:
    """`a -> b -> a (where a imports b; where b imports a)` for each node on a cycle: the shortest
    cycle through it, each cycle once (rotated to start at its smallest node)."""
    out: dict[tuple[str, ...], str] = {}
    for component in _components(edges):
        members = set(component)
        for node in component:
            cycle = _shortest_cycle(edges, node, members)[:-1]
            first = cycle.index(min(cycle))
            cycle = cycle[first:] + cycle[:first] + [cycle[first]]
            where = "; ".join(edges[a][b] for a, b in itertools.pairwise(cycle))
            out.setdefault(tuple(cycle), f"{' -> '.join(cycle)} ({where})")
    return sorted(out.values())


def file_cycles(root: Path, graph: Iterable[Import]) -> list[str]:
    """Import cycles between modules."""
    return cycles(module_edges(root, graph))


def packages_in(root: Path, packages: Iterable[str] = PACKAGES) -> list[str]:
    """Every package (folder with an `__init__.py`) under `root/<package>/`, as a dotted name."""
    return sorted(".".join(p.parent.relative_to(root).parts) for pkg in packages for p in (root / pkg).rglob("__init__.py"))


def package_cycles(root: Path, graph: Iterable[Import]) -> list[str]:
    """Import cycles between the subpackages of a package: for each package, the graph of its
    direct subpackages, with an edge A -> B when any module at or below A imports one at or below
    B (the modules directly in the package take no part)."""
    edges = module_edges(root, graph)
    found: list[str] = []
    every = packages_in(root)
    for package in every:
        subs = [p for p in every if p.rpartition(".")[0] == package]

        def sub_of(module: str, subs: list[str] = subs) -> str | None:
            return next((p for p in subs if _under(module, [p])), None)

        collapsed: Edges = {}
        for src, out in edges.items():
            a = sub_of(src)
            for dst, where in out.items():
                b = sub_of(dst)
                if a is not None and b is not None and a != b:
                    collapsed.setdefault(a, {}).setdefault(b, where)
        found += cycles(collapsed)
    return sorted(found)


CYCLE_RULES: dict[str, Callable[[Path, list[Import]], list[str]]] = {
    "no_import_cycles_between_files": file_cycles,
    "no_import_cycles_between_packages": package_cycles,
}
RULES = [*BOUNDARIES, *CYCLE_RULES]


def check_boundaries(root: Path) -> dict[str, list[str]]:
    """Each rule's violations in the tree at `root` (the folder holding slime_stoa/ and macd/)."""
    graph = import_graph(root)
    found = {rule: violations(graph, **spec) for rule, spec in BOUNDARIES.items()}
    return found | {rule: check(root, graph) for rule, check in CYCLE_RULES.items()}


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


def test_checker_reports_cli_imports_and_quickstart_imports_of_trainer_slime(tmp_path: Path) -> None:
    _clean_tree(tmp_path)
    _write(tmp_path, "slime_stoa/cli/__init__.py", "from . import task_cmd\n")
    _write(tmp_path, "slime_stoa/cli/task_cmd.py", "from slime_stoa.cli.common import error\n")
    _write(tmp_path, "slime_stoa/cli/common.py", "")
    _write(tmp_path, "slime_stoa/quickstart/__init__.py", "")
    _write(tmp_path, "slime_stoa/quickstart/seeding.py", "def f():\n    from slime_stoa.cli.task_cmd import put\n")
    _write(tmp_path, "slime_stoa/quickstart/run.py", "from ..trainer.slime.publish import publish\nfrom ..trainer import learner\n")
    _write(tmp_path, "slime_stoa/trainer/learner.py", "from .slime.publish import publish\n")
    _write(tmp_path, "slime_stoa/trainer/slime/publish.py", "")
    found = check_boundaries(tmp_path)
    assert found["only_cli_imports_cli"] == ["slime_stoa/quickstart/seeding.py:2: imports slime_stoa.cli.task_cmd"]
    assert found["quickstart_never_imports_trainer_slime"] == [
        "slime_stoa/quickstart/run.py:1: imports slime_stoa.trainer.slime.publish"
    ]
    assert sum(map(len, found.values())) == 2, found


def test_checker_reports_file_cycles_with_where_each_import_is(tmp_path: Path) -> None:
    _clean_tree(tmp_path)
    _write(tmp_path, "macd/cli.py", "from . import run_cmd, join_cmd\n")
    _write(tmp_path, "macd/run_cmd.py", "def f():\n    from .cli import error\n")
    _write(tmp_path, "macd/join_cmd.py", "import macd.cli\n")
    _write(tmp_path, "slime_stoa/protocol/pulse/__init__.py", "")
    _write(tmp_path, "slime_stoa/protocol/pulse/a.py", "from .b import x\n")
    _write(tmp_path, "slime_stoa/protocol/pulse/b.py", "\nfrom slime_stoa.protocol.pulse import c\n")
    _write(tmp_path, "slime_stoa/protocol/pulse/c.py", "import importlib\n\nimportlib.import_module('slime_stoa.protocol.pulse.a')\n")
    found = check_boundaries(tmp_path)
    assert found["no_import_cycles_between_files"] == [
        "macd.cli -> macd.join_cmd -> macd.cli (macd/cli.py:1; macd/join_cmd.py:1)",
        "macd.cli -> macd.run_cmd -> macd.cli (macd/cli.py:1; macd/run_cmd.py:2)",
        "slime_stoa.protocol.pulse.a -> slime_stoa.protocol.pulse.b -> slime_stoa.protocol.pulse.c -> "
        "slime_stoa.protocol.pulse.a (slime_stoa/protocol/pulse/a.py:1; slime_stoa/protocol/pulse/b.py:2; "
        "slime_stoa/protocol/pulse/c.py:3)",
    ]
    assert sum(map(len, found.values())) == 3, found


def test_checker_reports_package_cycles_that_no_file_cycle_shows(tmp_path: Path) -> None:
    _clean_tree(tmp_path)
    _write(tmp_path, "slime_stoa/evaluation/__init__.py", "")
    _write(tmp_path, "slime_stoa/evaluation/collect.py", "from slime_stoa.trainer.consumer.admission import judge\n")
    _write(tmp_path, "slime_stoa/evaluation/fleet.py", "")
    _write(tmp_path, "slime_stoa/trainer/consumer/__init__.py", "")
    _write(tmp_path, "slime_stoa/trainer/consumer/admission.py", "")
    _write(tmp_path, "slime_stoa/trainer/slime/rollout.py", "from slime_stoa.evaluation.fleet import post\n")
    found = check_boundaries(tmp_path)
    assert found["no_import_cycles_between_files"] == []
    assert found["no_import_cycles_between_packages"] == [
        "slime_stoa.evaluation -> slime_stoa.trainer -> slime_stoa.evaluation "
        "(slime_stoa/evaluation/collect.py:1; slime_stoa/trainer/slime/rollout.py:1)"
    ]
    assert sum(map(len, found.values())) == 1, found
    # A package importing its own subpackages, and they it, is no cycle between subpackages.
    _write(tmp_path, "slime_stoa/trainer/slime/rollout.py", "from slime_stoa.trainer.consumer import admission\n")
    assert check_boundaries(tmp_path)["no_import_cycles_between_packages"] == []


def test_cycles_reports_each_cycle_once_from_its_smallest_module() -> None:
    edges = {"b": {"c": "b.py:1"}, "c": {"a": "c.py:1", "b": "c.py:2"}, "a": {"b": "a.py:1"}, "d": {"a": "d.py:1"}}
    assert cycles(edges) == ["a -> b -> c -> a (a.py:1; b.py:1; c.py:1)", "b -> c -> b (b.py:1; c.py:2)"]
    assert cycles({"a": {"b": "a.py:1"}, "b": {"c": "b.py:1"}}) == []


def test_checker_keeps_judging_below_the_trainer(tmp_path: Path) -> None:
    _clean_tree(tmp_path)
    _write(tmp_path, "slime_stoa/judging/__init__.py", "")
    _write(tmp_path, "slime_stoa/judging/scoring.py", "from slime_stoa.protocol import store\nfrom . import signers\n")
    _write(tmp_path, "slime_stoa/judging/signers.py", "def f():\n    from slime_stoa.trainer.consumer import state\n")
    found = check_boundaries(tmp_path)
    assert found["judging_uses_only_protocol_and_tasks"] == [
        "slime_stoa/judging/signers.py:2: imports slime_stoa.trainer.consumer"
    ], found
