"""The package's layers: a module imports only modules of its own layer or of the layers below it,
and no modules import each other in a circle.

The layers, bottom to top:

  base        trainers (the package), trainers.errors (exit statuses and the errors that choose
              them), trainers.files (generic file helpers: fsync of a directory, atomic text
              writes, file identity and sha256, the OSError in an exception chain),
              trainers.torch_files (a durable torch.save, a safe torch.load), trainers.stop_signals
              (stop signals; no torch), trainers.faults (fault injection for the tests),
              trainers.console_streams (stdout/stderr whose reader may leave: `| head`)
  config      trainers.config: flags, settings and their bounds, the config.yaml keys inference reads
  model       trainers.model: the GPT, its weights, vocabulary and the demo base
  data        trainers.data: manifests, the sample table, features, the step order, loaders
  hardware    trainers.hardware: devices, precision, the micro-batch probe, memory, determinism
  checkpoint  trainers.checkpoint: schema, snapshot, background writer, step files, recovery
  families    trainers.families: the model families (each a config, model, data and state-dict layout
              from the layers below) and their registry
  training    trainers.training: optimizer, schedule, log, evaluation, torchrun agreements
  run         trainers.run: a run's directory, inputs, resume and set-up
  app         trainers.main (main()), trainers.loop (the training loop), trainers.cli (the command: flags
              before torch), trainers.experiment (the Python API)
  tools       trainers.tools: the tools' code (export, inspect, plots, pack, tokenizer)
  scripts     trainers/train_gpt_v2.py and tools/**/*.py: scripts that call a main()

Every import counts: at module level, inside functions, and under `if TYPE_CHECKING:` (a type-only
import ties two modules together for a reader and for a change as much as any other). A new
module or package gets its place in LAYERS below (and in docs/architecture.md).
"""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SOURCES = ("trainers", "tools")  # the folders whose modules are checked, relative to the root

# Bottom to top. An entry names a module, or a package and everything in it; "trainers" is the
# package's own __init__ only.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("base", ("trainers", "trainers.errors", "trainers.files", "trainers.torch_files", "trainers.stop_signals",
              "trainers.faults", "trainers.console_streams", "trainers.log_lines")),
    ("config", ("trainers.config",)),
    ("model", ("trainers.model",)),
    ("data", ("trainers.data",)),
    ("hardware", ("trainers.hardware",)),
    ("checkpoint", ("trainers.checkpoint",)),
    ("families", ("trainers.families",)),
    ("training", ("trainers.training",)),
    ("run", ("trainers.run",)),
    ("app", ("trainers.main", "trainers.loop", "trainers.cli", "trainers.experiment")),
    ("tools", ("trainers.tools",)),
    ("scripts", ("trainers.train_gpt_v2", "tools")),
)
ORDER = " < ".join(name for name, _ in LAYERS)


def module_files(root: Path, sources: tuple[str, ...] = SOURCES) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file under `sources` (a package is its __init__.py)."""
    found = {}
    for source in sources:
        for path in sorted((root / source).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports_of(name: str, path: Path, known: set[str]) -> list[tuple[str, int]]:
    """(imported project module, line) for every import statement in the file, wherever it stands."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: `from . import x`, `from ..y import z`
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([node.module] if node.module else []))
            # `from package import module` imports that module; `from module import name`, the module
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:  # `import trainers.x.y` also runs trainers.x: count the deepest
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add((target, node.lineno))
    return sorted(found, key=lambda t: (t[1], t[0]))


def layer_of(module: str) -> int | None:
    for rank, (_, entries) in enumerate(LAYERS):
        if any(module == e or (e != "trainers" and module.startswith(e + ".")) for e in entries):
            return rank
    return None


def import_graph(root: Path) -> tuple[dict[str, Path], dict[str, list[tuple[str, int]]]]:
    files = module_files(root)
    known = set(files)
    return files, {name: imports_of(name, path, known) for name, path in files.items()}


