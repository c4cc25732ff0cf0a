"""Activation recomputation (`--recompute {none,selective,full}`): keep less for backward and run
part of the forward again during backward instead (torch.utils.checkpoint, non-reentrant).

- full: each transformer block keeps only its input; its whole forward runs again in backward
  (Chen et al. 2016). What a step saves no longer grows with the block's internals: one hidden
  state [batch, seq, hidden] per layer.
- selective: only the attention core softmax(QK^T)V runs again (Korthikanti et al. 2022), the
  part whose saved tensors grow with seq^2 when the kernel materializes the probabilities.

What selective saves depends on the attention kernel, measured by tests/test_recompute.py:
- SDPA's fused kernel (flash attention; what CPU fp32 training runs) never keeps an S x S tensor:
  it saves q, k, v, the output and the log-sum-exp. Recomputing it drops only the output and the
  log-sum-exp, batch*heads*seq*(head_dim + 1)*4 bytes per layer. There is no S^2 part to drop.
- SDPA's math path (or any attention that materializes the probabilities) keeps the
  [batch, heads, seq, seq] probabilities; selective recomputation drops them.
- Ring attention (context parallelism) is already flash-style, and recomputing it would send its
  K/V around the ring again: selective leaves it alone.

- sqrt (Chen et al. 2016, √N checkpointing): the N blocks of each pipeline stage (the whole
  model without a pipeline) are cut into consecutive segments of k = ceil(sqrt(N)) blocks (the
  last one shorter when k does not divide N; tetrad.spec.layout.sqrt_segments), and only each segment's input is
  kept: ceil(N / k) hidden states. Backward runs one segment's forward again at a time, so at
  its peak it also holds one segment's internals (its k blocks' saved tensors), where full holds
  one block's: about 2 sqrt(N) hidden-state-sized sets in all instead of N. Every block's forward
  runs once more, as under full.

Where full and sqrt keep each checkpoint's input (whole on the device; ZeRO-R's 1/tp share,
gathered before the rerun; in host memory) is tetrad.parallel.kept_inputs's.

Full and sqrt recomputation re-run a block's communication too (ring attention's K/V hops, expert
parallelism's all-to-alls) during backward; the byte counters see that traffic.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Sequence

import torch
from torch import nn
from torch.utils.checkpoint import _checkpoint_without_reentrant_generator, checkpoint

from tetrad.errors import ConfigError
from tetrad.memory import storage_id
from tetrad.spec.layout import RECOMPUTE_MODES as MODES, sqrt_segments
from tetrad.models.transformer import Transformer
from tetrad.parallel.context_parallel import RingAttention
from tetrad.parallel.kept_inputs import KeptInputs


class RecomputedAttention:
    """An attention core whose forward runs again during backward: only its inputs q, k, v are
    kept (the checkpoint saves them, so an ActivationMeter counts them)."""

    def __init__(self, core: Callable):
        self.core = core

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():
            return self.core(q, k, v)
        return checkpoint(self.core, q, k, v, use_reentrant=False)


class RecomputedBlock:
    """A block's forward under a checkpoint. Installed on the instance, so parameter names (and
    the checkpoint format) stay those of the plain model; it wraps the forward the block has
    (a compiled one under --compile, which then runs again in backward). `kept`: where the
    checkpoint keeps the block's input (ZeRO-R; None: whole, on the device)."""

    def __init__(self, forward: Callable, kept: KeptInputs | None = None):
        self.forward = forward
        self.kept = kept

    def __call__(self, x: torch.Tensor, rope, attend=None) -> torch.Tensor:
        if not torch.is_grad_enabled():
            return self.forward(x, rope, attend)
        with self.kept.keeping(x) if self.kept else contextlib.nullcontext():
            return checkpoint(self.forward, x, rope, attend, use_reentrant=False)


class CheckpointedSegment:
    """Consecutive blocks under one checkpoint that only keeps the first block's inputs.

    The blocks are still called one by one by the model's (or the pipeline stage's) loop, with
    their module hooks (ZeRO-3's gathers): the first block's forward opens torch's non-reentrant
    checkpoint region and the last one's closes it, so every tensor saved in between is dropped
    and made again in backward by `rerun`, which calls the same modules on the kept input.

    rerun_peak_bytes: the most bytes one rerun saved for the segment's backward (each storage
    once, parameters not counted, the kept input included when the rerun saves it): what the
    recomputation adds to what the forward kept, at most, while its backward runs."""

    def __init__(self, blocks: Sequence[nn.Module], kept: KeptInputs | None = None):
        self.blocks = list(blocks)
        self.kept = kept
        self.forwards = [block.forward for block in self.blocks]
        self.region = None
        self.keeping: contextlib.AbstractContextManager = contextlib.nullcontext()
        self.rerunning = False
        self.rerun_peak_bytes = 0

    def rerun(self, x: torch.Tensor, rope, attend) -> None:
        # torch's recomputation hook packs what the rerun saves; counting passes each tensor on
        # to it, so the recomputation is unchanged.
        pack, unpack = torch._C._autograd._top_saved_tensors_default_hooks(False)
        saved: dict[int, int] = {}
        # Read now, not when the segment was made: ZeRO-3 moves the parameters into its flat
        # buffers after recomputation is applied.
        parameters = {storage_id(p) for block in self.blocks for p in block.parameters()}
        # --contiguous-buffers: the kept input is a slot of a buffer; the rerun saves the slot.
        slotted = (storage_id(self.kept.buffer) if self.kept and self.kept.buffer is not None
                   else None)

        def counted(tensor: torch.Tensor):
            key = storage_id(tensor)
            if key == slotted:
                saved[key] = tensor.numel() * tensor.element_size()
            elif key not in parameters:
                saved[key] = tensor.untyped_storage().nbytes()
            return pack(tensor)

        self.rerunning = True
        try:  # torch stops the rerun by an exception once the last saved tensor is made again
            with torch.autograd.graph.saved_tensors_hooks(counted, unpack):
                for block in self.blocks:
                    x = block(x, rope, attend)
        finally:
            self.rerunning = False
            self.rerun_peak_bytes = max(self.rerun_peak_bytes, sum(saved.values()))

    def forward(self, index: int, x: torch.Tensor, rope, attend) -> torch.Tensor:
        if self.rerunning or not torch.is_grad_enabled():
            return self.forwards[index](x, rope, attend)
        if index == 0:
            self.region = _checkpoint_without_reentrant_generator(
                self.rerun, True, *_DEFAULT_CHECKPOINT_FLAGS, x, rope, attend)
            # The checkpoint saves its inputs through the hooks below its own, which it pushes
            # here and pops when the region closes: the kept inputs' hooks go on before it and
            # come off after it (hooks are a stack).
            self.keeping = self.kept.keeping(x) if self.kept else contextlib.nullcontext()
            self.keeping.__enter__()
            next(self.region)
        out = self.forwards[index](x, rope, attend)
        if index == len(self.blocks) - 1:
            region, self.region = self.region, None
            next(region, None)
            self.keeping.__exit__(None, None, None)
        return out


