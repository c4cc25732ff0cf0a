"""One executor for every pipeline schedule: it walks this rank's action list from
tetrad.schedules in order and knows nothing of which schedule made it (docs/pipeline.md):

    RECV_*  irecv into a fresh buffer; the compute that reads the tensor waits on the handle
    SEND_*  isend; every send is waited on before the step ends
    F       forward of one (stage, microbatch); the last stage adds the loss / microbatches
    B       the full backward; with a split backward (zero bubble) only the gradient of the
            stage input, by autograd.grad with the graph retained for W
    W       the deferred weight gradient, from the gradients B captured where the weights join
            the input's path (split_backward.py), accumulated into .grad by autograd (so a
            data-parallel engine's post-accumulate-grad hooks see it, as after a whole backward)

Every send and receive goes through Comm, so the bytes count as p2p under the "activations" tag.

A data-parallel engine that reduces gradients every microbatch (ZeRO-2/3) sets
`after_stage_backward`: called with the stage once a stage's weight gradients of one microbatch
are complete (after B, or after W when the backward is split). It then also sums its shards of a
tied embedding's gradient itself (`sum_tied_gradient` off); otherwise the step ends by summing
the whole gradients of the two copies.

The split backward computes each activation gradient once (B prunes the weights' products, W
runs only those), but it walks the graph in Python to find where weights join and runs one
backward per weight group. So where a W comes next after its own B in the list (receives and
sends aside), B runs the whole backward at once and W only marks the gradients complete, unless
the B's gradient is sent before that W to a B that would wait for it (ZB-V's steady state, not
DualPipeV's): then B splits, and the peer gets the gradient a W earlier (`whole_backwards`).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Callable, ContextManager, Sequence

import torch
from torch import nn

from tetrad.errors import ConfigError
from tetrad.memory import ActivationMeter
from tetrad.models.transformer import Transformer
from tetrad.parallel.comm import Comm
from tetrad.parallel.mesh import Group, Mesh
from tetrad.planner.partition import Partition, partition
from tetrad.parallel.pipeline.split_backward import DeferredWeights, input_gradient
from tetrad.parallel.recompute import reruns_forward
from tetrad.parallel.pipeline.stage import PipelineStage, build_stages, embedding_group
from tetrad.schedules import Action, Schedule, build_schedule
from tetrad.schedules.simulate import whole_backwards
from tetrad.spec.runtime_rules import rank_stages

ACTIVATION_TAG = "activations"


@dataclass
class StepStats:
    """What one pipeline step measured on this rank."""

    loss: float  # mean loss over the global batch, the same number on every rank
    aux_loss: float | None  # MoE load-balance loss summed over all stages (None when dense)
    p2p_bytes: int  # activations and input gradients this rank sent
    compute_s: float  # inside F, B and W (loss included)
    wait_s: float  # blocked on receives, and on the sends at the end of the step
    step_s: float
    peak_activation_bytes: int  # saved for backward, every in-flight microbatch at once
    peak_in_flight: int  # most (stage, microbatch) pairs holding activations at once
    # (kind, stage, microbatch, start, end) by time.perf_counter (one clock for every process
    # of a machine): each action ("BW": a split B that ran the whole backward), "WAIT_F" /
    # "WAIT_B" for a compute blocked on its received input, and "STEP" around them all.
    events: tuple[tuple[str, int, int, float, float], ...] = ()

    @property
    def idle_fraction(self) -> float:
        """Share of the step this rank was not computing: the measured bubble (waits plus
        communication bookkeeping), next to the simulator's prediction."""
        return max(0.0, 1.0 - self.compute_s / self.step_s) if self.step_s > 0 else 0.0


