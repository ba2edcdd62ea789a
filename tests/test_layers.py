"""The packages of headroom stay layered: no circle of imports between them (imports inside
functions included), top-level modules included, none between the modules of one package,
`headroom.fit` on top, each package importing only from those listed before it in
docs/architecture.md, and few imports of another package's private modules (each package
exports what others need from its ``__init__``)."""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

import pytest

import headroom
import headroom as hr
import headroom.planner

ROOT = Path(headroom.__file__).parent
PACKAGES = {p.name for p in ROOT.iterdir() if (p / "__init__.py").exists()}
# Top-level modules are units of the layering too (the package root, ``headroom``, is the one
# exception: the parent of every module, loaded before any of them, on top of every layer).
MODULES = {p.stem for p in ROOT.glob("*.py") if p.stem != "__init__"}
ARCHITECTURE = ROOT.parents[1] / "docs" / "architecture.md"

# Imports of another package's private module that remain, each for a reason. A new one should
# use (or add) a name the package exports instead.
ALLOWED_PRIVATE = {
    # an estimate's report is the tracker's report of the dry run
    ("fit/_estimate.py", "headroom.memory._report"),
    # the command's estimate and plan subcommands, loaded only when one runs
    ("cli.py", "headroom.fit._cli"),
}


def _import_nodes(tree: ast.AST, *, type_checking: bool = True) -> list[ast.stmt]:
    """Every import statement of a file, at any depth (inside functions, and under
    TYPE_CHECKING unless ``type_checking`` is false)."""
    out: list[ast.stmt] = []

    def visit(node: ast.AST) -> None:
        if not type_checking and isinstance(node, ast.If) \
                and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            out.append(node)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return out


def _imports(tree: ast.AST, *, type_checking: bool = True) -> list[str]:
    """Every module a file imports, at any depth (inside functions, and under TYPE_CHECKING
    unless ``type_checking`` is false)."""
    out = []
    for node in _import_nodes(tree, type_checking=type_checking):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append(node.module)
            # `from headroom.x import _y` (and `from headroom import _y`) may name a private
            # submodule
            out.extend(f"{node.module}.{a.name}" for a in node.names
                       if node.module.count(".") <= 1 and a.name.startswith("_"))
        elif isinstance(node, ast.Import):
            out.extend(a.name for a in node.names)
    return out


def _unit(parts: list[str]) -> str | None:
    """The layering unit of module ``headroom.<parts>``: its package or top-level module, or
    None for the package root and names it defines (``__version__``)."""
    if not parts:
        return None
    return parts[0] if parts[0] in PACKAGES or parts[0] in MODULES else None


def _graph() -> tuple[dict[str, set[str]], set[tuple[str, str]]]:
    edges: dict[str, set[str]] = defaultdict(set)
    private: set[tuple[str, str]] = set()
    for f in ROOT.rglob("*.py"):
        rel = f.relative_to(ROOT)
        me = _unit([*rel.parts[:-1], rel.stem]) if len(rel.parts) > 1 else _unit([rel.stem])
        if me is None:
            continue  # the package root: on top (its table names every layer)
        for module in _imports(ast.parse(f.read_text())):
            parts = module.split(".")
            if parts[0] != "headroom" or (to := _unit(parts[1:])) is None or to == me:
                continue
            edges[me].add(to)
            if to in PACKAGES and len(parts) > 2 and parts[2].startswith("_"):
                private.add((rel.as_posix(), ".".join(parts[:3])))
    return edges, private


def _module_graph(package: str) -> dict[str, set[str]]:
    """Imports between the modules of one package that run (at import or in a function; not
    those under TYPE_CHECKING, which never run). ``from headroom.pkg import _mod`` imports
    ``_mod``; ``from headroom.pkg import name`` imports the package's ``__init__``."""
    own = {f.stem for f in (ROOT / package).glob("*.py")}
    me = f"headroom.{package}"
    edges: dict[str, set[str]] = defaultdict(set)
    for f in (ROOT / package).glob("*.py"):
        targets: set[str] = set()
        for node in _import_nodes(ast.parse(f.read_text()), type_checking=False):
            if isinstance(node, ast.ImportFrom) and node.module == me:
                # a private name is a submodule (a compiled one, _bitkernels, has no .py)
                targets |= {a.name if a.name in own else "__init__" for a in node.names
                            if not (a.name.startswith("_") and a.name not in own)}
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(me + "."):
                targets.add(node.module.split(".")[2])
            elif isinstance(node, ast.Import):
                targets |= {a.name.split(".")[2] for a in node.names
                            if a.name.startswith(me + ".")}
                targets |= {"__init__" for a in node.names if a.name == me}
        edges[f.stem] |= {t for t in targets if t in own and t != f.stem}
    return edges


def _architecture_order() -> list[str]:
    """The units docs/architecture.md lists, in its order."""
    block = ARCHITECTURE.read_text().split("```")[1]
    return [m[1] for line in block.splitlines()
            if (m := re.match(r"(\w+)(?:/|\.py)?\s", line)) and m[1] != "text"]


def _cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One circle of imports between packages, or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(a: str) -> list[str] | None:
        state[a] = 1
        stack.append(a)
        for b in sorted(edges.get(a, ())):
            if state.get(b) == 1:
                return stack[stack.index(b):] + [b]
            if b not in state and (found := visit(b)):
                return found
        stack.pop()
        state[a] = 2
        return None

    for a in sorted(edges):
        if a not in state and (found := visit(a)):
            return found
    return None


def test_no_circle_of_imports_between_packages():
    edges, _ = _graph()
    assert _cycle(edges) is None, " -> ".join(_cycle(edges) or [])


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_no_circle_of_imports_inside_a_package(package):
    edges = _module_graph(package)
    assert _cycle(edges) is None, f"{package}: " + " -> ".join(_cycle(edges) or [])


