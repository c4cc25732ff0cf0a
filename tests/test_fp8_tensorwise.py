"""`--fp8-recipe tensor` (tetrad.models.fp8_tensorwise): one scale per tensor, E4M3 inputs and
weights, E5M2 gradients. The quantizer's scales and errors against each format's bits, the
linear's forward and gradients against fp32 within bounds derived from them (compiled against
eager: tests/test_fp8.py), padding for the GPU kernel, and training: it runs in FP8 for real,
stays near bf16, compiled follows eager, and its counted activations are the planner's
(tests/test_report.py)."""

import pytest
import torch
import torch.nn.functional as F

from tetrad.cli.main import main
from tetrad.spec.model import TrainConfig
from tetrad.errors import ConfigError
from tetrad.models.fp8 import E4M3, E4M3_MAX, pad_to
from tetrad.models.fp8_layers import FP8Linear, convert_to_fp8
from tetrad.models.fp8_tensorwise import (E5M2, quantize_whole, scaled_product,
                                          tensorwise_fp8_linear)
from tetrad.models.transformer import Transformer
from tetrad.spec.presets import PRESETS
from tetrad.train.trainer import train

E5M2_MAX = 57344.0
FP32_SLACK = 1e-5  # fp32 accumulation order, relative to the sum of |products|
# Per format: half an ulp, relative (3 and 2 mantissa bits), and half the smallest subnormal
# (2^-9 and 2^-16), in units of the scale.
HALF_ULP = {E4M3: 2.0 ** -4, E5M2: 2.0 ** -3}
HALF_SUBNORMAL = {E4M3: 2.0 ** -10, E5M2: 2.0 ** -17}
LARGEST = {E4M3: E4M3_MAX, E5M2: E5M2_MAX}


