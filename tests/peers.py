"""torch's own versions of tetrad's strategies, set up on tetrad's model: the peers that tests
compare against and benchmarks race (benchmarks put tests/ on sys.path to import this)."""

from __future__ import annotations

import torch
from torch import nn

from tetrad.models.transformer import Transformer
from tetrad.parallel.tensor_parallel import qkv_rows, up_rows
from tetrad.spec.model import ModelConfig


def dtensor_tensor_parallel(model: Transformer, config: ModelConfig, tp: int,
                            sequence_parallel: bool, device_type: str = "cpu") -> Transformer:
    """`model` under torch's DTensor TP over `tp` ranks (in place). DTensor splits a weight's rows
    evenly, so the fused qkv and gate/up rows are first laid out rank by rank in tetrad's order,
    and attention gets the local head counts (as torchtitan does)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)

    for block in model.layers:
        attn, mlp = block.attn, block.mlp
        device = attn.qkv.weight.device
        rows = torch.cat([qkv_rows(config, tp, r) for r in range(tp)]).to(device)
        attn.qkv.weight = nn.Parameter(attn.qkv.weight.detach()[rows])
        attn.num_heads, attn.num_kv_heads = attn.num_heads // tp, attn.num_kv_heads // tp
        attn.q_size, attn.kv_size = attn.q_size // tp, attn.kv_size // tp
        rows = torch.cat([up_rows(config.ffn_hidden_size, True, tp, r) for r in range(tp)])
        mlp.up.weight = nn.Parameter(mlp.up.weight.detach()[rows.to(device)])
    shard = Shard(1) if sequence_parallel else Replicate()
    plan = {"embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=shard),
            "lm_head": ColwiseParallel(input_layouts=shard, output_layouts=Shard(-1),
                                       use_local_output=False)}
    for i in range(config.num_layers):
        plan |= {f"layers.{i}.attn.qkv": ColwiseParallel(input_layouts=shard),
                 f"layers.{i}.attn.out": RowwiseParallel(output_layouts=shard),
                 f"layers.{i}.mlp.up": ColwiseParallel(input_layouts=shard),
                 f"layers.{i}.mlp.down": RowwiseParallel(output_layouts=shard)}
        if sequence_parallel:
            plan |= {f"layers.{i}.attn_norm": SequenceParallel(),
                     f"layers.{i}.mlp_norm": SequenceParallel()}
    if sequence_parallel:
        plan["norm"] = SequenceParallel()
    return parallelize_module(model, init_device_mesh(device_type, (tp,)), plan)
