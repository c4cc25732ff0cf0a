"""The KV cache tensors, and how many blocks a memory budget buys.

One allocation holds every layer's K and V pools: pool[layer, 0] is that layer's K pool
[num_blocks, block_size, kv_heads, head_dim], pool[layer, 1] its V pool. An MLA model's pool has
one entry per token and layer, [latent | rope key], read as the key of one shared head and, its
latent columns, as the value (the absorbed form, tetrad.models.mla). Keeping them in one
tensor makes a block copy (copy-on-write, swap) one indexing operation for all layers. Under
tensor parallelism each rank's pool holds only its own kv heads (ceil(kv_heads / tp): a kv head is
replicated when there are fewer than ranks), with the same blocks on every rank.

`--kv-cache-dtype` picks the pool's element: the model's dtype (auto), bf16, fp16, or fp8 (E4M3,
one byte: K and V are rounded to it on write, saturating at +-448 with no scale, and the
gathering backends upcast what they read to the query's dtype). The pool is sized with the
planner's bytes per element of the same name.
"""

from __future__ import annotations

import gc
import re
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from tetrad.spec.model import ModelConfig
from tetrad.errors import ConfigError
from tetrad.planner.memory import kv_bytes_per_token, kv_token_layout
from tetrad.planner.precision import element_bytes
from tetrad.spec.serving import DEFAULT_CPU_KV_MEMORY

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
KV_TORCH_DTYPES = {**TORCH_DTYPES, "fp8": torch.float8_e4m3fn}
_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9,
          "kib": 2**10, "mib": 2**20, "gib": 2**30}
# On a GPU the pool takes at most this share of the memory the weights leave free: activations
# of a step and allocator fragmentation need the rest.
DEVICE_MEMORY_FRACTION = 0.9


def resolve_dtype(dtype: str, model: "str | Path | torch.nn.Module",
                  quantization: str = "none") -> str:
    """The engine's dtype name: `dtype`, or with "auto" the checkpoint's (vLLM's --dtype auto),
    a model object's parameters' for a model passed in; bf16 for an fp32 one that is quantized
    (int8 / int4 layers compute in 16 bits)."""
    if dtype != "auto":
        return dtype
    if isinstance(model, torch.nn.Module):
        stored, source = next(model.parameters()).dtype, "the model's parameters"
    else:
        from tetrad.models.hf import checkpoint_dtype

        stored, source = checkpoint_dtype(model), str(model)
    names = {value: name for name, value in TORCH_DTYPES.items()}
    if stored not in names:
        raise ConfigError(f"{source} stores {stored}, which the engine does not run: pass "
                          f"--dtype {', '.join(TORCH_DTYPES)}")
    return "bf16" if quantization != "none" and names[stored] == "fp32" else names[stored]


def resolve_kv_dtype(kv_cache_dtype: str, dtype: str) -> str:
    """The KV pool's element name: --kv-cache-dtype, or with "auto" the model's dtype."""
    return dtype if kv_cache_dtype == "auto" else kv_cache_dtype


def check_tokenizer_fits(tokenizer, vocab_size: int) -> None:
    """Stop at load time when the tokenizer a model folder gave cannot be the model's: a folder
    without tokenizer.json reads as byte-level (256 ids), and a 4,096-token model would then
    speak bytes. A vocabulary rounded up past the tokenizer's is common (the engine samples only
    the tokenizer's ids); one twice as large or more was trained with another tokenizer."""
    tokens = getattr(tokenizer, "vocab_size", vocab_size)
    if vocab_size >= 2 * tokens:
        raise ConfigError(f"the model's vocabulary has {vocab_size} tokens but its tokenizer "
                          f"only {tokens} (byte-level when the model folder has no "
                          f"tokenizer.json): pass --tokenizer with the model's tokenizer.json")


def parse_bytes(value: str | int) -> int:
    """'2GiB', '512MB', '1e9' or a plain number of bytes."""
    if isinstance(value, int):
        return value
    match = re.fullmatch(r"\s*([0-9.eE+]+)\s*([a-zA-Z]*)\s*", value)
    unit = match.group(2).lower() if match else ""
    if not match or unit not in _UNITS:
        raise ConfigError(f"cannot read {value!r} as a memory size: write e.g. 2GiB, 512MB or "
                          f"a number of bytes")
    return int(float(match.group(1)) * _UNITS[unit])


@dataclass(frozen=True)
class KVPlan:
    num_blocks: int
    block_size: int
    bytes_per_token: int
    num_cpu_blocks: int
    max_model_len: int
    tp: int = 1  # bytes_per_token and the pools are one tensor-parallel rank's
    num_layers: int = 0  # layers the pool holds: a pipeline stage's own (0: all the model's)

    def with_blocks(self, num_blocks: int) -> "KVPlan":
        return replace(self, num_blocks=num_blocks)

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def describe(self) -> str:
        total = self.num_tokens * self.bytes_per_token
        full = self.num_tokens // self.max_model_len
        per_rank = f" per rank on each of {self.tp} tensor-parallel ranks" if self.tp > 1 else ""
        return (f"KV cache: {self.num_blocks} blocks of {self.block_size} tokens = "
                f"{self.num_tokens} tokens x {self.bytes_per_token} bytes = {total / 2**20:.1f} MiB"
                f"{per_rank}"
                f"{f', {self.num_cpu_blocks} CPU swap blocks' if self.num_cpu_blocks else ''}; "
                f"max concurrent sequences: {full} at the full context of {self.max_model_len} "
                f"tokens, more when shorter")


