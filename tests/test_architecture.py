"""The package's import graph keeps the layout's rules (ARCHITECTURE.md, docs/design.md §2):
folders by role in one order, nothing importing a role above its own, no import circle, no
folder over 15 modules, and no side effect below the loop: the node loop and the attempt reach
none of httpx, docker, pynvml, subprocess or signal, directly or through another module.

The graph is read from the source (every ``import`` a module can run, at its top or inside a
function; ``if TYPE_CHECKING:`` blocks are never run and are left out), so a test of it needs no
import of the package.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "flashnode"

# The roles from the bottom up: a module may import its own role and those before it. The
# package's root modules (errors, clock, sanitise, statefile) are the ground every role stands on.
ROLES = (
    "",
    "config",
    "coordinator",
    "owner",
    "evidence",
    "sandbox",
    "caches",
    "runners",
    "attempt",
    "node",
    "console",
    "cli",
    "__main__",
)
EDGES = ("httpx", "docker", "pynvml", "subprocess", "signal")
MAX_MODULES = 15


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = ["flashnode", *path.relative_to(PACKAGE).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _run_imports(tree: ast.Module) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement that can run: those under ``if TYPE_CHECKING:`` are skipped."""
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def _imports(name: str) -> tuple[set[str], set[str]]:
    """(the package's modules ``name`` imports, the outside top-level names it imports)."""
    path = MODULES[name]
    inner, outer = set(), set()
    for node in _run_imports(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            base = node.module or ""
            if node.level:
                here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                here = here[: len(here) - node.level + 1]
                base = ".".join([*here, base] if base else here)
            # ``from pkg import module`` imports the module; ``from module import name`` the module
            targets = [
                f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names
            ]
        for target in targets:
            if target.split(".")[0] == "flashnode":
                while target not in MODULES:  # an attribute path: the module that holds it
                    target = target.rpartition(".")[0]
                if target != name:
                    inner.add(target)
            else:
                outer.add(target.split(".")[0])
    return inner, outer


GRAPH = {name: _imports(name) for name in MODULES}


def _role(name: str) -> str:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in ROLES else ""


def _ancestors(name: str) -> list[str]:
    """The packages Python runs before the module itself (their ``__init__``)."""
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def test_every_module_belongs_to_a_role_and_no_folder_holds_more_than_fifteen() -> None:
    folders: dict[Path, int] = {}
    for name, path in MODULES.items():
        assert _role(name) in ROLES
        folders[path.parent] = folders.get(path.parent, 0) + 1
    too_big = {str(f.relative_to(PACKAGE.parent)): n for f, n in folders.items() if n > MAX_MODULES}
    assert not too_big
    roots = {n for n in MODULES if _role(n) == "" and n.count(".") > 1}
    assert not roots, f"a folder that is no role: {sorted(roots)}"


def test_no_module_imports_a_role_above_its_own() -> None:
    upward = [
        f"{name} -> {target}"
        for name, (inner, _) in GRAPH.items()
        for target in inner
        if ROLES.index(_role(target)) > ROLES.index(_role(name))
    ]
    assert not upward


def test_the_import_graph_has_no_circle() -> None:
    state: dict[str, int] = {}  # 1: on the path being walked, 2: done
    circles: list[list[str]] = []

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for target in sorted(GRAPH[name][0]):
            if state.get(target) == 1:
                circles.append([*path[path.index(target) :], target])
            elif target not in state:
                visit(target, [*path, target])
        state[name] = 2

    for name in sorted(MODULES):
        if name not in state:
            visit(name, [name])
    assert not circles


def _reach(start: str) -> dict[str, str]:
    """Every module importing ``start`` runs (its packages' ``__init__`` included), each with the
    module that first imported it."""
    seen = {start: ""}
    todo = [start]
    while todo:
        name = todo.pop()
        for target in sorted(GRAPH[name][0] | set(_ancestors(name))):
            if target not in seen:
                seen[target] = name
                todo.append(target)
    return seen


def test_the_loop_and_the_attempt_reach_no_edge_even_through_another_module() -> None:
    below = [n for n in MODULES if _role(n) in ("node", "attempt")]
    assert len(below) > 10
    found = []
    for start in below:
        reached = _reach(start)
        for name, by in reached.items():
            for edge in sorted(GRAPH[name][1] & set(EDGES)):
                chain = [name]
                while by:
                    chain.append(by)
                    by = reached[by]
                found.append(f"{edge} via {' <- '.join(chain)}")
    assert not found, "\n".join(sorted(set(found)))


def test_the_graph_reader_sees_an_edge_through_a_function_level_import() -> None:
    """The walk is not blind to an import hidden in a function: the CLI's commands reach
    subprocess only through other modules, some imported inside functions."""
    assert "subprocess" in GRAPH["flashnode.sandbox.lentcheck"][1]
    reached = _reach("flashnode.cli.main")
    assert any("subprocess" in GRAPH[n][1] for n in reached)


def test_the_phases_use_the_attempts_hooks_and_never_its_orchestrator() -> None:
    """Inside the attempt the arrows run one way: the orchestrator imports the phases and the
    hooks; a phase imports other phases, the hooks and the attempt's parts below them, never the
    orchestrator nor the package that re-exports it; the hooks import no phase."""
    phases = [n for n in MODULES if n.startswith("flashnode.attempt.phases.")]
    assert len(phases) >= 9
    above = {"flashnode.attempt", "flashnode.attempt.orchestrator"}
    upward = [f"{n} -> {t}" for n in phases for t in GRAPH[n][0] & above]
    hooks = GRAPH["flashnode.attempt.hooks"][0]
    upward += [f"hooks -> {t}" for t in hooks if t.startswith("flashnode.attempt.phases")]
    upward += [f"hooks -> {t}" for t in hooks & above]
    assert not upward
    assert set(phases) <= GRAPH["flashnode.attempt.orchestrator"][0] | {
        f"flashnode.attempt.phases.{n}" for n in ("relay", "transfer")
    }


RUNNER_NAMES = ("docker", "trusted")  # the registry's today (runners/registry.py)


def _compares_a_runner_name(node: ast.AST) -> bool:
    """A comparison (``==``, ``!=``, ``in``, a ``match`` case) with a runner's name, or with
    the ``runner`` setting itself."""
    if isinstance(node, ast.Compare):
        operands = [node.left, *node.comparators]
    elif isinstance(node, ast.MatchValue):
        operands = [node.value]
    else:
        return False
    for operand in operands:
        texts = operand.elts if isinstance(operand, (ast.Tuple, ast.List, ast.Set)) else [operand]
        for text in texts:
            if isinstance(text, ast.Constant) and text.value in RUNNER_NAMES:
                return True
        if isinstance(operand, ast.Attribute) and operand.attr == "runner":
            return True
    return False


def test_no_code_outside_the_runners_tells_runners_apart_by_name() -> None:
    """What a runner can do is its ``Capabilities`` (runners/registry.py): a new runner is one
    module and one entry, not an edit of every place that asks."""
    found = []
    for name, path in MODULES.items():
        if _role(name) == "runners":
            continue
        tree = ast.parse(path.read_text(), str(path))
        found += [f"{name}:{n.lineno}" for n in ast.walk(tree) if _compares_a_runner_name(n)]
    assert not found
    test = ast.parse("if settings.runner == 'trusted': pass\nx = s.runner in ('docker', 'y')")
    assert sum(_compares_a_runner_name(n) for n in ast.walk(test)) == 2


def test_the_guards_beside_a_task_touch_the_world_only_through_what_they_are_given() -> None:
    """A guard is a rule under a fake clock (``attempt/guards/``): it imports no module with a
    side effect itself (the clock, processes, files, threads), and reaches no edge through
    another; what it reads of the world (the disk, the task's files) comes in as functions."""
    guards = [n for n in MODULES if n.startswith("flashnode.attempt.guards.")]
    assert len(guards) >= 7
    direct = ("os", "time", "threading", "subprocess", "socket", "shutil", "signal", *EDGES)
    found = [f"{n} imports {m}" for n in guards for m in sorted(GRAPH[n][1] & set(direct))]
    for start in guards:
        found += [f"{start} reaches {e} via {n}" for n in _reach(start) for e in GRAPH[n][1] & set(EDGES)]
    assert not found, "\n".join(found)


MUTATORS = {"append", "extend", "update", "pop", "clear", "setdefault", "insert", "remove"}


def _attempt_written(target: ast.AST) -> bool:
    """Whether ``target`` (assigned to, or a mutator's object) is the attempt or inside it: the
    phases' name for it is ``a`` (``self._a`` in a watcher), its parts ``record`` and ``facts``."""
    node = target
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        if isinstance(node, ast.Attribute) and node.attr in ("record", "facts"):
            return True
        if isinstance(node, ast.Attribute) and node.attr in ("_a", "a") and node is not target:
            return True  # inside the attempt (``self._a = a`` only keeps it)
        node = node.value
    return isinstance(node, ast.Name) and node.id == "a" and node is not target


def test_only_the_orchestrator_writes_the_attempt_phases_call_its_hooks() -> None:
    """A phase reads the attempt and tells it what it made through a hook (``AttemptHooks``:
    ``started``, ``report``, ``evidence``...), so that the record and the live view have one
    writer: no phase assigns to the attempt or its record, nor grows a list of it."""
    phases = [n for n in MODULES if n.startswith("flashnode.attempt.phases.")]
    found = []
    for name in phases:
        tree = ast.parse(MODULES[name].read_text())
        for node in ast.walk(tree):
            targets: list[ast.AST] = []
            if isinstance(node, ast.Assign):
                targets = list(node.targets)
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                targets = [node.target]
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in MUTATORS
            ):
                # a.pauses.append(...): the list grown is inside the attempt
                targets = [ast.Attribute(value=node.func.value, attr="x")]
            for target in targets:
                for t in target.elts if isinstance(target, ast.Tuple) else [target]:
                    if _attempt_written(t):
                        found.append(f"{name}:{node.lineno}")
    assert not found, found
    bad = ast.parse("a.record.x = 1\na.facts['k'] = 2\na.devices = []\na.pauses.append(3)\nself._a.record.y += 1")
    assert sum(
        _attempt_written(t)
        for n in ast.walk(bad)
        if isinstance(n, (ast.Assign, ast.AugAssign))
        for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
    ) == 4
