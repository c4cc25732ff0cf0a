"""The GPU's int8 weight-only kernel (tetrad/models/int8_triton.py) computes x @ (values * scales).T:
here under Triton's interpreter, in a fresh process (TRITON_INTERPRET=1 must be set before triton
is imported), in fp32 (the interpreter's bf16 arithmetic is wrong), on shapes that fill no tile
evenly and on both tilings (decode rows up to 16, then up to MAX_KERNEL_ROWS). On a GPU the layer
runs it in bf16: tests/gpu/test_gpu_quantization.py."""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

CASES = """
import json
import torch
from tetrad.models.int8_triton import int8_weight_product
from tetrad.models.quant import MAX_KERNEL_ROWS

errors = []
generator = torch.Generator().manual_seed(0)
for rows, depth, cols in [(1, 96, 40), (5, 300, 48), (16, 256, 16), (33, 520, 70),
                          (MAX_KERNEL_ROWS, 64, 24)]:
    x = torch.randn(rows, depth, generator=generator)
    values = torch.randint(-127, 128, (cols, depth), generator=generator, dtype=torch.int8)
    scales = torch.rand(cols, generator=generator) + 0.01
    y = int8_weight_product(x, values, scales)
    weight = values.double() * scales.double()[:, None]
    exact = x.double() @ weight.t()
    bound = (x.double().abs() @ weight.abs().t()) * 2.0 ** -20
    errors.append([list(y.shape), bool(((y.double() - exact).abs() <= bound).all())])
print(json.dumps(errors))
"""


def test_the_kernel_is_the_dequantized_product_under_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run([sys.executable, "-c", CASES], capture_output=True, text=True,
                            timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    cases = json.loads(result.stdout.splitlines()[-1])
    assert cases == [[[1, 40], True], [[5, 48], True], [[16, 16], True], [[33, 70], True],
                     [[64, 24], True]]