def whole_sequences(window: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A microbatch window [batch, seq + 1] -> inputs and targets [batch, seq], positions [seq].
    Copies, not views of the batch: what a microbatch saves for backward (its ids, its targets)
    is then its own memory, as a received activation is, freed with it."""
    positions = torch.arange(window.shape[1] - 1, device=window.device)
    return window[:, :-1].clone(), window[:, 1:].clone(), positions


@dataclass
class _Step:
    """Tensors of one step in flight, keyed by (stage, microbatch) or (direction, stage, mb)."""

    microbatches: list[tuple[torch.Tensor, ...]]  # inputs, targets [mb_batch, seq]; positions
    activation_shape: tuple[int, int, int]  # [mb_batch, seq, hidden]: every tensor on the wire
    loss_scale: float
    loss: torch.Tensor
    aux: torch.Tensor
    inputs: dict = field(default_factory=dict)  # stage input (a leaf that collects its gradient)
    roots: dict = field(default_factory=dict)  # (output or None, scalar objective or None)
    deferred: dict = field(default_factory=dict)  # (outputs, grads) kept for W
    outgoing: dict = field(default_factory=dict)  # tensors made, waiting for their SEND
    incoming: dict = field(default_factory=dict)  # (buffer, handle) posted, waiting for compute
    sends: list = field(default_factory=list)  # (tensor, handle): the tensor lives until sent


class PipelineExecutor:
    """This rank's stages of a pipeline, and the one loop that runs any schedule over them."""

    def __init__(self, stages: dict[int, PipelineStage], schedule: Schedule, pp_group: Group,
                 comm: Comm, embedding_group: Group | None = None,
                 partition: Partition | None = None,
                 autocast: Callable[[], ContextManager] = contextlib.nullcontext,
                 shard: Callable[[torch.Tensor], tuple[torch.Tensor, ...]] = whole_sequences):
        if pp_group.size != schedule.pp:
            raise ConfigError(f"the schedule is for pp={schedule.pp} but the pipeline group has "
                              f"{pp_group.size} ranks: build the schedule with pp={pp_group.size}")
        owned = set(rank_stages(pp_group.index, schedule.num_stages, schedule.pp,
                                schedule.v_shape))
        assert set(stages) == owned, (sorted(stages), sorted(owned))
        self.stages, self.schedule, self.group, self.comm = stages, schedule, pp_group, comm
        self.embedding_group, self.partition, self.autocast = embedding_group, partition, autocast
        self.shard = shard
        self.actions = schedule.actions[pp_group.index]
        self.whole_backwards = {(a.stage, a.microbatch) for a in whole_backwards(schedule)}
        self.module = nn.ModuleList(stages[s] for s in sorted(stages))
        self.rerunning_stages = {index for index, stage in stages.items()
                                 if reruns_forward(stage)}
        self.config = self.module[0].config
        self.device = next(self.module.parameters()).device
        self.tied_weight = None
        if embedding_group is not None:
            holder = stages[0] if 0 in stages else stages[schedule.num_stages - 1]
            self.tied_weight = holder.embed.weight
        self.after_stage_backward: Callable[[int], None] | None = None
        self.sum_tied_gradient = True
        self._run = {"F": self._forward, "B": self._backward, "W": self._weight,
                     "SEND_F": self._send, "SEND_B": self._send,
                     "RECV_F": self._recv, "RECV_B": self._recv}

    @classmethod
    def from_model(cls, model: Transformer, mesh: Mesh, comm: Comm, schedule: str = "1f1b",
                   microbatches: int = 0, vpp: int = 1, stage_layers: Sequence[int] | None = None,
                   seq_len: int | None = None,
                   autocast: Callable[[], ContextManager] = contextlib.nullcontext,
                   shard: Callable[[torch.Tensor], tuple[torch.Tensor, ...]] = whole_sequences,
                   cut: Partition | None = None) -> "PipelineExecutor":
        """Cut `model` (built with the same seed on every rank; a Transformer, or its tensor-
        parallel version) into mesh.dims.pp * vpp stages and keep this rank's. Collective over
        the world when embeddings are tied (it creates the embedding groups). microbatches 0
        means pp; seq_len (for balancing) defaults to the model's max_seq_len. `shard` turns a
        microbatch window into (inputs, targets, positions): ContextParallel.shard under context
        parallelism. `cut`, when the caller has it, replaces `stage_layers`."""
        pp = mesh.dims.pp
        plan = build_schedule(schedule, pp, microbatches or pp, vpp)
        cut = cut or partition(model.config, pp * vpp, seq_len, stage_layers)
        tied = (embedding_group(mesh.dims, mesh.rank)
                if model.config.tie_embeddings and pp > 1 and not plan.v_shape else None)
        return cls(build_stages(model, cut, pp, mesh.coords["pp"], plan.v_shape), plan,
                   mesh["pp"], comm, tied, cut, autocast, shard)

    # The step -------------------------------------------------------------------------------

    def step(self, tokens: torch.Tensor, loss_scale: float = 1.0,
             last_of_step: bool = True) -> StepStats:
        """Forward and backward of the global batch `tokens` [batch, seq_len + 1] (inputs and
        their next-token targets; every rank passes the same batch, the first and last stages
        read it). Gradients accumulate into .grad of this rank's parameters, a tied embedding's
        summed over its two ranks once `last_of_step` (gradient accumulation runs several
        pipeline steps per optimizer step: summing after each would count the earlier ones
        again); the caller runs the optimizer. `loss_scale` multiplies the objective before
        backward (fp16 loss scaling); the reported loss is unscaled."""
        num_microbatches = self.schedule.microbatches
        if tokens.shape[0] % num_microbatches:
            raise ConfigError(f"a batch of {tokens.shape[0]} sequences does not split into "
                              f"{num_microbatches} equal microbatches: make the batch size a "
                              f"multiple of {num_microbatches} or change --microbatches")
        started = self._clock()
        self._compute_s = self._wait_s = 0.0
        self._events = []
        self._sent_bytes = self._in_flight = self._peak_in_flight = 0
        # Built per step: a data-parallel engine (ZeRO) may have moved the parameters into flat
        # buffers of another dtype since construction, and the meter must know their storages.
        self.meter = ActivationMeter(self.module)
        self.dtype = next(self.module.parameters()).dtype  # what travels between stages
        tokens = tokens.to(self.device)
        zero = torch.zeros((), device=self.device)
        microbatches = [self.shard(window) for window in tokens.chunk(num_microbatches)]
        inputs = microbatches[0][0]
        state = _Step(microbatches,
                      (inputs.shape[0], inputs.shape[1] // self.module[0].sequence_shards,
                       self.config.hidden_size), loss_scale, zero, zero.clone())
        for action in self.actions:
            began = self._clock()
            self._run[action.kind](action, state)
            kind = ("BW" if action.kind == "B" and (action.stage, action.microbatch)
                    in self.whole_backwards else action.kind)
            self._events.append((kind, action.stage, action.microbatch, began, self._clock()))
        self._wait(*(handle for _, handle in state.sends))
        assert not (state.inputs or state.roots or state.deferred or state.outgoing
                    or state.incoming), "the schedule left work undone"
        if self.tied_weight is not None and self.sum_tied_gradient and last_of_step:
            self.comm.all_reduce(self.tied_weight.grad, self.embedding_group, "grads")
        # The loss lives on the last stage, load-balance losses on every stage: one sum gives
        # every rank both.
        metrics = torch.stack([state.loss, state.aux])
        self.comm.all_reduce(metrics, self.group, "metrics")
        loss, aux = metrics.tolist()
        ended = self._clock()
        self._events.append(("STEP", -1, -1, started, ended))
        return StepStats(loss, aux if self.config.is_moe else None, self._sent_bytes,
                         self._compute_s, self._wait_s, ended - started,
                         self.meter.peak_bytes, self._peak_in_flight, tuple(self._events))

    def _forward(self, action: Action, state: _Step) -> None:
        key = (action.stage, action.microbatch)
        stage = self.stages[action.stage]
        inputs, targets, positions = state.microbatches[action.microbatch]
        x = inputs if stage.is_first else self._received(state, "F", key)
        if not stage.is_first:
            x.requires_grad_()
            state.inputs[key] = x
        num_microbatches = len(state.microbatches)
        started = self._clock()
        with self.meter.measure(), self.autocast():
            out = stage(x, positions)
            objective = None
            if stage.is_last:
                objective = stage.loss(out, targets)
                state.loss += objective.detach() / num_microbatches
            aux = stage.aux_loss()
            if aux is not None:
                state.aux += aux.detach() / num_microbatches
                term = self.config.router_aux_loss_coef * aux
                objective = term if objective is None else objective + term
        if objective is not None:  # as the trainer: objective / microbatches, then the scale
            objective = objective / num_microbatches
            if state.loss_scale != 1.0:
                objective = objective * state.loss_scale
        state.roots[key] = (None if stage.is_last else out, objective)
        if not stage.is_last:
            state.outgoing["F", *key] = out.detach()
        self._compute_s += self._clock() - started
        self.meter.hold(key)
        self._in_flight += 1
        self._peak_in_flight = max(self._peak_in_flight, self._in_flight)

    def _backward(self, action: Action, state: _Step) -> None:
        key = (action.stage, action.microbatch)
        out, objective = state.roots.pop(key)
        outputs, grads = [], []
        if out is not None:
            outputs.append(out)
            grads.append(self._received(state, "B", key))
        if objective is not None:
            outputs.append(objective)
            grads.append(None)  # a scalar: d objective / d objective = 1
        x = state.inputs.get(key)  # None on the first stage: token ids have no gradient
        started = self._clock()
        whole = key in self.whole_backwards
        if not self.schedule.split_backward or whole:
            torch.autograd.backward(outputs, grads)
            state.inputs.pop(key, None)
            if whole:
                state.deferred[key] = None  # W marks the gradients complete
            else:
                self._release(key)
        elif x is not None and action.stage not in self.rerunning_stages:
            x.grad, state.deferred[key] = input_gradient(
                outputs, grads, x, self._trainable(action.stage))
            del state.inputs[key]
        else:
            # W walks down from the outputs: on the first stage B has no input gradient to
            # compute, and a recomputed block's weight halves need its forward again, which W
            # from the captured nodes would rerun once per weight group (B keeps the graph).
            if x is not None:
                (x.grad,) = torch.autograd.grad(outputs, [x], grads, retain_graph=True)
                del state.inputs[key]
            params = self._trainable(action.stage)
            state.deferred[key] = DeferredWeights([], outputs, grads, params, params)
        if x is not None:
            state.outgoing["B", *key] = x.grad
        self._compute_s += self._clock() - started
        if not self.schedule.split_backward:
            self._stage_gradients_done(action.stage)

    def _weight(self, action: Action, state: _Step) -> None:
        key = (action.stage, action.microbatch)
        deferred = state.deferred.pop(key)
        if deferred is not None:
            started = self._clock()
            deferred.run()
            self._compute_s += self._clock() - started
        self._release(key)
        self._stage_gradients_done(action.stage)

    def _trainable(self, stage: int) -> list[nn.Parameter]:
        return [p for p in self.stages[stage].parameters() if p.requires_grad]

    def _stage_gradients_done(self, stage: int) -> None:
        if self.after_stage_backward is not None:
            self.after_stage_backward(stage)

    def _send(self, action: Action, state: _Step) -> None:
        tensor = state.outgoing.pop((action.kind[-1], action.stage, action.microbatch))
        tensor = tensor.contiguous()
        assert tuple(tensor.shape) == state.activation_shape and tensor.dtype == self.dtype, (
            action, tensor.shape, tensor.dtype)  # the receiver's buffer has this shape and dtype
        state.sends.append((tensor, self.comm.send(tensor, action.peer, self.group,
                                                   ACTIVATION_TAG)))
        self._sent_bytes += tensor.numel() * tensor.element_size()

    def _recv(self, action: Action, state: _Step) -> None:
        buffer = torch.empty(state.activation_shape, dtype=self.dtype, device=self.device)
        state.incoming[action.kind[-1], action.stage, action.microbatch] = (
            buffer, self.comm.recv(buffer, action.peer, self.group))

    def _received(self, state: _Step, direction: str, key: tuple[int, int]) -> torch.Tensor:
        """The input of `key`'s compute: received from another rank, or, where the neighbouring
        stage lives on this rank too (the turn of a V), handed over in memory."""
        if (direction, *key) not in state.incoming:
            stage, microbatch = key
            producer = stage - 1 if direction == "F" else stage + 1
            return state.outgoing.pop((direction, producer, microbatch))
        buffer, handle = state.incoming.pop((direction, *key))
        began = self._clock()
        self._wait(handle)
        self._events.append(("WAIT_" + direction, *key, began, self._clock()))
        return buffer

    def _wait(self, *handles) -> None:
        started = self._clock()
        for handle in handles:
            handle.wait()
        self._wait_s += self._clock() - started

    def _clock(self) -> float:
        """Now, once the device has finished what was queued: CUDA kernels and NCCL waits return
        to the host before the work is done, so unsynchronized timings would count launches."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _release(self, key: tuple[int, int]) -> None:
        self.meter.release(key)
        self._in_flight -= 1

    # What a training strategy needs around the step ------------------------------------------

    def named_parameters(self) -> dict[str, nn.Parameter]:
        """By the full model's names: the ranks' dicts together are the single-process model's
        (the tied embedding appears on both of its ranks, equal)."""
        return {name: param for stage in self.module for name, param in stage.named_parameters()}
