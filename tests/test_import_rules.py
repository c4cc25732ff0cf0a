"""The import rules of ARCHITECTURE.md, checked on the source (every import statement, including
those inside functions) and, for the torch-free modules, by importing them in a fresh process."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "tetrad"

# Modules that run without torch: the planner answers on a laptop in milliseconds.
TORCH_FREE = ["config", "parallel_config", "errors", "hardware", "presets", "hf_config",
              "tokenizer", "text_sources", "planner", "schedules"]

# ARCHITECTURE.md's table: where a module lives -> the tetrad modules it may import. Every edge
# the code has is here; an edge missing from the table fails the test.
SHARED = ["config", "parallel_config", "errors", "presets", "hf_config"]
BASE = ["errors", "hardware", "schedules", "sharded_tensors", "text_sources", "tokenizer"]
ALLOWED = {
    "errors": [], "hardware": ["errors"], "schedules": ["errors"], "text_sources": ["errors"],
    "sharded_tensors": ["errors"], "tokenizer": ["errors", "hf_config"],
    "parallel_config": ["errors", "schedules"], "config": ["errors", "parallel_config"],
    "hf_config": ["config", "errors"], "presets": ["config", "errors", "hf_config"],
    "memory": [],
    "planner": [*SHARED, "hardware", "schedules"],
    "models": [*SHARED, "sharded_tensors"],
    "parallel": [*SHARED, "memory", "models", "planner", "schedules", "sharded_tensors"],
    "train": [*SHARED, *BASE, "memory", "models", "parallel", "planner"],
    "inference": [*SHARED, "models", "parallel", "planner", ""],  # "": lazy `import tetrad`
    "viz": ["errors", "hardware", "schedules"],
    "cli": [*SHARED, *BASE, "inference", "models", "planner", "train", "viz"],
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
    code = (f"import sys, importlib\nfor m in {existing!r}: importlib.import_module('tetrad.' + m)\n"
            "import tetrad\nassert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
