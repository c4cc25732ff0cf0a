"""The serving engine refuses, in one line, a model whose config asks for a block shape its layers
do not build (parallel attention+MLP, partial rotary, QK-norm: the planner's fields,
tetrad.planner.rules.check_runtime_model) instead of serving it with the wrong numerics; the
refusal comes before any weight is read (these folders hold none)."""

from __future__ import annotations

import json

import pytest

from tetrad.cli.main import main
from tetrad.errors import ConfigError
from tetrad.spec.model import ModelConfig

TINY = ModelConfig(name="tiny-unbuilt", vocab_size=256, hidden_size=64, num_layers=2,
                   num_heads=4, num_kv_heads=4, ffn_hidden_size=128, max_seq_len=64)
# A llama config.json the engine loads, but with half of each head rotated (Phi-style).
PARTIAL_ROTARY_LLAMA = dict(model_type="llama", vocab_size=256, hidden_size=64,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                            intermediate_size=128, max_position_embeddings=64,
                            rms_norm_eps=1e-5, rope_theta=10000.0, partial_rotary_factor=0.5,
                            tie_word_embeddings=False)


def _checkpoint(tmp_path, **fields):
    folder = tmp_path / "checkpoint"
    folder.mkdir()
    (folder / "model.json").write_text(json.dumps(TINY.replace(**fields).to_dict()))
    return folder


@pytest.mark.parametrize("fields, named", [
    ({"parallel_block": True}, "parallel_block"),
    ({"qk_norm": True}, "qk_norm"),
    ({"rotary_fraction": 0.5}, "rotary_fraction"),
    ({"parallel_block": True, "qk_norm": True}, "parallel_block, qk_norm"),
])
def test_the_engine_refuses_a_checkpoint_with_an_unbuilt_field(tmp_path, fields, named):
    from tetrad.inference.engine import LLM

    with pytest.raises(ConfigError, match=f"does not build {named} "):
        LLM(str(_checkpoint(tmp_path, **fields)), device="cpu")


def test_tetrad_run_refuses_an_hf_model_with_partial_rotary_in_one_line(tmp_path, capsys):
    folder = tmp_path / "partial"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(PARTIAL_ROTARY_LLAMA))
    assert main(["run", str(folder), "--device", "cpu"]) == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and "does not build rotary_fraction" in error


def test_tetrad_serve_refuses_before_listening(tmp_path, capsys):
    assert main(["serve", str(_checkpoint(tmp_path, qk_norm=True)), "--device", "cpu",
                 "--port", "0"]) == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and "does not build qk_norm" in error


def test_a_model_without_them_passes_the_same_check(tmp_path):
    from tetrad.inference.ranks.layout import check_servable
    from tetrad.models.hf import pretrained_config
    from tetrad.spec.serving import ServeLayout

    check_servable(ServeLayout(), pretrained_config(_checkpoint(tmp_path)))