def test_each_unit_imports_only_those_listed_before_it_in_the_architecture():
    order = _architecture_order()
    assert set(order) == PACKAGES | MODULES, sorted(set(order) ^ (PACKAGES | MODULES))
    edges, _ = _graph()
    later = sorted((a, b) for a, bs in edges.items() for b in bs
                   if order.index(b) > order.index(a))
    assert not later, later


def _files_naming(words: re.Pattern[str], *, outside: tuple[str, ...]) -> set[str]:
    """The files, but those under the folders ``outside``, whose code (comments left out) names
    one of ``words`` (``threading.Event`` is not an accelerator's event)."""
    found = set()
    for f in ROOT.rglob("*.py"):
        rel = f.relative_to(ROOT).as_posix()
        if rel.startswith(outside):
            continue
        code = "\n".join(line.split("#")[0] for line in f.read_text().splitlines())
        if any(not m.string[max(0, m.start() - 10):m.start()].endswith("threading.")
               for m in words.finditer(code)):
            found.add(rel)
    return found


_STREAM_WORDS = re.compile(
    r"\b(current_stream|wait_stream|wait_event|record_event|Stream|Event)\b")
_PAGE_LOCKED_WORDS = re.compile(r"\b(pin_memory|is_pinned|cudaHostRegister)\b")


def test_streams_and_events_stay_in_transfer():
    # What docs/architecture.md says of transfer/ (store/, below it, knows none), and the places
    # outside it that order compute after copies other code issued (FSDP2's), each for a reason
    # given there.
    allowed = {"residency/_schedule.py", "residency/_sharded_disk.py"}
    found = _files_naming(_STREAM_WORDS, outside=("transfer/",))
    assert found <= allowed, sorted(found - allowed)


def test_page_locked_memory_stays_in_store_and_transfer():
    # store/ makes page-locked memory and transfer/ copies through it; residency/ composes with
    # FSDP2's copies (a page-locked buffer for a shard read from disk, FSDP2's page-locked flag).
    allowed = {"residency/_sharded_disk.py", "residency/_dtensor.py"}
    found = _files_naming(_PAGE_LOCKED_WORDS, outside=("store/", "transfer/"))
    assert found <= allowed, sorted(found - allowed)


def test_the_checker_sees_streams_and_page_locked_memory():
    assert "transfer/_mover.py" in _files_naming(_STREAM_WORDS, outside=("store/",))
    assert "store/_pinned.py" in _files_naming(_PAGE_LOCKED_WORDS, outside=("transfer/",))


def test_lower_layers_use_nothing_of_the_package_root_but_its_version():
    # ``import headroom as hr`` (the public table) is for the top: fit/'s CLI, cli, _demo
    top = {"fit", "planner", "cli", "_demo"}
    for f in ROOT.rglob("*.py"):
        rel = f.relative_to(ROOT)
        if len(rel.parts) == 1 and rel.stem == "__init__":
            continue
        unit = rel.parts[0] if len(rel.parts) > 1 else rel.stem
        if unit in top:
            continue
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Import):
                assert "headroom" not in [a.name for a in node.names], rel
            if isinstance(node, ast.ImportFrom) and node.module == "headroom":
                names = {a.name for a in node.names}
                assert names <= {"__version__"} | MODULES | PACKAGES, (rel, names)


def test_fit_is_on_top():
    edges, _ = _graph()
    importers = sorted(a for a, bs in edges.items() if "fit" in bs)
    # headroom.planner is the former path of the planner, re-exporting headroom.fit; the
    # command runs fit's subcommands
    assert importers == ["cli", "planner"], importers
    assert not edges.get("memory", set()) & {"fit", "planner", "activations", "optim",
                                             "residency", "nn", "heads"}


def test_integrations_sit_above_what_they_compensate_for():
    # residency/ and optim/ emit events; integrations/ (PEFT, DDP) subscribes, imported by
    # hr.offload through _providers, never by a layer below it
    order = _architecture_order()
    assert order.index("integrations") > max(order.index(p) for p in
                                             ("residency", "optim", "distributed"))
    edges, _ = _graph()
    assert sorted(a for a, bs in edges.items() if "integrations" in bs) == []


def test_private_imports_across_packages_are_few():
    _, private = _graph()
    assert private <= ALLOWED_PRIVATE, sorted(private - ALLOWED_PRIVATE)
    assert len(private) <= 3


def test_the_estimator_left_memory_with_a_pointer():
    from headroom import memory

    with pytest.raises(AttributeError, match="use headroom.estimate"):
        memory.estimate  # noqa: B018
    assert hr.estimate is hr.fit.estimate and hr.Estimate is hr.fit.Estimate
    assert hr.plan is hr.planner.plan  # the former path still works


def test_the_checker_sees_a_circle_and_imports_inside_functions():
    tree = ast.parse("def f():\n    from headroom.fit._plan import plan\n")
    assert _imports(tree) == ["headroom.fit._plan"]
    assert _imports(ast.parse("from headroom.memory import _report")) == [
        "headroom.memory", "headroom.memory._report"]
    assert _imports(ast.parse("from headroom import _providers")) == [
        "headroom", "headroom._providers"]
    assert _cycle({"memory": {"fit"}, "fit": {"memory"}}) == ["fit", "memory", "fit"]
    typed = ast.parse("if TYPE_CHECKING:\n    from headroom.a import B\nimport headroom.c\n")
    assert _imports(typed, type_checking=False) == ["headroom.c"]
    assert _unit(["_providers"]) == "_providers" and _unit(["__version__"]) is None
    assert _architecture_order()[-1] == "cli" and _architecture_order()[0] == "_providers"
