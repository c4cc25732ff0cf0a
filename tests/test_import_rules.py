"""The import rules of ARCHITECTURE.md, checked on the source (every import statement, including
those inside functions) and, for the torch-free modules, by importing them in a fresh process."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "tetrad"

# Modules that run without torch: the planner answers on a laptop in milliseconds.
TORCH_FREE = ["spec", "errors", "hardware", "tokenizer", "text_sources", "planner", "schedules",
              "store", "planner_web"]

# ARCHITECTURE.md's table: where a module lives -> the tetrad modules it may import. Every edge
# the code has is here (imports inside functions included); an edge missing from the table fails
# the test, and the table itself has no circle (test_the_table_has_no_circle).
BASE = ["errors", "hardware", "schedules", "sharded_tensors", "text_sources", "tokenizer"]
ALLOWED = {
    "errors": [], "memory": [], "schedules": ["errors"], "hardware": ["errors"],
    "text_sources": ["errors"], "sharded_tensors": ["errors"],
    "spec": ["errors", "schedules"],  # the shared description of model and layout
    "tokenizer": ["errors", "spec"],
    "store": ["errors", "inference", "spec"],  # inference.core.params (torch-free), in a function
    "planner": ["errors", "hardware", "schedules", "spec"],
    "models": ["errors", "sharded_tensors", "spec"],
    "parallel": ["errors", "memory", "models", "planner", "schedules", "sharded_tensors", "spec"],
    "train": [*BASE, "memory", "models", "parallel", "planner", "spec"],
    "inference": ["errors", "models", "parallel", "planner", "spec", ""],  # "": lazy `import tetrad`
    "viz": ["errors", "hardware", "schedules"],
    "planner_web": ["errors", "hardware", "planner", "schedules", "spec"],  # tetrad plan --web
    # Microbenchmarks: the activation meter every strategy runs, train.launch's spawned ranks,
    # and a calibration model's training step set against the planner's time model.
    "calibrate": ["errors", "hardware", "memory", "parallel", "planner", "spec", "train"],
    "cli": [*BASE, "calibrate", "inference", "models", "planner", "planner_web", "spec", "store",
            "train", "viz"],
}
# The serving engine's rooms (tetrad/inference/), one way down: the entry points drive the engine
# (engine.py), which puts together the multi-rank drivers, one rank's worker and the core
# (requests, scheduling, outputs), which imports no other room.
INFERENCE_ROOMS = {
    "core": [], "worker": ["core"], "ranks": ["core", "worker"],
    "engine": ["core", "ranks", "worker"], "entrypoints": ["core", "engine"],
}
# Beyond tetrad: model code runs on one device.
FORBIDDEN_EXTERNAL = {"models": ["torch.distributed"]}


def imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def python_files(relative: str) -> list[Path]:
    target = PACKAGE / relative
    if target.with_suffix(".py").is_file():
        return [target.with_suffix(".py")]
    return sorted(target.rglob("*.py")) if target.is_dir() else []


def violations(files: list[Path], forbidden: list[str]) -> list[str]:
    return [f"{path.relative_to(PACKAGE.parent)} imports {name}"
            for path in files for name in imported_modules(path)
            if any(name == prefix or name.startswith(prefix + ".") for prefix in forbidden)]


def tetrad_edges(files: list[Path]) -> set[str]:
    """The tetrad modules `files` import, by their top-level name ("" for `import tetrad`)."""
    return {name.split(".")[1] if "." in name else "" for path in files
            for name in imported_modules(path) if name == "tetrad" or name.startswith("tetrad.")}


@pytest.mark.parametrize("layer", sorted(ALLOWED))
def test_layers_import_only_what_the_table_allows(layer):
    files = python_files(layer)
    assert files, f"{layer} is in the table but not in the package"
    assert tetrad_edges(files) - {layer} <= set(ALLOWED[layer])
    assert violations(files, FORBIDDEN_EXTERNAL.get(layer, [])) == []


def circles(table: dict[str, list[str]]) -> list[list[str]]:
    return import_cycles({name: set(targets) - {""} for name, targets in table.items()})


def test_the_table_has_no_circle():
    assert circles(ALLOWED) == [] and circles(INFERENCE_ROOMS) == []
    assert circles({"hardware": ["catalog"], "catalog": ["hardware"]}) == [["catalog", "hardware"]]


@pytest.mark.parametrize("room", sorted(INFERENCE_ROOMS))
def test_inference_rooms_import_only_downwards(room):
    files = python_files(f"inference/{room}")
    assert files, f"inference/{room} is in the table but not in the package"
    rooms = {name.split(".")[2] for path in files for name in imported_modules(path)
             if name.startswith("tetrad.inference.")}
    assert rooms - {room} <= set(INFERENCE_ROOMS[room])


def test_every_inference_room_is_in_the_table():
    rooms = {path.stem for path in (PACKAGE / "inference").iterdir()
             if (path.suffix == ".py" or (path / "__init__.py").is_file())
             and path.name != "__init__.py"}
    assert rooms == set(INFERENCE_ROOMS)


def test_every_module_is_in_the_table():
    modules = {path.stem if path.suffix else path.name for path in PACKAGE.iterdir()
               if (path.suffix == ".py" or (path / "__init__.py").is_file())
               and path.name not in ("__init__.py", "__main__.py")}
    assert modules == set(ALLOWED)


def test_nothing_outside_the_cli_imports_the_cli():
    files = [p for p in PACKAGE.rglob("*.py")
             if "cli" not in p.relative_to(PACKAGE).parts and p.name != "__main__.py"]
    assert violations(files, ["tetrad.cli"]) == []


def test_torch_free_modules_never_import_torch():
    files = [path for module in TORCH_FREE for path in python_files(module)]
    assert files, "no torch-free modules found"
    assert violations(files, ["torch"]) == []
    existing = [module for module in TORCH_FREE if python_files(module)]
    code = (f"import sys, importlib\n"
            f"for m in {existing!r}: importlib.import_module('tetrad.' + m)\n"
            "import tetrad\ntetrad.TrainConfig, tetrad.ModelConfig, dir(tetrad)\n"
            "assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def module_level_imports(path: Path, modules: set[str]) -> set[str]:
    """The tetrad modules a module imports while it is being imported: its import statements
    outside functions and classes, `if TYPE_CHECKING:` blocks included (a type checker follows
    them, and they are how a circle hides). `from a import b` names module a.b when there is one."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()

    def visit(nodes) -> None:
        for node in nodes:
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                found.update(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules
                             else base for alias in node.names)
            elif not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                visit(ast.iter_child_nodes(node))

    visit(ast.parse(path.read_text()).body)
    return found & modules


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module, or a module importing itself
    (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def connect(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for target in sorted(graph[module]):
            if target not in index:
                connect(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = []
            while not component or component[-1] != module:
                component.append(stack.pop())
            if len(component) > 1 or module in graph[module]:
                cycles.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            connect(module)
    return cycles


def test_no_import_cycles_inside_tetrad():
    files = {module_name(path): path for path in PACKAGE.rglob("*.py")}
    graph = {name: module_level_imports(path, set(files)) for name, path in files.items()}
    assert graph["tetrad.inference.engine"] >= {"tetrad.inference.worker.runner", "tetrad.inference.ranks.driver"}
    assert import_cycles(graph) == []


def test_the_cycle_finder_finds_a_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}}
    assert import_cycles(graph) == [["a", "b", "c"], ["e"]]
