"""tetrad.models.quant's layers: the formulas they document (values already quantized, as a GGUF
reader hands them in), the quantizer's rounding error, torch's packed kernels against the
reference product, and the bytes each layer holds."""

import pytest
import torch

from tetrad.models.quant import INT4_GROUPS, Int4Linear, Int8Linear

BF16_HALF_ULP = 2.0 ** -8  # relative rounding of one bf16 value (8 significant bits)
# A bf16 product against the fp32 one over the same weights: the output's rounding and bf16
# partial sums, relative to sum |x| |w|.
PRODUCT_SLACK = 2.0 ** -7


def held_bytes(layer: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in (*layer.buffers(), *layer.parameters()))


def product_error(layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | float = 0.0
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """|layer(x) - (x @ weight.T + bias) in fp32| and its allowance."""
    weight = layer.weight.float()
    exact = x.float() @ weight.t() + bias
    allowed = PRODUCT_SLACK * (x.float().abs() @ weight.abs().t() + abs(bias))
    return (layer(x).float() - exact).abs(), allowed


def test_int8_from_quantized_is_scale_times_value():
    generator = torch.Generator().manual_seed(0)
    values = torch.randint(-128, 128, (48, 80), generator=generator, dtype=torch.int8)
    scales = torch.rand(48, generator=generator) + 0.01
    layer = Int8Linear.from_quantized(values, scales)
    expected = (values.float() * scales.bfloat16().float()[:, None]).bfloat16()
    assert torch.equal(layer.weight, expected)
    assert layer.scales.dtype == torch.bfloat16 and layer.values.dtype == torch.int8


def test_int8_quantizer_rounds_each_row_to_half_its_scale():
    generator = torch.Generator().manual_seed(1)
    weight = torch.randn(32, 96, generator=generator) * torch.logspace(-3, 1, 32)[:, None]
    weight[5] = 0.0
    layer = Int8Linear.quantize(weight)
    scales = layer.scales.float()
    assert scales[5] == 1.0 and (layer.values[5] == 0).all()
    assert layer.values.abs().max() == 127 and layer.values.min() >= -127
    error = (layer.values.float() * scales[:, None] - weight).abs()
    # Half a step, plus the step's own rounding to bf16 carried over 127 steps.
    allowed = scales[:, None] / 2 + 127 * BF16_HALF_ULP * scales[:, None]
    assert (error <= allowed).all()
    # The row's largest weight is the largest value: nothing clipped.
    assert (layer.values.abs().amax(dim=1)[torch.arange(32) != 5] == 127).all()


@pytest.mark.parametrize("shape", [(3, 96), (2, 5, 96)])
def test_int8_packed_kernel_and_reference_agree_with_the_dequantized_product(shape):
    generator = torch.Generator().manual_seed(2)
    weight, bias = torch.randn(40, 96, generator=generator), torch.randn(40, generator=generator)
    x = torch.randn(*shape, generator=generator).bfloat16()
    packed, reference = Int8Linear.quantize(weight, bias), Int8Linear.quantize(weight, bias,
                                                                              packed=False)
    assert packed.packed and not reference.packed
    assert torch.equal(packed.weight, reference.weight)
    for layer in (packed, reference):
        error, allowed = product_error(layer, x, layer.bias.float())
        assert (error <= allowed).all()
        assert layer(x).shape == (*shape[:-1], 40) and layer(x).dtype == torch.bfloat16


@pytest.mark.parametrize("group", INT4_GROUPS)
def test_int4_from_quantized_follows_the_documented_formula(group):
    generator = torch.Generator().manual_seed(3)
    out_features, in_features = 32, 512
    values = torch.randint(0, 16, (out_features, in_features), generator=generator)
    groups = in_features // group
    # Scales that bf16 holds exactly and zeros that are whole or fractional.
    scales = (torch.rand(out_features, groups, generator=generator) + 0.5).bfloat16().float()
    zeros = torch.rand(out_features, groups, generator=generator) * 15
    for packed in (True, False):
        layer = Int4Linear.from_quantized(values, scales, zeros, group, packed=packed)
        assert layer.kernel == ("cpu" if packed else "reference")
        exact = (scales.repeat_interleave(group, 1)
                 * (values.float() - zeros.repeat_interleave(group, 1)))
        # The offset scale * (8 - zero) is rounded to bf16, then the weight is.
        offsets = (scales * (8 - zeros)).abs().repeat_interleave(group, 1)
        allowed = BF16_HALF_ULP * (offsets + exact.abs()) * 1.01
        assert ((layer.weight.float() - exact).abs() <= allowed).all()


def test_int4_with_zero_eight_and_bf16_scales_is_exact_as_gguf_q4_0():
    generator = torch.Generator().manual_seed(4)
    values = torch.randint(0, 16, (16, 64), generator=generator, dtype=torch.uint8)
    scales = torch.rand(16, 2, generator=generator).bfloat16().float()
    layer = Int4Linear.from_quantized(values, scales, torch.full((16, 2), 8.0), 32)
    expected = scales.repeat_interleave(32, 1) * (values.float() - 8)
    assert torch.equal(layer.weight, expected.bfloat16())


def unpacked_values(layer: Int4Linear) -> torch.Tensor:
    return torch.stack((layer.values & 15, layer.values >> 4), -1).flatten(1)


def round_to_nearest_error(weight: torch.Tensor, group: int) -> torch.Tensor:
    """Each group's squared error [out, in / group] under plain rounding over the group's whole
    min..max, dequantized and rounded to bf16 as the layer holds its weight."""
    w = weight.view(weight.shape[0], -1, group)
    low, high = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    scales = ((high - low) / 15).bfloat16().float()
    offsets = (low + 8 * scales).bfloat16().float()
    values = (torch.round((w - offsets) / scales) + 8).clamp(0, 15)
    held = ((values - 8) * scales + offsets).bfloat16().float()
    return (held - w).square().sum(-1)


def group_error(layer: Int4Linear, weight: torch.Tensor) -> torch.Tensor:
    return (layer.weight.float() - weight).square().view(weight.shape[0], -1,
                                                           layer.group).sum(-1)


@pytest.mark.parametrize("group", INT4_GROUPS)
def test_int4_quantizer_rounds_within_its_range_and_clamps_beyond_it(group):
    generator = torch.Generator().manual_seed(5)
    weight = torch.randn(16, 512, generator=generator)
    weight[3, :group] = 0.25  # a constant group
    layer = Int4Linear.quantize(weight, group=group, packed=False)
    scales, offsets = layer.scales_and_offsets.float().permute(2, 1, 0)
    assert scales[3, 0] == 1.0
    error = (layer.weight.float() - weight).abs()
    step = scales.repeat_interleave(group, 1)
    offset = offsets.repeat_interleave(group, 1)
    bottom, top = offset - 8 * step, offset + 7 * step
    inside = (weight >= bottom - step / 2) & (weight <= top + step / 2)
    level = offset.abs() + 8 * step
    slack = 2 * BF16_HALF_ULP * (level + weight.abs())
    assert (error[inside] <= (step / 2 + slack)[inside]).all()
    # A weight beyond the (clipped) range is held at the range's nearer end.
    values = unpacked_values(layer)
    assert (values[weight < bottom - step / 2] == 0).all()
    assert (values[weight > top + step / 2] == 15).all()
    # Clipping only ever shrinks the range: each group's ends are still its extreme levels.
    per_group = values.view(16, -1, group)
    assert (per_group.amax(-1)[scales != 1.0] >= 14).all() and (per_group.amin(-1) <= 1).all()


@pytest.mark.parametrize("group", INT4_GROUPS)
def test_int4_clipping_search_never_loses_to_round_to_nearest(group):
    generator = torch.Generator().manual_seed(7)
    normal = torch.randn(32, 512, generator=generator)
    # A scale mixture of normals: most weights small, a few many times larger per group.
    heavy = normal * torch.exp(1.5 * torch.randn(32, 512, generator=generator))
    for weight in (normal, heavy):
        layer = Int4Linear.quantize(weight, group=group, packed=False)
        searched, plain = group_error(layer, weight), round_to_nearest_error(weight, group)
        assert (searched <= plain).all()
        assert held_bytes(layer) == 32 * 512 // 2 + 32 * (512 // group) * 2 * 2
    # On the heavy tails the search clips most groups to a strictly smaller error, and the
    # total drops by more than the bf16 rounding of scales and weights could account for.
    assert (searched < plain).float().mean() > 0.5
    assert searched.sum() < 0.97 * plain.sum()


@pytest.mark.parametrize("group", INT4_GROUPS)
def test_int4_packed_kernel_and_reference_agree(group):
    generator = torch.Generator().manual_seed(6)
    weight, bias = torch.randn(48, 512, generator=generator), torch.randn(48, generator=generator)
    x = torch.randn(2, 3, 512, generator=generator).bfloat16()
    packed = Int4Linear.quantize(weight, bias, group)
    reference = Int4Linear.quantize(weight, bias, group, packed=False)
    assert packed.kernel == "cpu" and reference.kernel == "reference"
    # The kernel's weight, read back through it, is the reference's bit for bit.
    assert torch.equal(packed.weight, reference.weight)
    for layer in (packed, reference):
        error, allowed = product_error(layer, x, layer.bias.float())
        assert (error <= allowed).all()


def test_int4_rows_the_cpu_kernel_cannot_take_run_the_reference_product():
    weight = torch.randn(24, 128)  # 24 rows: the CPU layout wants a multiple of 16
    layer = Int4Linear.quantize(weight, group=32)
    assert layer.kernel == "reference"
    x = torch.randn(4, 128).bfloat16()
    error, allowed = product_error(layer, x)
    assert (error <= allowed).all()


def test_int8_widths_the_cpu_kernel_misreads_run_the_reference_product():
    # torch 2.13's _weight_int8pack_mm, given several rows of width 76, returned wrong sums
    # (inf against the product) or segfaulted.
    weight = torch.randn(32, 76)
    layer = Int8Linear.quantize(weight)
    assert not layer.packed
    x = torch.randn(3, 76).bfloat16()
    error, allowed = product_error(layer, x)
    assert (error <= allowed).all()


def test_bytes_held_are_the_values_plus_their_scales():
    weight = torch.randn(64, 256)
    assert held_bytes(Int8Linear.quantize(weight)) == 64 * 256 + 64 * 2
    for group in INT4_GROUPS:
        for packed in (True, False):
            layer = Int4Linear.quantize(weight, group=group, packed=packed)
            assert held_bytes(layer) == 64 * 256 // 2 + 64 * (256 // group) * 2 * 2


def test_bad_inputs_are_refused_with_the_rule():
    with pytest.raises(ValueError, match="divide the input width"):
        Int4Linear.quantize(torch.randn(16, 96), group=64)
    with pytest.raises(ValueError, match="one of"):
        Int4Linear.quantize(torch.randn(16, 96), group=48)
    with pytest.raises(ValueError, match="0..15"):
        Int4Linear.from_quantized(torch.full((16, 32), 16), torch.ones(16, 1), torch.zeros(16, 1),
                                  32)
    with pytest.raises(ValueError, match=r"\[out, in / group\]"):
        Int4Linear.from_quantized(torch.zeros(16, 64, dtype=torch.int32), torch.ones(16, 1),
                                  torch.zeros(16, 1), 32)
    with pytest.raises(ValueError, match="one per output row"):
        Int8Linear.from_quantized(torch.zeros(16, 32, dtype=torch.int8), torch.ones(32))
    with pytest.raises(ValueError, match="bf16 or fp16"):
        Int8Linear.quantize(torch.randn(4, 8), dtype=torch.float32)
