"""Attention of a step's new query tokens over K/V that live in the paged cache, read through block
tables: one backend per file, each an `AttentionBackend` (base.py), listed by name in registry.py.

    backend       file        reads the pool                 where
    varlen        varlen.py   in place: flash-attention      CUDA, blocks of 256k (auto there)
    cpu           cpu.py      in place: C++ decode kernel    CPU (auto there); chunks gathered
    flex          flex.py     in place: FlexAttention mask   compiled on a GPU; eager = dense
    sdpa          sdpa.py     gathered, torch's SDPA         anywhere; the tests' reference
    tiled         tiled.py    tiled through the tables       anywhere; no copy of the context
    auto          tiled.py    sdpa, or tiled when large      where auto finds nothing in place

A backend says what it supports (`devices`, and `refusal(device, block_size, latent, dtype)`:
one line why it cannot run, or None), prepares its own data for a step (`uploads`: integer
lists sent to the device with the step's one copy; `prepare`: its step data from the step's
tensors and those lists), attends for one layer (the step data's `attend(layer, q, k, v)`,
which writes the step's K/V at its slots first), and says what a CUDA graph needs (`capturable`:
reads in place with shapes fixed at capture; `graph_step`: its step data made on the device
from a graph's static buffers, so that a replay recomputes it). The runner and the graphs call
only that; they never ask a backend's name.

Adding a backend: one file with a subclass of AttentionBackend and its step data, and one line in
registry.py's BACKENDS (their order is auto's preference; `automatic = True` lets auto pick it).
`registry.register` adds one from outside the package (a test's).

Shapes of the batched functions: q [batch, queries, heads, head_dim]; k_cache, v_cache
[num_blocks, block_size, kv_heads, head_dim]; block_tables [batch, max_blocks], as wide as the
longest context (the caller sizes it once per step, so nothing here waits on the device) and
padded with any valid block id; query_positions [batch, queries]: a query attends to keys at
positions <= its own, which also bounds it to its own context (padded queries repeat a real
position). Returns [batch, queries, heads, v_cache's head_dim]: MLA's values (the latent, a view
of the first columns of its cache entries) are narrower than its keys.
"""

from tetrad.inference.worker.attention.base import (AttentionBackend, DeviceStep, HostStep,
                                                    StepAttention, StepContext)
from tetrad.inference.worker.attention.cpu import kernel_paged_decode
from tetrad.inference.worker.attention.flex import flex_paged_attention, paged_block_mask
from tetrad.inference.worker.attention.registry import BACKENDS, register, resolve_backend
from tetrad.inference.worker.attention.sdpa import sdpa_paged_attention, visible_keys
from tetrad.inference.worker.attention.tiled import tiled_paged_attention
from tetrad.inference.worker.attention.varlen import (flash_takes_block_tables,
                                                      varlen_paged_attention)

__all__ = ["AttentionBackend", "BACKENDS", "DeviceStep", "HostStep", "StepAttention", "StepContext",
           "flash_takes_block_tables", "flex_paged_attention", "kernel_paged_decode",
           "paged_block_mask", "register", "resolve_backend", "sdpa_paged_attention",
           "tiled_paged_attention", "varlen_paged_attention", "visible_keys"]
