"""DDP (ZeRO-0) and ZeRO-1/2/3, with offload and gradient accumulation, on 2 and 4 gloo ranks,
against the single-process run on the same global batches: losses, final parameters, every
step's gradient norm and each rank's reduced gradients (tests/zero_harness.py says why), bytes
held (counted from the tensors each rank owns) and bytes sent per step, against the formulas;
ZeRO-2/3 under a pipeline too (the formulas of the rank's stages, per pipeline microbatch).
Torch's own DDP and FSDP2 (fully_shard) run the same steps side by side.

Each world size is one spawned job running every case in turn (starting processes is the slow
part on a 2-core machine).
"""

from fractions import Fraction

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from dist import run_ranks
from reference import whole_gradient_step
from zero_harness import (BATCH, BUCKET_BYTES, CPU, LR, SEQ, Case, check_reduced,
                          distributed_strategy, first_layer_launches, launches_seen, tiny_model,
                          token_batches, train_config, train_steps, whole_parameters)

from tetrad.spec.model import ParallelConfig, TrainConfig
from tetrad.models.transformer import Transformer
from tetrad.parallel.comm import OFF_STEP_TAGS, Comm, CommCounter
from tetrad.parallel.data_parallel import LaunchInOrder, bucket_params
from tetrad.parallel.fsdp import SHARDED
from tetrad.parallel.mesh import Group, build_mesh
from tetrad.parallel.zero_optimizer import FlatShard, scatter_state
from tetrad.spec.presets import resolve_model
from tetrad.sharded_tensors import LazyMapping
from tetrad.train.optim import build_optimizer, parameter_groups
from tetrad.train.strategy import LocalStrategy, MeshStrategy

CASES_2 = [Case(0), Case(1), Case(2), Case(3), Case(0, grad_accum=2), Case(1, True, 2),
           Case(2, True, 2), Case(3, True, 2), Case(3, grad_accum=2), Case(0, collectives="ring"),
           Case(3, collectives="ring"), Case(3, dtype="bf16"), Case(2, dtype="fp16")]
CASES_4 = [Case(0, grad_accum=2), Case(1), Case(2, grad_accum=2), Case(3), Case(1, True),
           Case(3, True, 2)]
# (ZeRO stage, schedule) over pp2 x dp2, the batch in MICROBATCHES pipeline microbatches.
PIPELINED = [(2, "1f1b"), (3, "1f1b"), (3, "zb")]
MICROBATCHES = 4


def run_case(case: Case, mesh, rank: int) -> dict:
    counter = CommCounter()
    strategy = distributed_strategy(case, mesh, counter)
    run = train_steps(strategy, case.grad_accum)
    per_step = {tag: {kind: value / counter.steps for kind, value in
                      counter.totals((tag,)).items() if value}
                for tag in counter.tags() if tag not in OFF_STEP_TAGS}
    params = whole_parameters(strategy)
    return {**run, "comm": per_step, "params": params if rank == 0 else None}


def check_mechanisms(mesh) -> dict:
    """Overlap, no_sync, prefetch and resharding, seen from inside backward and forward."""
    found = {}
    ddp = distributed_strategy(Case(0, grad_accum=2), mesh, CommCounter())
    # embed.weight is registered first, so it sits in the last bucket and its gradient comes
    # last: when it is ready, every other bucket must already be on the wire.
    launched = launches_seen(ddp, [ddp.model.embed.weight])
    train_steps(ddp, 2)
    found["ddp_launched"] = launched[:2]
    found["ddp_buckets"] = len(ddp.engine.buckets)
    found["early"] = {zero: first_layer_launches(Case(zero, grad_accum=2), mesh)
                      for zero in (0, 1, 2)}

    fsdp = distributed_strategy(Case(3), mesh, CommCounter())
    units = fsdp.engine.units  # embedding, layer 0, layer 1, head
    seen = []
    fsdp.model.layers[0].register_forward_pre_hook(
        lambda module, args: seen.append((units[1].state, units[2].state)))
    fsdp.model.layers[0].register_forward_hook(
        lambda module, args, out: seen.append(units[1].full.untyped_storage().nbytes()))
    train_steps(fsdp, 1)
    found["fsdp_seen"] = seen[:2]
    found["unit_bytes"] = [u.full.numel() * u.full.element_size() for u in units]
    return found


