"""DeepSeek-V3's FP8 checkpoint layout (tetrad.models.hf_fp8): `tetrad export --dtype fp8` writes
E4M3 projections with a weight_scale_inv per 128x128 block and the rest in bf16, and loading
dequantises them back; a tiny DeepSeek-V3 model's logits stay within the measured bound of the
fp32 model's (docs/deepseek.md states the numbers). Served (`keep_fp8`, the one-rank engine), the
projections stay E4M3 and dequantise on the fly: the same logits, bit for bit, at 1 byte per
weight plus scales."""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
from deepseek_models import VOCAB, hf_model  # noqa: E402
from safetensors import safe_open  # noqa: E402

from test_engine import GREEDY, PROMPTS  # noqa: E402

from tetrad import load_pretrained  # noqa: E402
from tetrad.cli.main import main  # noqa: E402
from tetrad.inference.engine import LLM  # noqa: E402
from tetrad.inference.ranks.rank_share import held_bytes  # noqa: E402
from tetrad.models.fp8 import E4M3, E4M3_MAX, dequantize_blocks, quantize_blocks  # noqa: E402
from tetrad.models.fp8_layers import is_quantized_linear  # noqa: E402
from tetrad.models.fp8_weights import FP8WeightLinear, weight_bytes  # noqa: E402
from tetrad.models.hf_fp8 import (QUANTIZATION_CONFIG, FP8Weight, is_quantized,  # noqa: E402
                                  read_weight)

# E4M3 rounding: half an ulp of 3 mantissa bits, or half the subnormal spacing of the block.
U, SUB = 2.0 ** -4, 2.0 ** -10


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8")
    hf_model("v3").save_pretrained(root / "original")
    for dtype, name in (("fp8", "fp8"), ("bf16", "bf16"), ("fp32", "exported")):
        assert main(["export", str(root / "original"), "--out", str(root / name),
                     "--dtype", dtype]) == 0
    return root


def tensors(folder):
    with safe_open(str(folder / "model.safetensors"), framework="pt") as handle:
        return {name: handle.get_tensor(name) for name in handle.keys()}


