"""The project's import graph, read from the source (nothing imported): no package holds a cycle, at the
grain of modules and at the grain of the folders that group them.

An edge A -> B is an import of B anywhere in A (at the top or inside a function; not under `if
TYPE_CHECKING:`), and importing B also runs each package `__init__` above B that is not above A, so
that is an edge too. A cycle is what Tarjan's algorithm finds as a strongly connected component of more
than one module, or a module importing itself."""

from __future__ import annotations

import ast
import functools
import pathlib

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("trainjob", "trainer", "launchers", "datacache", "ops", "bench")


def _modules() -> dict[str, pathlib.Path]:
    found = {}
    for package in PACKAGES:
        for path in (REPO / package).rglob("*.py"):
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imported(tree: ast.AST, module: str, is_package: bool) -> set[str]:
    """The dotted names `tree` imports (a `from X import Y` gives X.Y where that is a module, else X)."""
    names: set[str] = set()
    skip = {id(n) for n in ast.walk(tree) if isinstance(n, ast.If) and _type_checking(n)
            for n in ast.walk(n) if n is not None}
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")[: len(module.split(".")) - node.level + (1 if is_package else 0)]
                base = ".".join([*anchor, *([base] if base else [])])
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


@functools.cache
def _graph() -> dict[str, set[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        edges = set()
        for target in _imported(ast.parse(path.read_text()), name, path.name == "__init__.py"):
            while target and target not in modules:  # X.Y where Y is a name in X, not a module
                target = target.rpartition(".")[0]
            if not target:
                continue
            # The packages above the target run too; those above this module are running already.
            own = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 2)}
            parts = target.split(".")
            edges.update(p for p in (".".join(parts[:i]) for i in range(1, len(parts)))
                         if p in modules and p not in own)
            edges.add(target)  # named: an edge even to this module's own package (its face)
        graph[name] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module, and modules importing themselves."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph.get(v, ()):
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_cycle_finder_finds_a_cycle_and_passes_a_chain():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_a_module_importing_its_own_package_face_from_below_is_an_edge():
    graph = _graph()
    assert "trainer.config.schema" in graph["trainer.config"]  # the face imports its sections
    assert "trainer.config" in graph["trainer.parallel.dims"]  # importing trainer.config.strategy runs it
    assert "trainer.config" not in graph["trainer.config.across"]  # the face above runs already


@pytest.mark.parametrize("package", PACKAGES)
def test_no_package_holds_an_import_cycle(package):
    graph = _graph()
    inside = {m: {t for t in edges if t.split(".")[0] == package} for m, edges in graph.items()
              if m.split(".")[0] == package}
    assert cycles(inside) == []


def test_the_whole_project_holds_no_import_cycle():
    assert cycles(_graph()) == []


