"""GPTQ calibration of `--quantization int8|int4` (tetrad.models.quant_calibrate): on a layer whose
inputs have planted outlier channels it lowers the output error on the calibration activations
below round-to-nearest's (int4: with the clipping search), in the same layout and bytes; with no
activations (H = 0) it is round-to-nearest exactly; a tensor-parallel cut of its values is the
same cut of its dequantized weight; and the self-generated calibration tokens are drawn from the
full forward's logits (the K/V cache they are decoded with is right)."""

import pytest
import torch
from test_quantization import FAMILIES, random_model

from tetrad.models.quant import Int4Linear, Int8Linear
from tetrad.models.quant_calibrate import _KVCache, gptq, self_generated_tokens

OUT, IN, TOKENS = 64, 256, 1024


def outlier_inputs(seed: int = 0) -> torch.Tensor:
    """[TOKENS, IN] activations whose channels 3, 70, 131 and 200 are 20x the others, and
    correlated with one another (a shared factor), as trained models' outlier channels are."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(TOKENS, IN, generator=generator)
    shared = torch.randn(TOKENS, 1, generator=generator)
    outliers = torch.tensor([3, 70, 131, 200])
    x[:, outliers] = 20 * (shared + 0.3 * x[:, outliers])
    return x


def output_error(x: torch.Tensor, weight: torch.Tensor, held: torch.Tensor) -> float:
    return (x @ (weight.float() - held.float()).t()).square().mean().item()


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_gptq_lowers_the_output_error_on_its_calibration_inputs(method):
    weight = (torch.randn(OUT, IN, generator=torch.Generator().manual_seed(1)) * 0.05
              ).to(torch.bfloat16)
    x = outlier_inputs()
    nearest = (Int8Linear.quantize(weight, packed=False) if method == "int8"
               else Int4Linear.quantize(weight, packed=False))
    calibrated = gptq(weight, x.t() @ x, method, torch.bfloat16).layer(None, packed=False)
    assert type(calibrated) is type(nearest)
    assert {k: v.shape for k, v in calibrated.state_dict().items()} == {
        k: v.shape for k, v in nearest.state_dict().items()}
    before = output_error(x, weight, nearest.weight)
    after = output_error(x, weight, calibrated.weight)
    assert after < 0.5 * before, (before, after)
    # On inputs it was not calibrated on, from the same distribution, it still helps.
    fresh = outlier_inputs(seed=7)
    assert output_error(fresh, weight, calibrated.weight) < output_error(fresh, weight,
                                                                         nearest.weight)


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_without_activations_gptq_is_round_to_nearest(method):
    weight = (torch.randn(OUT, IN, generator=torch.Generator().manual_seed(2)) * 0.05
              ).to(torch.bfloat16)
    nearest = (Int8Linear.quantize(weight, packed=False) if method == "int8"
               else Int4Linear.quantize(weight, packed=False))
    held = gptq(weight, torch.zeros(IN, IN), method, torch.bfloat16).layer(None, packed=False)
    assert torch.equal(held.weight, nearest.weight)


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_a_cut_of_the_quantized_values_is_the_same_cut_of_the_weight(method):
    weight = (torch.randn(OUT, IN, generator=torch.Generator().manual_seed(3)) * 0.05
              ).to(torch.bfloat16)
    x = outlier_inputs()
    quantized = gptq(weight, x.t() @ x, method, torch.bfloat16)
    whole = quantized.layer(None, packed=False).weight
    rows = torch.tensor([5, 9, 10, 40, 63])
    columns = torch.arange(128, 256)  # a whole group of int4's
    for dim, indices in ((0, rows), (1, columns)):
        cut = quantized.select(dim, indices).layer(None, packed=False).weight
        assert torch.equal(cut, whole.index_select(dim, indices)), dim


@pytest.mark.parametrize("family", ["llama", "mla"])
def test_the_calibration_tokens_are_what_the_full_forward_samples(family):
    """The logits each calibration token is drawn from, decoded one token at a time through the
    K/V cache, are the full forward's over the same tokens (in fp32: in bf16 a rounding may flip
    an MoE routing)."""
    model = random_model(FAMILIES[family]).float()
    tokens = self_generated_tokens(model, sequences=3, length=12)
    assert tokens.shape == (3, 12)
    with torch.no_grad():
        full = model(tokens).float()
        cache, cached = _KVCache(), []
        for position in range(tokens.shape[1]):
            cached.append(model(tokens[:, position:position + 1], torch.tensor([position]),
                                cache=cache)[:, -1].float())
    cached = torch.stack(cached, dim=1)
    assert torch.allclose(cached, full, atol=1e-4), (cached - full).abs().max()
