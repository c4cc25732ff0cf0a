"""The training loop tests/test_zero.py runs every data-parallel engine through, and what it
records: losses, bytes held, the global gradient norm of every step, and the reduced gradients
each rank holds after the first step's reduction (before clipping), to compare with one process.

AdamW is nearly invariant to a constant gradient scale and clipping to 1 hides any larger one, so
losses and parameters cannot tell a gradient summed over the group from one averaged over it;
the norms and the reduced gradients themselves can. Hooks on gradients also show how many
reductions are already on the wire while backward runs (overlap)."""

from collections import namedtuple

import torch
import torch.nn.functional as F

from tetrad.spec.model import ParallelConfig, TrainConfig
from tetrad.models.transformer import Transformer
from tetrad.parallel.comm import Comm, CommCounter
from tetrad.parallel.zero_optimizer import scatter_state
from tetrad.spec.presets import resolve_model
from tetrad.train.strategy import MeshStrategy

STEPS, BATCH, SEQ, LR = 5, 8, 16, 3e-3
BUCKET_BYTES = 64 * 1024  # several buckets for the tiny model, so their order matters
CPU = torch.device("cpu")

Case = namedtuple("Case", "zero offload grad_accum dtype collectives",
                  defaults=(False, 1, "fp32", "backend"))
# A flat shard's layout and this rank's slice of its reduced fp32 gradient.
ReducedShard = namedtuple("ReducedShard", "names numels offsets shard_range grad")


def tiny_model() -> Transformer:
    torch.manual_seed(0)
    return Transformer(resolve_model("tiny"))


def token_batches() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, 256, (BATCH, SEQ + 1), generator=generator) for _ in range(STEPS)]


def train_config(case: Case, dp: int = 1) -> TrainConfig:
    return TrainConfig(model="tiny", batch_size=BATCH, seq_len=SEQ, lr=LR,
                       grad_accum=case.grad_accum, dtype=case.dtype, parallel=ParallelConfig(
                           dp=dp, zero=case.zero, offload=case.offload,
                           collectives=case.collectives))


def reduced_gradients(strategy) -> dict | list[ReducedShard]:
    """What the optimizer of this rank will read: every parameter's whole gradient by name
    (one process, DDP), or the slice of each flat shard it owns (ZeRO-1/2/3)."""
    shards = getattr(getattr(strategy, "engine", None), "shards", None)
    if shards is None:
        return {name: p.grad.detach().clone() for name, p in strategy.model.named_parameters()}
    return [ReducedShard(shard.names, [p.numel() for p in shard.params], shard.offsets,
                         shard.shard_range, shard.main_grad.detach().clone())
            for shard in shards]


def expected_shard(shard: ReducedShard, whole: dict[str, torch.Tensor]) -> torch.Tensor:
    """The slice of one process's gradients `whole` that `shard` must hold."""
    layout = namedtuple("Layout", "names params offsets shard_range")(
        shard.names, [torch.empty(n, device="meta") for n in shard.numels], shard.offsets,
        shard.shard_range)
    target = torch.empty_like(shard.grad)
    scatter_state(layout, whole, target)
    return target


def train_steps(strategy, grad_accum: int) -> dict:
    """The trainer's step, on random tokens: microbatches, sync, clip, step; the loss is the
    global-batch mean. Bytes held are the most seen after the sync and after the step."""
    run = {"losses": [], "held": {}, "norms": [], "reduced": None}
    for batch in token_batches():
        microbatches = strategy.local_batch(batch).chunk(grad_accum)
        total = 0.0
        for index, microbatch in enumerate(microbatches):
            with strategy.autocast():
                logits = strategy.model(microbatch[:, :-1])
                loss = F.cross_entropy(logits.float().flatten(0, 1), microbatch[:, 1:].flatten())
            strategy.backward(loss / grad_accum, index == grad_accum - 1)
            total += loss.item() / grad_accum
        strategy.finish_gradients()
        if run["reduced"] is None:
            run["reduced"] = reduced_gradients(strategy)
        run["held"] = {k: max(v, run["held"].get(k, 0)) for k, v in strategy.bytes_held().items()}
        run["norms"].append(strategy.clip_grad_norm(1.0))
        strategy.step(LR)
        run["held"] = {k: max(v, run["held"].get(k, 0)) for k, v in strategy.bytes_held().items()}
        run["losses"].append(strategy.global_mean(total))
    return run


def distributed_strategy(case: Case, mesh, counter: CommCounter, model=None):
    model = model or tiny_model()
    return MeshStrategy(model, train_config(case, mesh.dims.dp), CPU, mesh,
                        Comm(counter, case.collectives), bucket_bytes=BUCKET_BYTES)


def launches_seen(strategy, params) -> list[int]:
    """Registers hooks that record, each time one of `params` gets its gradient, how many
    reductions of the step are on the wire (call before training)."""
    seen = []
    for param in params:
        param.register_post_accumulate_grad_hook(
            lambda p: seen.append(len(strategy.engine.handles)))
    return seen


def first_layer_launches(case: Case, mesh) -> list[int]:
    """Reductions on the wire when layer 0's first gradient of each microbatch arrives, for the
    first step: the buckets of the layers after it are complete by then and should be sent while
    backward still has layer 0 and the embedding to run."""
    strategy = distributed_strategy(case, mesh, CommCounter())
    layer0 = list(strategy.model.layers[0].parameters())
    seen = launches_seen(strategy, layer0)
    train_steps(strategy, case.grad_accum)
    return seen[:case.grad_accum * len(layer0):len(layer0)]


def whole_parameters(strategy) -> dict[str, torch.Tensor]:
    """The trained model's whole tensors by name (collective: every rank assembles them)."""
    return {name: tensor.detach().cpu().clone()
            for name, tensor in strategy.whole_model().state_dict().items()}


def check_reduced(case: Case, rank: int, reduced, whole: dict[str, torch.Tensor]) -> None:
    """A rank's reduced gradients of the first step equal one process's (fp32)."""
    if isinstance(reduced, dict):
        assert set(reduced) == set(whole), (case, rank)
        for name, grad in reduced.items():
            torch.testing.assert_close(grad, whole[name], rtol=1e-4, atol=1e-7,
                                       msg=lambda m: f"{case} rank {rank} {name}: {m}")
        return
    owned = 0
    for shard in reduced:
        lo, hi = shard.shard_range
        assert shard.grad.shape == (hi - lo,), (case, rank)
        torch.testing.assert_close(shard.grad, expected_shard(shard, whole), rtol=1e-4,
                                   atol=1e-7, msg=lambda m: f"{case} rank {rank}: {m}")
        owned += int(shard.grad.count_nonzero())
    assert owned > 0, (case, rank)  # the comparison saw real gradients, not empty slices
