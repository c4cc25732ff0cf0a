"""The fused CPU decode step on `--quantization int8|int4` models (quant_rows.cpp): greedy tokens
equal the eager quantized forward's, every decode step runs fused, and linear_rows on a
quantized layer's own tensors equals both the dequantized weight's product and the layer's
forward (torch's packed kernels), across torch's int4 block shapes and group sizes."""

import pytest
import torch
import torch.nn.functional as F
from test_cpu_decode import counted_engine

from tetrad.inference.core.params import SamplingParams
from tetrad.inference.engine import LLM
from tetrad.inference.worker.cpu_decode import fused_decode_refusal
from tetrad.inference.worker.cpu_kernels import cpu_kernels_available
from tetrad.models.quant import INT4_MIDPOINT, Int4Linear, Int8Linear
from tetrad.models.transformer import Transformer
from tetrad.spec.model import ModelConfig
from tetrad.tokenizer import ByteTokenizer

pytestmark = pytest.mark.skipif(not cpu_kernels_available(), reason="no C++ compiler")

# Every projection's input width a multiple of int4's group of 128; qkv 256 rows, up 512.
CONFIG = ModelConfig(name="llama", vocab_size=256, hidden_size=128, num_layers=2, num_heads=4,
                     num_kv_heads=2, head_dim=32, ffn_hidden_size=256, max_seq_len=128)
PROMPTS = [[5, 17, 99, 3, 42, 7, 8, 250, 11], [200], list(range(30, 60))]
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def random_model():
    torch.manual_seed(0)
    model = Transformer(CONFIG)
    with torch.no_grad():  # logits far apart: few argmax near-ties under bf16 rounding
        for name, param in model.named_parameters():
            param.copy_(torch.randn(param.shape) * (0.3 if param.dim() == 1 else 0.15)
                        + (1.0 if "norm" in name else 0.0))
    return model.eval()


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_fused_quantized_decode_gives_the_eager_forwards_greedy_tokens(method, monkeypatch):
    eager = LLM(random_model(), ByteTokenizer(), log=None, block_size=4, quantization=method,
                enforce_eager=True)
    assert eager.runner.fused is None
    expected = [out.token_ids for out in eager.generate(PROMPTS, GREEDY)]
    fused, calls = counted_engine(random_model(), monkeypatch, quantization=method)
    layer_type = Int8Linear if method == "int8" else Int4Linear
    assert type(fused.model.layers[0].mlp.down) is layer_type
    assert [out.token_ids for out in fused.generate(PROMPTS, GREEDY)] == expected
    assert len(calls) >= GREEDY.max_tokens - 1 and max(calls) == len(PROMPTS)


def test_quantized_layers_off_torchs_packed_cpu_path_are_refused():
    model = random_model().to(torch.bfloat16)
    assert fused_decode_refusal(model, torch.bfloat16) is None
    block = model.layers[0]
    block.mlp.down = Int8Linear.quantize(block.mlp.down.weight, packed=False)
    assert fused_decode_refusal(model, torch.bfloat16) is not None
    block.mlp.down = Int4Linear.quantize(block.mlp.down.weight, packed=False)
    assert block.mlp.down.kernel == "reference"
    assert fused_decode_refusal(model, torch.bfloat16) is not None
    block.mlp.down = Int4Linear.quantize(block.mlp.down.weight)
    model.lm_head = Int8Linear.quantize(model.lm_head.weight, packed=False)
    assert fused_decode_refusal(model, torch.bfloat16) is not None


def int4_reference_weight(layer: Int4Linear, values: torch.Tensor) -> torch.Tensor:
    """(q - 8) * scale + offset in fp32, from the layer's own scales and offsets."""
    scales, offsets = layer.scales_and_offsets.float().permute(2, 1, 0)  # [N, groups] each
    w = values.float().view(layer.out_features, -1, layer.group) - INT4_MIDPOINT
    return (w * scales[..., None] + offsets[..., None]).view(layer.out_features, -1)


def assert_rows_product(layer, x: torch.Tensor, scales: torch.Tensor, reference: torch.Tensor):
    got = torch.ops.tetrad.linear_rows(x, layer.values, scales=scales)
    assert got.dtype == x.dtype and got.shape == (x.shape[0], layer.out_features)
    expected = F.linear(x.float(), reference)
    bf16 = dict(atol=0.05, rtol=2e-2) if x.dtype == torch.bfloat16 else dict(atol=5e-3,
                                                                              rtol=2e-3)
    torch.testing.assert_close(got.float(), expected, **bf16)
    torch.testing.assert_close(got.float(), layer(x).float(), **bf16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 3, 5, 12, 70])  # 70: past the streamed rows, torch's kernel
def test_int8_linear_rows_equals_the_dequantized_product(dtype, rows):
    torch.manual_seed(rows)
    # An odd number of rows; torch's bf16 int8 kernel crashes on widths not a multiple of 8.
    layer = Int8Linear.quantize(torch.randn(37, 88), dtype=dtype)
    x = torch.randn(rows, 88, dtype=dtype)
    reference = layer.values.float() * layer.scales.float()[:, None]
    assert_rows_product(layer, x, layer.scales, reference)


def test_int8_linear_rows_sums_long_rows_without_overflow():
    """The int8 rows are summed in int32 against int16 activations: 8,200 columns of the largest
    values (127 against 32767) pass 2^31 in one lane unless the kernel moves its sums to fp32 on
    the way; the 8 columns past the last 16 take the scalar tail."""
    layer = Int8Linear.quantize(torch.ones(3, 8200))
    x = torch.ones(1, 8200, dtype=torch.bfloat16)
    reference = layer.values.float() * layer.scales.float()[:, None]
    assert_rows_product(layer, x, layer.scales, reference)


# 32 and 64: whole blocks of torch's packing (AVX2, AVX512); 48, 80, 112: a short block after.
@pytest.mark.parametrize("out_features", [16, 32, 48, 64, 80, 112])
@pytest.mark.parametrize("group", [32, 128])
@pytest.mark.parametrize("rows", [1, 2, 4, 7, 12, 70])
def test_int4_linear_rows_equals_the_dequantized_product(out_features, group, rows):
    torch.manual_seed(out_features + group + rows)
    in_features = 256
    values = torch.randint(0, 16, (out_features, in_features))
    scales = torch.rand(out_features, in_features // group) * 0.1 + 0.01
    zeros = torch.rand(out_features, in_features // group) * 15
    layer = Int4Linear.from_quantized(values, scales, zeros, group)
    assert layer.kernel == "cpu"
    x = torch.randn(rows, in_features, dtype=torch.bfloat16)
    assert_rows_product(layer, x, layer.scales_and_offsets, int4_reference_weight(layer, values))