class SegmentForward:
    """The forward installed on a segment's block (parameter names stay the plain model's)."""

    def __init__(self, segment: CheckpointedSegment, index: int):
        self.segment = segment
        self.index = index

    def __call__(self, x: torch.Tensor, rope, attend=None) -> torch.Tensor:
        return self.segment.forward(self.index, x, rope, attend)


# torch.utils.checkpoint's defaults after preserve_rng_state: context_fn, determinism_check,
# debug, early_stop.
_DEFAULT_CHECKPOINT_FLAGS = (torch.utils.checkpoint.noop_context_fn,
                             torch.utils.checkpoint._DEFAULT_DETERMINISM_MODE, False, True)


def apply_sqrt_segments(blocks: Sequence[nn.Module], kept: KeptInputs | None = None
                        ) -> list[CheckpointedSegment]:
    """--recompute sqrt on one stage's blocks, in the order its forward calls them."""
    segments, start = [], 0
    for size in sqrt_segments(len(blocks)):
        segment = CheckpointedSegment(blocks[start:start + size], kept)
        for index, block in enumerate(segment.blocks):
            block.forward = SegmentForward(segment, index)
        segments.append(segment)
        start += size
    return segments


def reruns_forward(module: nn.Module) -> bool:
    """Whether any block of `module` runs (part of) its forward again in backward: full, sqrt or
    selective recomputation is applied to it."""
    return any(isinstance(getattr(block, "forward", None), (RecomputedBlock, SegmentForward))
               or isinstance(getattr(getattr(block, "attn", None), "core", None),
                             RecomputedAttention)
               for block in module.modules())


def recompute_peak_bytes(model: nn.Module) -> int:
    """The most bytes one recomputed segment of `model` saved so far (0 without --recompute
    sqrt)."""
    return max((block.forward.segment.rerun_peak_bytes for block in model.modules()
                if isinstance(block.__dict__.get("forward"), SegmentForward)), default=0)


def host_activations_peak(model: nn.Module) -> int:
    """The most bytes of kept block inputs `model` held in host memory at once
    (--offload-activations; 0 without)."""
    return max((kept.host_peak_bytes for kept in _kept_inputs(model) if kept.offload),
               default=0)


def activation_buffer_peak(model: nn.Module) -> int:
    """The most bytes of --contiguous-buffers' checkpoint buffer `model` used at once (0
    without)."""
    return max((kept.buffer_peak_bytes for kept in _kept_inputs(model) if kept.contiguous),
               default=0)


def _kept_inputs(model: nn.Module) -> list[KeptInputs]:
    found = {}
    for block in model.modules():
        forward = block.__dict__.get("forward")
        kept = (forward.segment.kept if isinstance(forward, SegmentForward)
                else getattr(forward, "kept", None))
        if kept is not None:
            found[id(kept)] = kept
    return list(found.values())


def apply_recompute(model: Transformer, mode: str,
                    stages: Sequence[Sequence[int]] | None = None,
                    kept: KeptInputs | None = None) -> None:
    """Recompute `mode` on every block of `model`; `stages`: the layer indices of each pipeline
    stage this rank runs (sqrt cuts each into its own segments; default one stage of every
    layer). Apply after context parallelism (selective recognizes ring attention), after expert
    parallelism and after compilation (full wraps the compiled forward); losses and gradients
    are unchanged. `kept`: where full and sqrt keep each checkpoint's input (ZeRO-R's
    partitioned and offloaded checkpoints; None: whole, on the device)."""
    if mode not in MODES:
        raise ConfigError(f"--recompute must be one of {', '.join(MODES)}, got {mode!r}")
    stages = stages if stages is not None else [range(len(model.layers))]
    if kept is not None and kept.contiguous:  # slots for the microbatches in flight
        kept.size_slots([len(sqrt_segments(len(layers))) if mode == "sqrt" else len(layers)
                         for layers in stages])
    if mode == "sqrt":
        for layers in stages:
            apply_sqrt_segments([model.layers[layer] for layer in layers], kept)
        return
    for block in model.layers:
        if mode == "full":
            block.forward = RecomputedBlock(block.forward, kept)
        elif mode == "selective" and not isinstance(block.attn.core, RingAttention):
            block.attn.core = RecomputedAttention(block.attn.core)