def test_the_fp8_file_has_deepseeks_layout(folders):
    original, written = tensors(folders / "exported"), tensors(folders / "fp8")
    config = json.loads((folders / "fp8" / "config.json").read_text())
    assert config["quantization_config"] == QUANTIZATION_CONFIG
    quantized = {name for name in original if is_quantized(name)}
    # Every projection DeepSeek quantizes, nothing it keeps in 16 bits.
    for part in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj",
                 "experts.7.down_proj", "shared_experts.up_proj", "layers.0.mlp.gate_proj"):
        assert any(part in name for name in quantized), part
    assert not {name for name in quantized
                if "norm" in name or "embed" in name or "lm_head" in name
                or name.endswith("mlp.gate.weight")}
    assert set(written) == set(original) | {name + "_scale_inv" for name in quantized}
    for name, tensor in original.items():
        if name not in quantized:
            assert written[name].dtype == torch.bfloat16
            assert torch.equal(written[name], tensor.to(torch.bfloat16))
            continue
        q, scale_inv = written[name], written[name + "_scale_inv"]
        assert q.dtype == E4M3 and q.shape == tensor.shape
        assert scale_inv.dtype == torch.float32
        assert scale_inv.shape == tuple(-(-size // 128) for size in tensor.shape)
        # All these weights fit one block: scale = amax / 448, error within E4M3's rounding.
        assert scale_inv.item() == tensor.abs().max() / E4M3_MAX
        error = (q.float() * scale_inv - tensor).abs()
        assert (error <= (U * tensor.abs() + SUB * scale_inv) * (1 + 1e-6)).all()


def logits(folder, ids):
    with torch.no_grad():
        return load_pretrained(folder, dtype=torch.float32)(ids)


def test_a_deepseek_export_is_the_model_transformers_loads(folders):
    ids = torch.randint(0, VOCAB, (2, 48), generator=torch.Generator().manual_seed(1))
    exported = transformers.DeepseekV3ForCausalLM.from_pretrained(folders / "exported")
    with torch.no_grad():
        torch.testing.assert_close(exported(ids).logits, hf_model("v3")(ids).logits,
                                   atol=1e-5, rtol=0)


def test_fp8_weights_load_back_within_the_measured_logit_error(folders):
    ids = torch.randint(0, VOCAB, (2, 48), generator=torch.Generator().manual_seed(1))
    reference = logits(folders / "original", ids)
    fp8_error = (logits(folders / "fp8", ids) - reference).abs()
    bf16_error = (logits(folders / "bf16", ids) - reference).abs()
    # Measured on this model (docs/deepseek.md): mean |logit| 1.37; mean error fp8 0.31, bf16
    # 0.071 (max errors are routing flips, a few per batch, in both). E4M3 keeps 3 mantissa
    # bits to bf16's 7: the error is several times bf16's, and within ~1.3x of its measure.
    assert fp8_error.mean() < 0.3 * reference.abs().mean()
    assert fp8_error.mean() > 2 * bf16_error.mean()
    # Without a dtype the model loads in the checkpoint's declared dtype (bf16), not mixed.
    model = load_pretrained(folders / "fp8")
    assert {param.dtype for param in model.parameters()} == {torch.bfloat16}


def test_fused_and_permuted_fp8_weights_keep_each_rows_block_scale():
    # Several 128x128 blocks per piece, pieces of unequal scale, rows permuted across blocks.
    generator = torch.Generator().manual_seed(0)
    pieces = [torch.randn(200, 300, generator=generator) * scale for scale in (1.0, 50.0)]
    stored = {}
    for index, piece in enumerate(pieces):
        stored[f"w{index}"], stored[f"w{index}_scale_inv"] = quantize_blocks(piece)
    rows = tuple(torch.randperm(400, generator=generator).tolist())
    kept = FP8Weight.concatenated(
        [read_weight(stored.__getitem__, f"w{i}", set(stored), 128, keep_fp8=True)
         for i in range(2)], rows)
    at_load = torch.cat([dequantize_blocks(stored[f"w{i}"], stored[f"w{i}_scale_inv"])
                         for i in range(2)])[list(rows)]
    assert kept.values.dtype == E4M3 and kept.scales.shape == (400, 3)
    assert torch.equal(kept.dequantized(), at_load)


def test_served_fp8_weights_stay_fp8_and_give_the_dequantised_models_logits(folders):
    ids = torch.randint(0, VOCAB, (2, 48), generator=torch.Generator().manual_seed(1))
    for dtype in (torch.float32, torch.bfloat16):
        kept = load_pretrained(folders / "fp8", dtype=dtype, keep_fp8=True)
        at_load = load_pretrained(folders / "fp8", dtype=dtype)
        quantized = {name: module for name, module in at_load.named_modules()
                     if is_quantized_linear(name, module)}
        fp8 = {name: module for name, module in kept.named_modules()
               if isinstance(module, FP8WeightLinear)}
        assert quantized and set(fp8) == set(quantized)
        assert {module.weight_fp8.dtype for module in fp8.values()} == {E4M3}
        # Counted: each FP8 weight 1 byte per element and 4 per row and 128 columns, in place
        # of the dequantised weight's element size.
        saved = sum(linear.weight.numel() * (linear.weight.element_size() - 1)
                    - 4 * linear.out_features * -(-linear.in_features // 128)
                    for linear in quantized.values())
        assert weight_bytes(kept) == weight_bytes(at_load) - saved
        assert weight_bytes(kept) < weight_bytes(at_load)
        # The same fp32 products q * scale, cast the same way: exactly the same logits.
        with torch.no_grad():
            assert torch.equal(kept(ids), at_load(ids)), dtype


def test_the_engine_serves_an_fp8_folder_with_fp8_weights(folders):
    llm = LLM(folders / "fp8", log=None, block_size=4, dtype="fp32")
    fp8 = [m for m in llm.model.modules() if isinstance(m, FP8WeightLinear)]
    assert fp8 and all(m.weight_fp8.dtype == E4M3 for m in fp8)
    assert held_bytes(llm.runner)["weights"] == weight_bytes(llm.model)
    reference = LLM(load_pretrained(folders / "fp8", dtype=torch.float32),
                    tokenizer=llm.tokenizer, log=None, block_size=4, dtype="fp32")
    assert weight_bytes(llm.model) < weight_bytes(reference.model)
    assert ([o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
            == [o.token_ids for o in reference.generate(PROMPTS, GREEDY)])
