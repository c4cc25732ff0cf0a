"""tetrad as a package: the base install (no third-party package at all) plans, simulates
schedules and manages the model store; a command whose extra is missing says which to install;
the top-level names resolve lazily."""

import os
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

import tetrad
from tetrad.cli.main import EXTRA_MODULES, missing_extra
from tetrad.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def distribution(requirement: str) -> str:
    return requirement.split("~=")[0].split(">=")[0].split("==")[0].strip().lower()


def test_the_base_install_has_no_dependencies_and_the_extras_bring_the_cli_modules():
    extras = PYPROJECT["optional-dependencies"]
    assert PYPROJECT["dependencies"] == []
    for extra, modules in EXTRA_MODULES.items():
        assert sorted(modules) == sorted(distribution(r) for r in extras[extra]), extra
    assert extras["all"] == ["tetrad[train,serve,plot]"]
    assert "tetrad[all]" in extras["dev"]


def test_every_extra_range_admits_the_pinned_lock():
    pins = dict(line.lower().split("==") for line in (ROOT / "requirements.txt").read_text()
                .splitlines() if "==" in line and not line.startswith("#"))
    for requirements in PYPROJECT["optional-dependencies"].values():
        for requirement in requirements:
            if requirement.startswith("tetrad["):
                continue
            name, compatible = requirement.lower().split("~=")
            pinned = pins[name].split("+")[0].split(".")
            wanted = compatible.split(".")
            # ~=X.Y admits X.Y.* and later X.*: the same major, a minor at least Y.
            assert pinned[0] == wanted[0] and int(pinned[1]) >= int(wanted[1]), requirement


def bare_python(tmp_path) -> str:
    """A virtual environment with nothing installed: the base install's interpreter."""
    venv = tmp_path / "bare"
    subprocess.run([sys._base_executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    return str(venv / "bin" / "python")


def test_plan_schedule_and_the_model_store_run_without_any_dependency(tmp_path):
    python = bare_python(tmp_path)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TETRAD_HOME": str(tmp_path / "home")}
    check = subprocess.run([python, "-c", "import torch"], env=env, capture_output=True)
    assert check.returncode != 0  # really bare
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(
        '{"model_type": "llama", "vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 2, '
        '"num_attention_heads": 4, "intermediate_size": 128, "max_position_embeddings": 128}')
    (tmp_path / "Modelfile").write_text("FROM ./hf\nSYSTEM Arr.\nPARAMETER temperature 0.5\n")
    commands = [["plan", "train", "--model", "llama3-8b", "--gpu", "h100", "--num-gpus", "8"],
                ["plan", "serve", "--model", "llama3-8b", "--gpu", "h100", "--num-gpus", "1"],
                ["schedule", "--pp", "4", "--microbatches", "8"],
                ["create", "pirate", "-f", str(tmp_path / "Modelfile")],
                ["list"], ["show", "pirate"], ["rm", "pirate"]]
    for command in commands:
        result = subprocess.run([python, "-m", "tetrad", *command], env=env,
                                capture_output=True, text=True)
        assert result.returncode in (0, 1), (command, result.stderr)  # 1: no layout fits
        assert result.stdout and "Traceback" not in result.stderr, (command, result.stderr)


BLOCK = textwrap.dedent("""
    import sys

    class Missing:
        def find_spec(self, name, path=None, target=None):
            if name.partition(".")[0] == {module!r}:
                raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)

    sys.meta_path.insert(0, Missing())
    from tetrad.cli.main import main
    sys.exit(main({argv!r}))
""")


@pytest.mark.parametrize("module, argv, extra", [
    ("torch", ["train", "--model", "tiny", "--steps", "1"], "train"),
    ("torch", ["generate", "some-model", "--prompt", "x"], "serve"),
    ("uvicorn", ["serve", "some-model"], "serve"),
    ("matplotlib", ["schedule", "--pp", "2", "--microbatches", "2", "--png", "x.png"], "plot"),
])
def test_a_missing_extra_is_named_in_one_line(tmp_path, module, argv, extra):
    code = BLOCK.format(module=module, argv=argv)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT),
                                               "TETRAD_HOME": str(tmp_path / "home")})
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip() == (f"tetrad {argv[0]}: error: {module} is not installed: "
                                     f"pip install 'tetrad[{extra}]'")


def test_a_missing_module_no_extra_brings_is_a_bug_not_an_install_choice():
    assert missing_extra("tetrad.nope", "train") is None
    assert missing_extra("safetensors.torch", "run") == "serve"
    assert missing_extra("safetensors.torch", "export") == "train"


def test_the_top_level_names_are_the_engine_the_trainer_and_the_loaders():
    from tetrad.spec.model import ModelConfig, ParallelConfig, TrainConfig
    from tetrad.inference.engine import LLM
    from tetrad.inference.core.params import SamplingParams
    from tetrad.models.hf import load_pretrained
    from tetrad.train.launch import train_model

    assert (tetrad.LLM, tetrad.SamplingParams, tetrad.load_pretrained, tetrad.train_model) == (
        LLM, SamplingParams, load_pretrained, train_model)
    assert (tetrad.TrainConfig, tetrad.ParallelConfig, tetrad.ModelConfig) == (
        TrainConfig, ParallelConfig, ModelConfig)
    assert {"LLM", "SamplingParams", "train_model"} <= set(dir(tetrad))
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        tetrad.nope  # noqa: B018


def test_train_model_runs_like_tetrad_train(corpus_file):
    settings = dict(model="tiny", data=corpus_file, steps=3, batch_size=4, seq_len=32,
                    sample_tokens=0)
    result = tetrad.train_model(**settings)
    again = tetrad.train_model(tetrad.TrainConfig(**settings))
    assert [s["loss"] for s in result.report["steps"]] == [s["loss"] for s in
                                                            again.report["steps"]]
    assert len(result.report["steps"]) == 3
    with pytest.raises(ConfigError, match="not both"):
        tetrad.train_model(tetrad.TrainConfig(**settings), steps=4)
