"""The import rules of ARCHITECTURE.md, checked on the source (every import statement, including
those inside functions) and, for the torch-free modules, by importing them in a fresh process."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "tetrad"

# Modules that run without torch: the planner answers on a laptop in milliseconds.
TORCH_FREE = ["config", "errors", "hardware", "presets", "hf_config", "tokenizer", "text_sources",
              "planner", "schedules"]

# Where a module lives -> module prefixes it must never import.
FORBIDDEN = {
    "models": ["torch.distributed", "tetrad.parallel", "tetrad.train", "tetrad.inference",
               "tetrad.cli", "tetrad.planner"],
    "parallel": ["tetrad.train", "tetrad.inference", "tetrad.cli"],
    "train": ["tetrad.inference", "tetrad.cli"],
    "inference": ["tetrad.train", "tetrad.cli"],
    "schedules": ["tetrad.models", "tetrad.parallel", "tetrad.train", "tetrad.inference",
                  "tetrad.cli", "tetrad.planner"],
    "planner": ["tetrad.models", "tetrad.parallel", "tetrad.train", "tetrad.inference",
                "tetrad.cli"],
}


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


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_layers_import_in_one_direction(layer):
    assert violations(python_files(layer), FORBIDDEN[layer]) == []


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