def check_fp16_skip(mesh) -> dict:
    """An fp16 overflow skips the step on every rank and halves the loss scale."""
    strategy = distributed_strategy(Case(2, dtype="fp16"), mesh, CommCounter())
    engine = strategy.engine
    before = [s.master.clone() for s in engine.shards]
    engine.scaler.scale = 2.0 ** 120  # the scaled loss overflows fp16 gradients
    batch = strategy.local_batch(token_batches()[0])
    with strategy.autocast():
        logits = strategy.model(batch[:, :-1])
    strategy.backward(F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten()), True)
    strategy.finish_gradients()
    skipped = not strategy.step(LR)
    unchanged = all(torch.equal(a, s.master) for a, s in zip(before, engine.shards))
    return {"skipped": skipped, "unchanged": unchanged, "scale": engine.scaler.scale}


def uneven_expert_batches() -> list[torch.Tensor]:
    """Rank 1's half repeats one token: its tokens all go to the same experts, so the other
    experts get no gradient there while rank 0 uses them (ranks must still pair collectives)."""
    batches = token_batches()[:2]
    for batch in batches:
        batch[BATCH // 2:] = 7
    return batches


def check_uneven_experts(mesh) -> dict:
    losses = {}
    for zero in (0, 1, 2, 3):
        torch.manual_seed(0)
        case = Case(zero, grad_accum=2)
        strategy = distributed_strategy(case, mesh, CommCounter(),
                                        Transformer(resolve_model("tiny-moe")))
        losses[zero] = train_moe_steps(strategy)
    return losses


def train_moe_steps(strategy) -> list[float]:
    losses = []
    for batch in uneven_expert_batches():
        total = 0.0
        for index, microbatch in enumerate(strategy.local_batch(batch).chunk(2)):
            logits = strategy.model(microbatch[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1), microbatch[:, 1:].flatten())
            objective = loss + 0.01 * strategy.model.aux_loss()
            strategy.backward(objective / 2, index == 1)
            total += loss.item() / 2
        # The loss mean between the last backward and the reduction, as the trainer's loop has
        # it: a bucket one rank did not complete must be on the wire before this collective.
        losses.append(strategy.global_mean(total))
        strategy.finish_gradients()
        strategy.clip_grad_norm(1.0)
        strategy.step(LR)
    return losses


def torch_native(rank: int, world_size: int, kind: str) -> list[float]:
    """The same steps with torch.nn.parallel.DistributedDataParallel or FSDP2's fully_shard."""
    model = tiny_model()
    if kind == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    else:
        from torch.distributed.fsdp import fully_shard
        for layer in model.layers:
            fully_shard(layer)
        fully_shard(model)
    config = train_config(Case(0))
    optimizer = build_optimizer(parameter_groups(model, config.weight_decay), config)
    losses = []
    for batch in token_batches():
        rows = BATCH // world_size
        local = batch[rank * rows:(rank + 1) * rows]
        total = whole_gradient_step(model, optimizer, local, LR).detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world_size)
    return losses


def run_pipelined(zero: int, schedule: str, mesh) -> dict:
    """The trainer's steps with ZeRO-2/3 under a pipeline: losses, gradient norms, the most bytes
    held after the gradient reduction and after the step, bytes sent per step, and what the rank
    holds."""
    counter = CommCounter()
    parallel = ParallelConfig(dp=mesh.dims.dp, pp=mesh.dims.pp, zero=zero, schedule=schedule,
                              microbatches=MICROBATCHES)
    config = TrainConfig(model="tiny", batch_size=BATCH, seq_len=SEQ, lr=LR, parallel=parallel)
    strategy = MeshStrategy(tiny_model(), config, CPU, mesh, Comm(counter),
                            bucket_bytes=BUCKET_BYTES)
    losses, held, norms = [], {}, []
    for batch in token_batches():
        loss, _ = strategy.forward_backward(batch)
        strategy.finish_gradients()
        held = {k: max(v, held.get(k, 0)) for k, v in strategy.bytes_held().items()}
        norms.append(strategy.clip_grad_norm(1.0))
        strategy.step(LR)
        held = {k: max(v, held.get(k, 0)) for k, v in strategy.bytes_held().items()}
        losses.append(loss)
    comm = {tag: {kind: value / counter.steps for kind, value in counter.totals((tag,)).items()
                  if value} for tag in ("grads", "params")}
    return {"losses": losses, "norms": norms, "held": held, "comm": comm,
            "phi": sum(p.numel() for p in strategy.params.values()),
            "first_stage": 0 in strategy.parallel.pipeline.stages,
            "logs_loss": strategy.mesh["dp_cp"].index == 0}


