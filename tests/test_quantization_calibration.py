"""GPTQ calibration of `--quantization int8|int4` (tetrad.models.quant_calibrate): on a layer whose
inputs have planted outlier channels it lowers the output error on the calibration activations
below round-to-nearest's (int4: with the clipping search), in the same layout and bytes, and int4's
pairs refitted to the chosen levels lower it further; each block is calibrated on the inputs the
blocks before it give once quantized; with no activations (H = 0) it is round-to-nearest exactly; a tensor-parallel cut of its values is the
same cut of its dequantized weight; and the self-generated calibration tokens are drawn from the
full forward's logits (the K/V cache they are decoded with is right)."""

import copy

import pytest
import torch
from test_quantization import FAMILIES, random_model

from tetrad.models.quant import Int4Linear, Int8Linear
from tetrad.models.quant_calibrate import (_Int4Grid, _KVCache, _swap, calibrated_weights,
                                           first_block_inputs, gptq, input_hessians,
                                           self_generated_tokens)
from tetrad.models.quant_model import _projections

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


def test_refitting_int4s_pairs_to_the_chosen_levels_lowers_the_output_error(monkeypatch):
    """GPTQ's int4 grid is fixed before it picks the levels; refitting each row's scales and
    offsets to those levels (least squares on the same Hessian) lowers the layer's output error
    on the calibration inputs below GPTQ's on its fixed grid, which is below round-to-nearest's,
    in the same layout."""
    weight = (torch.randn(OUT, IN, generator=torch.Generator().manual_seed(4)) * 0.05
              ).to(torch.bfloat16)
    x = outlier_inputs()
    refitted = gptq(weight, x.t() @ x, "int4", torch.bfloat16)
    monkeypatch.setattr(_Int4Grid, "refit", lambda *args: None)
    fixed = gptq(weight, x.t() @ x, "int4", torch.bfloat16)
    assert torch.equal(refitted.values, fixed.values)  # the same levels, other pairs
    assert refitted.grid.shape == fixed.grid.shape and not torch.equal(refitted.grid, fixed.grid)
    errors = [output_error(x, weight, held.layer(None, packed=False).weight)
              for held in (refitted, fixed)]
    nearest = output_error(x, weight, Int4Linear.quantize(weight, packed=False).weight)
    assert errors[0] < 0.9 * errors[1] < 0.9 * nearest, (errors, nearest)


def test_a_block_is_calibrated_on_the_quantized_blocks_before_it():
    """Layer 1's values are GPTQ's on the Hessians of the inputs that layer 0, already
    quantized, gives it (not the 16-bit layer 0's), counted again here; the model is left as
    it was."""
    model = random_model(FAMILIES["llama"])
    before = {name: p.clone() for name, p in model.state_dict().items()}
    projections = _projections(model)
    tokens = torch.randint(256, (4, 32), generator=torch.Generator().manual_seed(5))
    quantized = calibrated_weights(model, projections, "int4", torch.bfloat16, tokens)
    assert all(torch.equal(p, before[name]) for name, p in model.state_dict().items())
    assert all(type(m) is torch.nn.Linear for m in projections.values())
    second = {name: m for name, m in projections.items() if name.startswith("layers.1.")}

    def layer_1_values(quantized_layer_0: bool) -> dict:
        served = copy.deepcopy(model)
        if quantized_layer_0:
            for name, module in projections.items():
                if name.startswith("layers.0."):
                    _swap(served, name, quantized[name].layer(module.bias, packed=False))
        calls = [(served.layers[0](*args), *args[1:])
                 for args in first_block_inputs(served, tokens)]
        hessians = input_hessians(served.layers[1], {
            name: served.get_submodule(name) for name in second}, calls)
        return {name: gptq(second[name].weight, hessians[name], "int4", torch.bfloat16).values
                for name in second}

    through_quantized, through_16_bit = layer_1_values(True), layer_1_values(False)
    assert all(torch.equal(quantized[name].values, through_quantized[name]) for name in second)
    assert not all(torch.equal(quantized[name].values, through_16_bit[name]) for name in second)


def test_the_calibration_seed_is_read_when_the_tokens_are_drawn(monkeypatch):
    """benchmarks/quant_agreement.py measures the spread over calibration seeds by setting
    CALIBRATION_SEED, which the engine's load reaches only through the default: it is read at
    call time, not fixed when the function was defined."""
    from tetrad.models import quant_calibrate

    model = random_model(FAMILIES["llama"]).float()
    default = self_generated_tokens(model, sequences=2, length=6)
    monkeypatch.setattr(quant_calibrate, "CALIBRATION_SEED", 5)
    reseeded = self_generated_tokens(model, sequences=2, length=6)
    assert torch.equal(reseeded, self_generated_tokens(model, sequences=2, length=6, seed=5))
    assert not torch.equal(reseeded, default)


def test_the_benchmark_s_calibration_text_reaches_the_load_and_is_undone():
    """benchmarks/quant_agreement.py's --calibration-texts rows: inside `calibrated_on(tokens)`
    the load (quantize_model, which calibrates on self-generated tokens by default) calibrates
    on exactly those tokens, and after it the default is back."""
    from benchmarks.quant_agreement import calibrated_on

    from tetrad.models import quant_calibrate
    from tetrad.models.quant_model import quantize_model

    model = random_model(FAMILIES["llama"]).to(torch.bfloat16)
    tokens = torch.randint(model.config.vocab_size, (3, 12), generator=torch.Generator()
                           .manual_seed(1))
    copied = copy.deepcopy(model)
    on_text = calibrated_weights(copied, _projections(copied), "int8", torch.bfloat16,
                                 tokens=tokens)
    with calibrated_on(tokens):
        loaded = quantize_model(copy.deepcopy(model), "int8")
    held = {name: module for name, module in loaded.named_modules()
            if isinstance(module, Int8Linear)}
    assert held.keys() == on_text.keys()
    assert all(torch.equal(held[name].weight, on_text[name].layer(None, False).weight)
               for name in held)
    assert quant_calibrate.self_generated_tokens is self_generated_tokens