def upward_imports(root: Path) -> list[str]:
    files, graph = import_graph(root)
    problems = []
    for name, targets in graph.items():
        for target, line in targets:
            low, high = layer_of(name), layer_of(target)
            if low is not None and high is not None and high > low:
                problems.append(f"{files[name].relative_to(root)}:{line}: {name} (layer {LAYERS[low][0]}) imports "
                                f"{target} (layer {LAYERS[high][0]}), a higher layer; the order, bottom to top: "
                                f"{ORDER} (tests/test_layers.py)")
    return problems


def import_circles(root: Path) -> list[list[str]]:
    """Every set of modules that import each other in a circle (a strongly connected component), as one
    circle through it: [a, b, ..., a]."""
    _, graph = import_graph(root)
    edges = {name: sorted({t for t, _ in targets}) for name, targets in graph.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    components: list[list[str]] = []

    def visit(node: str) -> None:  # Tarjan's algorithm; the graph is small, recursion is fine
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in edges[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            members = []
            while True:
                members.append(stack.pop())
                if members[-1] == node:
                    break
            if len(members) > 1:
                components.append(members)

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return [_circle_through(sorted(members), edges) for members in components]


def _circle_through(members: list[str], edges: dict[str, list[str]]) -> list[str]:
    """A shortest path from the first member back to itself, inside the component."""
    start, inside = members[0], set(members)
    paths = {start: [start]}
    queue = [start]
    while queue:
        node = queue.pop(0)
        for nxt in edges[node]:
            if nxt == start:
                return paths[node] + [start]
            if nxt in inside and nxt not in paths:
                paths[nxt] = paths[node] + [nxt]
                queue.append(nxt)
    raise AssertionError(f"no circle through {members}")


def test_every_module_has_a_layer():
    files = module_files(REPO)
    missing = sorted(name for name in files if layer_of(name) is None)
    assert not missing, f"modules in no layer: {missing}; add each to LAYERS in tests/test_layers.py (order: {ORDER})"


def test_no_module_imports_a_higher_layer():
    problems = upward_imports(REPO)
    assert not problems, "\n".join(problems)


def test_no_modules_import_each_other_in_a_circle():
    circles = import_circles(REPO)
    assert not circles, "\n".join("import circle: " + " -> ".join(c) for c in circles)


def test_no_sys_path_edits():
    """The package is installed (pip install -e .), so no script or module adds folders to sys.path."""
    edits = [f"{path.relative_to(REPO)}:{n}: {line.strip()}" for path in module_files(REPO).values()
             for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1) if "sys.path" in line]
    assert not edits, "\n".join(edits)


def test_the_checks_find_an_upward_import_and_a_type_only_circle(tmp_path):
    """The checks themselves, on a made-up tree: an upward import inside a function, and a circle whose
    one side is a TYPE_CHECKING import, are both reported with the modules they concern."""
    pkg = tmp_path / "trainers"
    for folder in (pkg, pkg / "config", pkg / "run", pkg / "data"):
        folder.mkdir()
        (folder / "__init__.py").write_text("")
    (pkg / "config" / "flags.py").write_text("def f():\n    from trainers.run.portable import g\n")
    (pkg / "run" / "portable.py").write_text("def g():\n    pass\n")
    (pkg / "data" / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                       "    from trainers.data.b import B\n")
    (pkg / "data" / "b.py").write_text("from . import a\nclass B:\n    pass\n")
    (tmp_path / "tools").mkdir()
    problems = upward_imports(tmp_path)
    assert len(problems) == 1 and problems[0].startswith(
        "trainers/config/flags.py:2: trainers.config.flags (layer config) imports trainers.run.portable (layer run)")
    assert ORDER in problems[0]
    assert import_circles(tmp_path) == [["trainers.data.a", "trainers.data.b", "trainers.data.a"]]