def error_bound(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Largest |dequantised - x| with one scale, amax / largest, for all of x."""
    scale = x.abs().max() / LARGEST[dtype]
    return HALF_ULP[dtype] * x.abs() + HALF_SUBNORMAL[dtype] * scale


def product_bound(a: torch.Tensor, a_dtype: torch.dtype, b: torch.Tensor, b_dtype: torch.dtype
                  ) -> torch.Tensor:
    """Bound on |Ã B̃^T - A B^T|: |ΔA| (|B| + |ΔB|) + |A| |ΔB| over K, plus fp32 slack."""
    da, db = error_bound(a, a_dtype), error_bound(b, b_dtype)
    return da @ (b.abs() + db).t() + a.abs() @ db.t() + FP32_SLACK * a.abs() @ b.abs().t()


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_the_scale_is_the_amax_over_the_largest_value_and_the_error_stays_in_the_format(dtype):
    generator = torch.Generator().manual_seed(0)
    # Eleven decades of magnitude, more than either format spans: the small ones land in the
    # subnormals or flush to zero.
    x = torch.randn(64, 96, generator=generator) * 10.0 ** torch.randint(-9, 2, (64, 96),
                                                                        generator=generator)
    q, scale = quantize_whole(x, dtype)
    assert q.dtype == dtype and scale.shape == () and scale.dtype == torch.float32
    assert scale == x.abs().max() / LARGEST[dtype]
    error = (q.float() * scale - x).abs()
    assert (error <= error_bound(x, dtype)).all()
    assert (q.float() == 0).any() and (x != 0).all()  # the smallest values are lost, as stated


def test_representable_values_round_trip_and_empty_or_zero_tensors_get_scale_one():
    values = torch.arange(256, dtype=torch.uint8).view(E4M3).float()
    values = values[~values.isnan()]  # every finite E4M3 value, 448 among them: scale 1
    q, scale = quantize_whole(values)
    assert scale == 1.0 and torch.equal(q.float(), values)
    for x in (torch.zeros(3, 5), torch.zeros(0, 5)):
        q, scale = quantize_whole(x)
        assert scale == 1.0 and q.shape == x.shape and not q.float().any()


@pytest.mark.parametrize("a_dtype", [E4M3, E5M2])  # E5M2: a gradient, dX's and dW's left side
def test_padding_for_the_gpu_kernel_changes_nothing(a_dtype):
    """On CUDA every dimension is padded to 16 (cuBLAS's need): forcing it here on odd shapes
    gives the unpadded product, and the padding itself is zeros in either format. The padded
    zeros add nothing to a dot product, but a longer K may change the CPU kernel's summation
    order (bit-equal on one machine, 2e-5 apart on an AMD EPYC's), so both products are held to
    the float64 product within the fp32 bound of a K-term sum, K * 2^-24 * sum |a_k b_k|."""
    generator = torch.Generator().manual_seed(1)
    (a, sa), (b, sb) = (quantize_whole(torch.randn(37, 300, generator=generator), a_dtype),
                        quantize_whole(torch.randn(70, 300, generator=generator)))
    plain = scaled_product(a, sa, b, sb, torch.float32, multiple=1)
    padded = scaled_product(a, sa, b, sb, torch.float32, multiple=16)
    a64, b64 = a.double() * sa.double(), b.double() * sb.double()
    bound = a.shape[1] * 2.0**-24 * (a64.abs() @ b64.abs().T)
    assert padded.shape == plain.shape == (37, 70)
    for product in (plain, padded):
        assert ((product.double() - a64 @ b64.T).abs() <= bound).all()
    grown = pad_to(pad_to(a, 0, 16), 1, 16)
    assert grown.dtype == a_dtype and grown.shape == (48, 304)
    assert torch.equal(grown[:37, :300].float(), a.float()) and not grown[37:].float().any()
    assert not grown[:, 300:].float().any()
    a_values, b_values = a.float() * sa, b.float() * sb
    exact = a_values @ b_values.t()
    assert ((plain - exact).abs() <= FP32_SLACK * a_values.abs() @ b_values.abs().t()).all()


def test_linear_forward_and_gradients_stay_within_the_format_bounds():
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(2, 150, 300, generator=generator, requires_grad=True)
    w = (torch.randn(200, 300, generator=generator) * 0.05).requires_grad_()
    bias = torch.randn(200, generator=generator, requires_grad=True)
    grad_out = torch.randn(2, 150, 200, generator=generator)
    y = tensorwise_fp8_linear(x, w, bias)
    y.backward(grad_out)
    x2, g2, wd = x.detach().reshape(-1, 300), grad_out.reshape(-1, 200), w.detach()
    assert y.dtype == torch.float32
    error = (y.detach().reshape(-1, 200) - F.linear(x2, wd, bias.detach())).abs()
    bound = product_bound(x2, E4M3, wd, E4M3)
    assert (error <= bound).all()
    assert error.max() > 0.05 * bound.max()  # quantised for real: not an fp32 matmul
    # dX = dY W: dY in E5M2, W's E4M3 copy from the forward.
    bound = product_bound(g2, E5M2, wd.t(), E4M3)
    assert ((x.grad.reshape(-1, 300) - g2 @ wd).abs() <= bound).all()
    # dW = dY^T X: X's E4M3 copy from the forward.
    bound = product_bound(g2.t(), E5M2, x2.t(), E4M3)
    assert ((w.grad - g2.t() @ x2).abs() <= bound).all()
    assert torch.allclose(bias.grad, g2.sum(0), rtol=1e-6, atol=1e-5)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the output follows autocast
        assert tensorwise_fp8_linear(x, w, bias).dtype == torch.bfloat16


def test_conversion_picks_the_recipe_for_every_block_linear():
    model = convert_to_fp8(Transformer(PRESETS["tiny-moe"]), "tensor")
    recipes = {name: module.recipe for name, module in model.named_modules()
               if isinstance(module, FP8Linear)}
    assert recipes["layers.0.attn.qkv"] == "tensor" == recipes["layers.1.mlp.experts.3.down"]
    assert set(recipes.values()) == {"tensor"}


def test_the_recipe_needs_fp8_and_a_known_name(capsys):
    with pytest.raises(ConfigError, match="--fp8-recipe tensor needs --dtype fp8"):
        TrainConfig(dtype="bf16", fp8_recipe="tensor")
    with pytest.raises(ConfigError, match="fp8_recipe"):
        TrainConfig(dtype="fp8", fp8_recipe="row")
    assert main(["train", "--dtype", "bf16", "--fp8-recipe", "tensor", "--steps", "1"]) == 2
    assert "needs --dtype fp8" in capsys.readouterr().err


def test_tensorwise_training_runs_in_fp8_near_bf16_and_compiled_as_eager(corpus_file):
    """4 steps of the tiny model: the losses differ from bf16's (the linears did run in FP8) by
    less than 1% (measured up to 3.2e-4 relative), and compiled training follows eager within
    1e-3 (measured 3.6e-4: inductor orders the bf16 roundings differently)."""
    common = dict(model="tiny", data=corpus_file, steps=4, batch_size=8, seq_len=32,
                  warmup_steps=1, sample_tokens=0)
    losses = {}
    for name, fields in (("bf16", dict(dtype="bf16")),
                         ("tensor", dict(dtype="fp8", fp8_recipe="tensor")),
                         ("compiled", dict(dtype="fp8", fp8_recipe="tensor", compile=True))):
        torch._dynamo.reset()
        losses[name] = [step["loss"] for step in
                        train(TrainConfig(**common, **fields), show_progress=False)
                        .report["steps"]]
    assert losses["tensor"] != losses["bf16"]
    assert losses["tensor"] == pytest.approx(losses["bf16"], rel=1e-2)
    assert losses["compiled"] == pytest.approx(losses["tensor"], rel=1e-3)