def job(rank: int, world_size: int, cases: list[Case], extras: bool,
        pipelined: list[tuple[int, str]] = ()) -> dict:
    mesh = build_mesh(ParallelConfig(dp=world_size), rank, world_size)
    result = {"cases": [run_case(case, mesh, rank) for case in cases]}
    if pipelined:
        mesh = build_mesh(ParallelConfig(dp=2, pp=world_size // 2), rank, world_size)
        result["pipelined"] = [run_pipelined(zero, schedule, mesh)
                               for zero, schedule in pipelined]
    if extras:
        result["mechanisms"] = check_mechanisms(mesh)
        result["fp16"] = check_fp16_skip(mesh)
        result["moe"] = check_uneven_experts(mesh)
        result["torch"] = {kind: torch_native(rank, world_size, kind) for kind in ("ddp", "fsdp")}
    return result


@pytest.fixture(scope="module")
def references() -> dict:
    """Single-process runs, by (grad_accum, dtype)."""
    runs = {}
    for grad_accum, dtype in [(1, "fp32"), (2, "fp32"), (1, "bf16"), (1, "fp16")]:
        case = Case(0, grad_accum=grad_accum, dtype=dtype)
        strategy = LocalStrategy(tiny_model(), train_config(case), CPU)
        runs[grad_accum, dtype] = {**train_steps(strategy, grad_accum),
                                   "params": whole_parameters(strategy)}
    return runs


def expected_bytes(case: Case, n: int, phi: int, reference_held: dict) -> dict:
    """The ZeRO formulas for fp32 (4-byte parameters, gradients and moments)."""
    if case.zero == 0:
        return dict(reference_held)  # DDP holds exactly what the single process holds
    held = {"params": 4 * phi if case.zero < 3 else 4 * phi // n,
            "grads": 4 * phi if case.zero == 1 else 4 * phi // n,
            "optimizer": 8 * phi // n}  # two moments; the fp32 master is the parameter shard
    if case.offload:  # master + moments and an fp32 gradient copy, in host memory
        held.update(optimizer=0, host_optimizer=12 * phi // n, host_grads=4 * phi // n)
    return held


def expected_comm(case: Case, n: int, phi: int) -> dict:
    """Bytes per step by tag and kind: ring volumes of fp32 gradients / parameters."""
    share = Fraction((n - 1) * 4 * phi, n)
    if case.zero == 0:
        return {"grads": {"all_reduce": 2 * share}}
    if case.zero == 3:  # per microbatch: forward + backward all-gather, one reduce-scatter
        return {"grads": {"reduce_scatter": case.grad_accum * share},
                "params": {"all_gather": 2 * case.grad_accum * share}}
    reductions = case.grad_accum if case.zero == 2 else 1  # ZeRO-2 reduces every microbatch
    return {"grads": {"reduce_scatter": reductions * share}, "params": {"all_gather": share}}


def check_cases(cases: list[Case], results: list[dict], references: dict, n: int) -> None:
    phi = sum(p.numel() for p in tiny_model().parameters())
    assert phi % (4 * n) == 0  # no padding: the formulas hold to the byte
    for index, case in enumerate(cases):
        reference = references[case.grad_accum, case.dtype]
        rank0 = results[0]["cases"][index]
        if case.dtype != "fp32":  # mixed precision trains the same model, to its precision
            assert rank0["losses"] == pytest.approx(reference["losses"], rel=2e-2), case
            assert rank0["norms"] == pytest.approx(reference["norms"], rel=2e-2), case
            continue
        assert rank0["losses"] == pytest.approx(reference["losses"], rel=1e-5), case
        # Adam divides by sqrt(v): a weight whose gradients hover near zero turns rounding-level
        # differences into visible ones, so the tolerance is a small fraction of one step (LR).
        for name, value in reference["params"].items():
            torch.testing.assert_close(rank0["params"][name], value, rtol=1e-4, atol=LR / 30,
                                       msg=lambda m: f"{case} {name}: {m}")
        for rank, result in enumerate(results):
            # The global norm and the reduced gradients each rank's optimizer reads: averages
            # over the group, as one process computes them (sums would pass the checks above).
            run = result["cases"][index]
            assert run["norms"] == pytest.approx(reference["norms"], rel=1e-5), (case, rank)
            check_reduced(case, rank, run["reduced"], reference["reduced"])
            held = dict(result["cases"][index]["held"])
            gathered_peak = held.pop("params_gathered_peak", None)
            assert held == expected_bytes(case, n, phi, reference["held"]), (case, rank)
            if case.zero == 3:  # a layer and the prefetched next one at most
                assert 0 < gathered_peak <= 2 * 4 * max(phi_units(), key=int), (case, rank)
            comm = result["cases"][index]["comm"]
            theory = expected_comm(case, n, phi)
            assert {tag: comm[tag] for tag in theory} == theory, (case, rank)
            # Besides gradients and parameters only scalars move (loss mean, gradient norm).
            others = sum(sum(v.values()) for tag, v in comm.items() if tag not in theory)
            assert others <= 32, (case, rank, comm)


def phi_units() -> list[int]:
    """Parameters per ZeRO-3 unit of the tiny model: embedding, each layer, norm + head."""
    model = tiny_model()
    count = lambda *modules: sum(p.numel() for m in modules for p in m.parameters())  # noqa
    return [count(model.embed), *(count(layer) for layer in model.layers),
            count(model.norm, model.lm_head)]


def test_two_ranks(references):
    results = run_ranks(job, 2, CASES_2, True)
    check_cases(CASES_2, results, references, 2)
    for result in results:
        # Overlap: the last bucket's gradient arrives with every other bucket already launched;
        # a no_sync microbatch launches nothing.
        mechanisms = result["mechanisms"]
        assert mechanisms["ddp_buckets"] > 2
        assert mechanisms["ddp_launched"] == [0, mechanisms["ddp_buckets"]]
        # Overlap proper, at layer 0's first gradient: DDP and ZeRO-1 reduce on the last
        # microbatch only, ZeRO-2 on every one.
        early = mechanisms["early"]
        assert early[0][0] == 0 and 0 < early[0][1] < mechanisms["ddp_buckets"]
        assert early[1][0] == 0 and early[1][1] > 0
        assert early[2][0] > 0 and early[2][1] > 0
        # Before layer 0 runs, layer 1 is already being gathered (prefetch), layer 0 is whole;
        # right after it ran, layer 0's storage is gone.
        assert mechanisms["fsdp_seen"][0][0] != SHARDED and mechanisms["fsdp_seen"][0][1] != SHARDED
        assert mechanisms["fsdp_seen"][1] == 0
        assert mechanisms["unit_bytes"] == [4 * count for count in phi_units()]
        assert result["fp16"] == {"skipped": True, "unchanged": True, "scale": 2.0 ** 119}
        for kind in ("ddp", "fsdp"):
            assert result["torch"][kind] == pytest.approx(references[1, "fp32"]["losses"],
                                                          rel=1e-5), kind
    # Experts unused on one rank only: no hang, and the single-process numbers. The first loss
    # is exact; afterwards top-k routing can flip on rounding-level differences, hence 1e-4.
    torch.manual_seed(0)
    local = LocalStrategy(Transformer(resolve_model("tiny-moe")),
                          train_config(Case(0, grad_accum=2)), CPU)
    single = train_moe_steps(local)
    for zero, losses in results[0]["moe"].items():
        assert losses[0] == pytest.approx(single[0], rel=1e-6), zero
        assert losses == pytest.approx(single, rel=1e-4), zero


def test_four_ranks(references):
    results = run_ranks(job, 4, CASES_4, False, PIPELINED)
    check_cases(CASES_4, results, references, 4)
    assert sum(run["logs_loss"] for result in results for run in result["pipelined"]) == \
        2 * len(PIPELINED)  # one logging rank per pipeline stage
    # ZeRO-2/3 over pp2 x dp2 keep their memory per rank (Phi: the parameters of its stages) and
    # reduce every pipeline microbatch; a split backward (zb) gathers the units once more for W,
    # except on the first stage, whose B computes nothing.
    n, m = 2, MICROBATCHES
    for rank, result in enumerate(results):
        for (zero, schedule), run in zip(PIPELINED, result["pipelined"]):
            name, phi = (zero, schedule, rank), run["phi"]
            # The logged loss is reduced to the first rank of each dp group (the one that logs):
            # the others keep their own share's.
            if run["logs_loss"]:
                assert run["losses"] == pytest.approx(references[1, "fp32"]["losses"],
                                                      rel=1e-5), name
            assert run["norms"] == pytest.approx(references[1, "fp32"]["norms"], rel=1e-5), name
            held = dict(run["held"])
            assert (held.pop("params_gathered_peak", None) is not None) == (zero == 3), name
            assert held == {"params": 4 * phi // (n if zero == 3 else 1), "grads": 4 * phi // n,
                            "optimizer": 8 * phi // n}, name
            share = Fraction((n - 1) * 4 * phi, n)
            gathers = 1 if zero == 2 else 2 if schedule == "1f1b" or run["first_stage"] else 3
            params = gathers * share * (1 if zero == 2 else m)
            assert run["comm"] == {"grads": {"reduce_scatter": m * share},
                                   "params": {"all_gather": params}}, name


def test_a_shard_loads_only_the_parameters_its_range_overlaps():
    """Resuming reads a checkpoint tensor by tensor: rank 1 of 2 owns elements 7..13 of a flat
    buffer of a [4] (0..3), b [2, 2] (4..7) and c [5] (8..12; 13 pads it to 14), so it looks up b
    and c only, and gets exactly its elements, the padding zero."""
    params = [torch.nn.Parameter(torch.zeros(shape)) for shape in ((4,), (2, 2), (5,))]
    shard = FlatShard.build([(name, 0.0, p) for name, p in zip("abc", params)],
                            Group("dp", (0, 1), 1))
    whole = {"a": torch.arange(4.0), "b": torch.arange(4.0, 8.0).view(2, 2),
             "c": torch.arange(8.0, 13.0)}
    looked_up = []
    target = torch.full((shard.shard_numel,), -1.0)
    scatter_state(shard, LazyMapping("abc", lambda name: looked_up.append(name) or whole[name]),
                  target)
    assert looked_up == ["b", "c"]
    assert target.tolist() == [7.0, 8.0, 9.0, 10.0, 11.0, 12.0, 0.0]


def test_buckets_follow_backward_order_and_close_once_they_reach_their_size():
    """Reverse registration order (backward's), a bucket closed by the parameter that brings it
    to its limit, the first bucket's limit its own."""
    params = [torch.nn.Parameter(torch.zeros(25)) for _ in range(10)]  # 100 bytes each
    buckets = bucket_params(params, bucket_bytes=300, first_bucket_bytes=200)
    position = {id(p): index for index, p in enumerate(params)}
    assert [[position[id(p)] for p in bucket] for bucket in buckets] == [
        [9, 8], [7, 6, 5], [4, 3, 2], [1, 0]]


def test_buckets_launch_in_order_as_soon_as_they_and_all_before_them_are_complete():
    launched = []
    order = LaunchInOrder([1, 2, 1], launched.append)
    for bucket in (2, 1, 1):  # complete, but bucket 0 has not started: ranks must agree
        order.arrived(bucket)
    assert launched == []
    order.arrived(0)
    assert launched == [0, 1, 2]
    order.finish()  # the next backward counts afresh
    order.arrived(0)
    order.arrived(1)
    assert launched == [0, 1, 2, 0]
    order.flush()  # bucket 1 never completed (an unused parameter): started anyway, in order
    assert launched == [0, 1, 2, 0, 1, 2]