def _unit(module: str) -> str:
    """The part of the layering `module` belongs to: its sub-package (`trainer.data` for trainer.data.chat),
    or itself where it sits at a package's top (`trainer.worker`)."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 2 or _modules()[module].name == "__init__.py" else module


def _unit_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for module, edges in _graph().items():
        graph.setdefault(_unit(module), set()).update(_unit(t) for t in edges if _unit(t) != _unit(module))
    return graph


def test_the_folders_are_layers_no_two_import_each_other():
    """Each folder (trainer.config, trainer.data, trainer.models, trainer.parallel, ...) stands on the ones below
    it: no chain of imports leads from a folder back into itself; models/ never imports parallel/ (the one
    assembly above both, `trainer.parallel.assembly`, joins them); and the data kinds import no recipe."""
    graph = _unit_graph()
    assert cycles(graph) == []
    assert "trainer.parallel" not in graph["trainer.models"]
    assert "trainer.recipes" not in graph["trainer.data"] and "trainer.recipes" not in graph["trainer.config"]


def test_a_module_belongs_to_its_folder_and_a_top_level_module_to_itself():
    assert _unit("trainer.data.chat") == _unit("trainer.data") == "trainer.data"
    assert _unit("launchers.kubernetes.manifests") == "launchers.kubernetes"
    assert _unit("trainer.training.loop") == "trainer.training"
    assert _unit("trainer.worker") == "trainer.worker" and _unit("trainer") == "trainer"


def test_the_driver_and_the_config_import_nothing_of_the_rank_side_nor_torch():
    import subprocess
    import sys

    probe = ("import sys, trainer.__main__, trainer.prepare.preflight, trainer.config; "
             "print(' '.join(m for m in sys.modules if m in ('torch', 'triton') or m.startswith(('trainer.', 'ops'))))")
    loaded = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, check=True,
                            timeout=60).stdout.split()
    rank_side = ("torch", "triton", "ops", "trainer.worker", "trainer.training.loop", "trainer.prepare.inputs",
                 "trainer.models", "trainer.parallel", "trainer.data", "trainer.recipes", "trainer.observability")
    # ops' face loads its names on first use; of ops, the driver reads only the table of routed ATen ops.
    assert [m for m in loaded if m.startswith(rank_side) and m not in ("ops", "ops.aten_routes")] == []
    assert "ops.aten_routes" in loaded


def _package_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {p: set() for p in PACKAGES}
    for module, edges in _graph().items():
        graph[module.split(".")[0]].update(t.split(".")[0] for t in edges if t.split(".")[0] != module.split(".")[0])
    return graph


def _closure(module: str) -> set[str]:
    graph, seen, todo = _graph(), set(), [module]
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo.extend(graph.get(name, ()))
    return seen


# The driver's modules that join the trainer to the launchers: composing a config with the launchers' schemas,
# checking it by their rules, documenting their keys, and launching the job.
DRIVER_JOINS = {"trainer.__main__", "trainer.config.compose", "trainer.config.validate", "trainer.config.reference",
                "trainer.config.readers", "trainer.sweep.sweeper", "trainer.sweep.settings", "trainer.sweep.trials"}


def test_the_trainer_compares_no_launcher_name_it_reads_what_the_launcher_offers():
    """What a launcher can do is data on it (`trainjob.runtimes.Offers`): no module of trainer/ names one."""
    import re

    named = [f"{path.relative_to(REPO)}:{n}" for path in (REPO / "trainer").rglob("*.py")
             for n, line in enumerate(path.read_text().splitlines(), 1)
             if re.search(r"""["'](local|docker|kubernetes)["']""", line)]
    assert named == []


def test_the_packages_are_layers_trainjob_at_the_bottom_and_launchers_apart_from_the_trainer():
    """At the grain of packages: trainjob (the bottom layer) imports none of the others; launchers and
    datacache stand on it alone, never on the trainer; nothing imports the benches; no cycle."""
    graph = _package_graph()
    assert graph["trainjob"] == set()
    assert graph["launchers"] <= {"trainjob"} and graph["datacache"] <= {"trainjob"}
    assert "trainer" not in graph["launchers"] and "launchers" not in graph["datacache"]
    assert all("bench" not in edges for edges in graph.values())
    assert cycles(graph) == []


def test_a_rank_imports_no_launcher_and_only_the_driver_joins_them():
    """The rank side (everything `trainer.worker` imports, however far) holds no module of launchers; the
    trainer modules that import launchers are the driver's joins, and a rank imports none of them."""
    rank = _closure("trainer.worker")
    assert sorted(m for m in rank if m.startswith("launchers")) == []
    joins = {m for m, edges in _graph().items()
             if m.startswith("trainer") and any(t.startswith("launchers") for t in edges)}
    assert joins == DRIVER_JOINS
    assert rank.isdisjoint(DRIVER_JOINS)


def test_importing_a_rank_loads_no_launcher_and_the_driver_no_backend():
    """What runs, not only what is written: `import trainer.worker` leaves no launcher module loaded, and the
    driver (`trainer.__main__`) loads the launchers' schemas but no launcher's backend (nor Kubernetes' manifests)
    until a run asks for that launcher."""
    import subprocess
    import sys

    probe = ("import sys, {0}; print(' '.join(sorted(m for m in sys.modules if m.startswith('launchers'))))")
    rank = subprocess.run([sys.executable, "-c", probe.format("trainer.worker")], cwd=REPO, capture_output=True,
                          text=True, check=True, timeout=120).stdout.split()
    assert rank == []
    driver = subprocess.run([sys.executable, "-c", probe.format("trainer.__main__")], cwd=REPO, capture_output=True,
                            text=True, check=True, timeout=120).stdout.split()
    assert "launchers.options" in driver  # the launchers' schemas, read to compose the config
    assert not [m for m in driver if m.endswith((".backend", ".manifests"))], driver


# The runtimes' node agents that import torch: run as `python -m` on the nodes, imported by nothing.
RUNTIME_AGENTS = {"trainjob.runtimes.torch_distributed.torchrun", "trainjob.runtimes.torch_distributed.rendezvous"}


def _imports(module: str) -> set[str]:
    path = _modules()[module]
    return _imported(ast.parse(path.read_text()), module, path.name == "__init__.py")


def test_trainjob_imports_no_torch_but_in_its_runtimes_node_agents_which_nothing_imports():
    """The bottom layer loads no GPU stack: its one torch importers are the agents a runtime starts on its
    nodes (`python -m trainjob.runtimes.torch_distributed.torchrun`, the rendezvous store), and no module imports
    them."""
    torch_users = {m for m in _modules() if m.split(".")[0] == "trainjob"
                   and any(n == "torch" or n.startswith("torch.") for n in _imports(m))}
    assert torch_users == RUNTIME_AGENTS
    assert [m for m, edges in _graph().items() if edges & RUNTIME_AGENTS] == []


def test_no_launcher_nor_the_trainer_imports_a_particular_runtimes_module():
    """A runtime is reached through the runtimes' face (`trainjob.runtimes.get(name)`, the `Runtime` type), so that
    everything of one runtime stays in its folder."""
    named = sorted(f"{m} -> {t}" for m, edges in _graph().items() if m.split(".")[0] in ("launchers", "trainer")
                   for t in edges if t.startswith("trainjob.runtimes."))
    assert named == []


def test_the_bottom_layer_names_no_module_above_it_not_even_in_a_string():
    """trainjob/ names no module of trainer/, launchers/, datacache/ or ops/ in its strings (a command line such
    as `-m trainer.worker` is its caller's to hand it: `LaunchSpec.worker`)."""
    import re

    above = {m for m in _modules() if m.split(".")[0] in ("trainer", "launchers", "datacache", "ops")}
    named = []
    for module, path in _modules().items():
        if module.split(".")[0] != "trainjob":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                named += [f"{module}: {n}" for n in re.findall(r"[a-z_]+(?:\.[a-z_]+)+", node.value) if n in above]
    assert named == []