def plan_kv_pool(config: ModelConfig, dtype: str, device: torch.device, block_size: int,
                 kv_memory: int | None, swap_memory: int, max_model_len: int, tp: int = 1,
                 num_layers: int = 0) -> KVPlan:
    """Blocks that fit the budget: --kv-memory, capped on a GPU by what the weights leave free.
    With tp > 1 the budget is one rank's, for the bytes per token of its own kv heads; with
    num_layers > 0 (a pipeline stage) for that many layers. `dtype`: the pool's element
    (resolve_kv_dtype)."""
    # The planner's formula, so `tetrad plan serve` and the engine size the same pool.
    per_token = int(kv_bytes_per_token(config, element_bytes(dtype), tp, num_layers or None))
    budget = kv_memory if kv_memory is not None else DEFAULT_CPU_KV_MEMORY
    if device.type == "cuda":
        # An unloaded model's tensors are free for this one: collected (an engine on a GPU holds
        # reference cycles, which only the collector frees; seen on an H200), then handed back
        # from torch's cache, which the driver counts as used.
        gc.collect()
        torch.cuda.empty_cache()
        free = int(torch.cuda.mem_get_info(device)[0] * DEVICE_MEMORY_FRACTION)
        budget = free if kv_memory is None else min(kv_memory, free)
    num_blocks = budget // (per_token * block_size)
    if num_blocks < 1:
        raise ConfigError(f"a KV memory budget of {budget} bytes holds no block of {block_size} "
                          f"tokens ({per_token * block_size} bytes): raise --kv-memory or lower "
                          f"--block-size")
    return KVPlan(num_blocks, block_size, per_token, swap_memory // (per_token * block_size),
                  max_model_len, tp, num_layers or config.num_layers)


class KVCache:
    def __init__(self, config: ModelConfig, plan: KVPlan, dtype: torch.dtype,
                 device: torch.device):
        # The planner's per-token layout (this rank's kv heads, as tensor_parallel.kv_heads_of).
        tensors, kv_heads, width = kv_token_layout(config, plan.tp)
        # One block more than the plan's, which no sequence ever gets: padded table entries and
        # the padding rows of a CUDA-graph batch read and write it.
        self.pad_block = plan.num_blocks
        num_layers = plan.num_layers or config.num_layers
        shape = (num_layers, tensors, plan.num_blocks + 1, plan.block_size, kv_heads, width)
        self.pool = torch.zeros(shape, dtype=dtype, device=device)
        # Pinned host memory makes the device <-> CPU swap copies asynchronous-capable and fast.
        self.cpu_pool = torch.zeros((*shape[:2], plan.num_cpu_blocks, *shape[3:]), dtype=dtype,
                                    pin_memory=device.type == "cuda")
        self.kv_heads, self.head_dim = kv_heads, width
        # MLA's one entry is its key [latent | rope key]; its value is the latent, a view of it.
        self.latent = config.attention == "mla"
        # Each layer's pools and their [slots, kv_heads, head_dim] views, made once: a step's
        # layers then index no tensor to find them.
        self.layers = [(self.pool[i, 0], self.pool[i, 0, ..., :config.kv_lora_rank])
                       if self.latent else (self.pool[i, 0], self.pool[i, 1])
                       for i in range(num_layers)]
        self.slot_views = [(k.view(-1, kv_heads, width), v.flatten(0, 1))
                           for k, v in self.layers]

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.layers[index]

    def write(self, index: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """slots: [tokens] flat slot ids (block * block_size + offset); k, v: [tokens, kv_heads,
        head_dim] (with MLA, v is the first columns of k and is not stored again)."""
        k_slots, v_slots = self.slot_views[index]
        for pool, new in ((k_slots, k),) if self.latent else ((k_slots, k), (v_slots, v)):
            new = new.to(pool.dtype)
            if pool.dtype == torch.float8_e4m3fn:  # torch copies no fp8 by index: its bytes
                pool, new = pool.view(torch.uint8), new.view(torch.uint8)
            pool.index_copy_(0, slots, new)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: (source block, destination block) in the device pool."""
        if pairs:
            source, dest = (torch.tensor(ids, device=self.pool.device) for ids in zip(*pairs))
            self.pool[:, :, dest] = self.pool[:, :, source]

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        if pairs:
            device_ids, cpu_ids = (torch.tensor(ids) for ids in zip(*pairs))
            self.cpu_pool[:, :, cpu_ids] = self.pool[:, :, device_ids.to(self.pool.device)].cpu()

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        if pairs:
            cpu_ids, device_ids = (torch.tensor(ids) for ids in zip(*pairs))
            self.pool[:, :, device_ids.to(self.pool.device)] = self.cpu_pool[:, :, cpu_ids].to(
                self.pool.device)
