"""Pipeline parallelism against single-process training of the same model on the same batches.

The reference is a plain loop here (fp32, AdamW, gradient clipping). Two spawns carry every
distributed check: pp=2 (every schedule; untied llama-style, tied GPT-2-style and MoE models;
the same stages under torch.distributed.pipelining) and pp=4 (every schedule). Per case: losses,
gradient norms and final parameters match the reference; p2p bytes counted by Comm equal the
activation sizes the schedule's SEND actions imply; the activation bytes held at the peak equal
the schedule's in-flight count times what one microbatch saves, measured on its own.
"""

import itertools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from dist import run_ranks
from reference import clip_grad_norm, seeded_model, spread, token_batch, train_reference

from tetrad.spec.model import ModelConfig, ParallelConfig
from tetrad.errors import ConfigError
from tetrad.memory import ActivationMeter
from tetrad.models.transformer import Transformer
from tetrad.parallel.comm import Comm, CommCounter
from tetrad.parallel.mesh import Group, build_mesh
from tetrad.parallel.pipeline import (PipelineExecutor, build_stages, partition,
                                      piece_costs)
from tetrad.schedules import build_schedule, peak_in_flight

LLAMA = ModelConfig(name="pp-llama", vocab_size=64, hidden_size=32, num_layers=8, num_heads=4,
                    num_kv_heads=2, ffn_hidden_size=64, max_seq_len=16)
# GPT-2's layout without its biases: the key bias has an exactly zero gradient (softmax ignores a
# constant added to every key's score), so it only ever sees rounding noise, which AdamW's
# normalization turns into full-size steps that no two summation orders agree on.
GPT2 = LLAMA.replace(name="pp-gpt2", norm="layernorm", position="learned", mlp="gelu",
                     tie_embeddings=True, num_kv_heads=4)
MOE = LLAMA.replace(name="pp-moe", num_experts=4, num_experts_per_token=2)
MODELS = {"llama": LLAMA, "gpt2": GPT2, "moe": MOE}
BATCH, SEQ, STEPS, SEED = 8, 12, 5, 0
LR, WEIGHT_DECAY, MAX_NORM = 1e-3, 0.1, 0.5

# (model, schedule, vpp, microbatches, stage_layers)
PP2_CASES = [("llama", "naive", 1, 2, None), ("llama", "gpipe", 1, 4, None),
             ("llama", "1f1b", 1, 4, None), ("llama", "zb", 1, 4, None),
             ("llama", "interleaved", 2, 4, None), ("gpt2", "1f1b", 1, 4, None),
             ("gpt2", "zb", 1, 8, None), ("gpt2", "interleaved", 2, 2, None),
             ("moe", "1f1b", 1, 4, None), ("moe", "zb", 1, 4, None)]
PP4_CASES = [("llama", "naive", 1, 4, None), ("llama", "gpipe", 1, 8, None),
             ("llama", "1f1b", 1, 8, [3, 1, 2, 2]), ("llama", "zb", 1, 8, None),
             ("llama", "interleaved", 2, 4, None), ("gpt2", "gpipe", 1, 4, None),
             ("gpt2", "1f1b", 1, 4, None), ("gpt2", "zb", 1, 4, None),
             ("gpt2", "interleaved", 2, 8, None)]
TORCH_SCHEDULES = ("ScheduleGPipe", "Schedule1F1B")


def batch(step: int) -> torch.Tensor:
    return token_batch(LLAMA.vocab_size, BATCH, SEQ, step)


def build_model(config: ModelConfig) -> Transformer:
    return seeded_model(config, SEED)


def reference(config: ModelConfig, microbatches: int) -> dict:
    """Single-process training on the same global batch: one big batch for a dense model; MoE's
    load-balance loss is defined per microbatch (as under the trainer's --grad-accum), so MoE
    accumulates over the pipeline's microbatches."""
    return train_reference(build_model(config), batch, STEPS, microbatches, LR, WEIGHT_DECAY,
                           MAX_NORM)


def one_microbatch_bytes(executor: PipelineExecutor, stage_index: int, microbatches: int) -> int:
    """What one microbatch's forward (and loss) saves on a stage, measured on its own."""
    stage = executor.stages[stage_index]
    size = BATCH // microbatches
    meter = ActivationMeter(stage)
    if stage.is_first:
        x = torch.randint(stage.config.vocab_size, (size, SEQ))
    else:
        x = torch.randn(size, SEQ, stage.config.hidden_size, requires_grad=True)
    with meter.measure():
        out = stage(x)
        if stage.is_last:
            F.cross_entropy(out.flatten(0, 1), torch.randint(stage.config.vocab_size,
                                                             (size * SEQ,)))
    return meter.finish_microbatch()


def train_pipeline(rank: int, mesh, case: tuple) -> dict:
    name, schedule, vpp, microbatches, stage_layers = case
    counter = CommCounter()
    parallel = spread(build_model(MODELS[name]), mesh, Comm(counter), ParallelConfig(
        pp=mesh.dims.pp, schedule=schedule, microbatches=microbatches, vpp=vpp,
        stage_layers=stage_layers or ()), SEQ)
    executor = parallel.pipeline
    optimizer = torch.optim.AdamW(parallel.params.values(), lr=LR, weight_decay=WEIGHT_DECAY)
    stats, norms = [], []
    for step in range(STEPS):
        stats.append(executor.step(batch(step)))
        parallel.reduce_gradients()
        norms.append(clip_grad_norm(parallel, MAX_NORM))
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)  # in place: DDP's gradients are bucket views
    return {"stats": stats, "norms": norms,
            "params": {k: p.detach().clone() for k, p in parallel.params.items()},
            "p2p": int(counter.totals(("activations",))["p2p"]),
            "p2p_all_tags": int(counter.totals()["p2p"]),
            "tied_all_reduce": int(counter.totals(("grads",))["all_reduce"]),
            "stage_layers": executor.partition.stage_layers,
            "one_microbatch_bytes": (one_microbatch_bytes(executor, rank, microbatches)
                                     if vpp == 1 else None)}


def train_torch_pipelining(rank: int, world_size: int, mesh, schedule_name: str,
                           microbatches: int) -> list[float]:
    """The same stages, run by torch.distributed.pipelining's own schedule."""
    from torch.distributed import pipelining

    model = build_model(LLAMA)
    stages = build_stages(model, partition(LLAMA, world_size, SEQ), world_size, rank)
    module = stages[rank]
    stage = pipelining.PipelineStage(module, rank, world_size, torch.device("cpu"),
                                     group=mesh["pp"].handle)
    loss_fn = lambda logits, targets: F.cross_entropy(logits.flatten(0, 1), targets.flatten())  # noqa: E731
    schedule = getattr(pipelining, schedule_name)(stage, microbatches, loss_fn=loss_fn)
    optimizer = torch.optim.AdamW(module.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    losses = []
    for step in range(STEPS):
        tokens = batch(step)
        inputs, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
        microbatch_losses: list = []
        if rank == 0:
            schedule.step(inputs)
        else:
            schedule.step(target=targets, losses=microbatch_losses)
        loss = torch.tensor(sum(x.item() for x in microbatch_losses) / microbatches)
        dist.all_reduce(loss, group=mesh["pp"].handle)
        losses.append(loss.item())
        square = sum(p.grad.square().sum() for p in module.parameters())
        dist.all_reduce(square, group=mesh["pp"].handle)
        factor = (MAX_NORM / (square.sqrt() + 1e-6)).clamp(max=1.0)
        for p in module.parameters():
            p.grad.mul_(factor)
        optimizer.step()
        optimizer.zero_grad()
    return losses


def run_cases(rank: int, world_size: int, cases: list, torch_schedules: tuple) -> dict:
    mesh = build_mesh(ParallelConfig(pp=world_size), rank, world_size)
    return {"tetrad": [train_pipeline(rank, mesh, case) for case in cases],
            "torch": {name: train_torch_pipelining(rank, world_size, mesh, name, 4)
                      for name in torch_schedules}}


@pytest.fixture(scope="module")
def references() -> dict:
    cases = [("llama", 1), ("gpt2", 1)] + sorted({(c[0], c[3]) for c in PP2_CASES + PP4_CASES
                                                  if MODELS[c[0]].is_moe})
    return {(name, mb): reference(MODELS[name], mb) for name, mb in cases}


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp(min=1e-12))


def check_case(case: tuple, per_rank: list[dict], references: dict) -> None:
    name, schedule_name, vpp, microbatches, _ = case
    config, pp = MODELS[name], len(per_rank)
    expected = references[name, microbatches if config.is_moe else 1]
    schedule = build_schedule(schedule_name, pp, microbatches, vpp)
    for rank, result in enumerate(per_rank):
        stats = result["stats"]
        assert [s.loss for s in stats] == pytest.approx(expected["losses"], rel=1e-5)
        assert result["norms"] == pytest.approx(expected["norms"], rel=1e-5)
        if config.is_moe:
            assert [s.aux_loss for s in stats] == pytest.approx(expected["auxes"], rel=1e-5)
        for key, value in result["params"].items():
            assert relative_error(value, expected["params"][key]) < 1e-5, (case, rank, key)

        # Bytes on the wire: one [microbatch, seq, hidden] fp32 tensor per SEND in the list.
        sends = sum(a.kind.startswith("SEND") for a in schedule.actions[rank])
        per_step = sends * (BATCH // microbatches) * SEQ * config.hidden_size * 4
        assert all(s.p2p_bytes == per_step for s in stats)
        assert result["p2p"] == result["p2p_all_tags"] == STEPS * per_step
        # Two copies of a tied embedding, summed over their ranks; one, on rank 0, in the V.
        holds_tied_copy = config.tie_embeddings and rank in (0, pp - 1) and not schedule.v_shape
        tied_bytes = config.vocab_size * config.hidden_size * 4  # a 2-rank all-reduce sends S
        assert result["tied_all_reduce"] == (STEPS * tied_bytes if holds_tied_copy else 0)

        # Activations held: the schedule's in-flight count, each one microbatch's worth.
        release = "W" if schedule.split_backward else "B"
        in_flight = peak_in_flight(schedule, release)[rank]
        assert all(s.peak_in_flight == in_flight for s in stats)
        if result["one_microbatch_bytes"] is not None:
            assert all(s.peak_activation_bytes == in_flight * result["one_microbatch_bytes"]
                       for s in stats), (case, rank)
        assert all(0.0 <= s.idle_fraction < 1.0 and s.compute_s > 0 for s in stats)
    # Every parameter trained somewhere, and the two copies of a tied embedding stayed equal.
    assert set().union(*(r["params"] for r in per_rank)) == set(expected["params"])
    if config.tie_embeddings and not schedule.v_shape:
        assert torch.equal(per_rank[0]["params"]["embed.weight"],
                           per_rank[-1]["params"]["embed.weight"])


def test_every_schedule_on_two_ranks_matches_one_process_and_torch_pipelining(references):
    results = run_ranks(run_cases, 2, PP2_CASES, TORCH_SCHEDULES)
    for index, case in enumerate(PP2_CASES):
        check_case(case, [r["tetrad"][index] for r in results], references)
    for name in TORCH_SCHEDULES:
        for result in results:
            assert result["torch"][name] == pytest.approx(references["llama", 1]["losses"],
                                                          rel=1e-5), name
    # With 4 microbatches, GPipe's rank 0 holds all 4 at the turn, 1F1B's never more than pp=2.
    gpipe = results[0]["tetrad"][PP2_CASES.index(("llama", "gpipe", 1, 4, None))]["stats"][0]
    one_f_one_b = results[0]["tetrad"][PP2_CASES.index(("llama", "1f1b", 1, 4, None))]["stats"][0]
    assert gpipe.peak_in_flight == 4 and one_f_one_b.peak_in_flight == 2
    assert gpipe.peak_activation_bytes == 2 * one_f_one_b.peak_activation_bytes


def test_every_schedule_on_four_ranks_matches_one_process(references):
    results = run_ranks(run_cases, 4, PP4_CASES, ())
    for index, case in enumerate(PP4_CASES):
        check_case(case, [r["tetrad"][index] for r in results], references)
    assert results[0]["tetrad"][2]["stage_layers"] == (3, 1, 2, 2)  # the explicit split


# In one process: pp=1 runs without torch.distributed (a group of one sends nothing).

def single_rank_executor(config: ModelConfig, schedule: str, microbatches: int
                         ) -> PipelineExecutor:
    model = build_model(config)
    cut = partition(config, 1)
    return PipelineExecutor(build_stages(model, cut, 1, 0),
                            build_schedule(schedule, 1, microbatches), Group("pp", (0,), 0),
                            Comm(), partition=cut)


@pytest.mark.parametrize("config", [LLAMA, GPT2], ids=["llama", "gpt2-tied"])
def test_one_rank_pipeline_accumulates_the_full_batch_gradient(config):
    model = build_model(config)
    tokens = batch(0)
    loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    for schedule, expected_in_flight in (("gpipe", 4), ("1f1b", 1)):
        executor = single_rank_executor(config, schedule, 4)
        stats = executor.step(tokens)
        assert stats.loss == pytest.approx(loss.item(), rel=1e-6)
        assert stats.p2p_bytes == 0 and stats.peak_in_flight == expected_in_flight
        one = one_microbatch_bytes(executor, 0, 4)
        assert stats.peak_activation_bytes == expected_in_flight * one
        grads = {k: p.grad for k, p in executor.named_parameters().items()}
        for name, param in model.named_parameters():
            assert relative_error(grads[name], param.grad) < 1e-5, (schedule, name)


def test_stages_chained_compute_the_models_logits_exactly():
    for config in (LLAMA, GPT2):
        model = build_model(config)
        cut = partition(config, 4, stage_layers=[1, 3, 3, 1])
        stages = [build_stages(model, cut, 4, rank)[rank] for rank in range(4)]
        tokens = batch(0)[:, :-1]
        x = tokens
        for stage in stages:
            x = stage(x)
        assert torch.equal(x, model(tokens))
        names = [n for stage in stages for n, _ in stage.named_parameters()]
        shared = 1 if config.tie_embeddings else 0  # embed.weight on the first and last stage
        assert len(names) == len(set(names)) + shared
        assert set(names) == {n for n, _ in model.named_parameters()}
        assert [list(s.layers) for s in stages] == [["0"], ["1", "2", "3"], ["4", "5", "6"],
                                                    ["7"]]


def test_balanced_partition_minimizes_the_slowest_stage():
    for config, stages in ((LLAMA, 4), (LLAMA.replace(vocab_size=4096), 4),
                           (GPT2.replace(num_layers=7), 3), (LLAMA.replace(num_layers=6), 6)):
        costs = piece_costs(config, SEQ)
        cut = partition(config, stages, SEQ)
        assert sum(cut.stage_layers) == config.num_layers and min(cut.stage_layers) >= 1

        def bottleneck(layers):
            bounds = [0, *itertools.accumulate(layers)]
            return max(sum(costs.blocks[bounds[s]:bounds[s + 1]])
                       + (costs.embed if s == 0 else 0) + (costs.head if s == stages - 1 else 0)
                       for s in range(stages))

        best = min(bottleneck([b - a for a, b in zip((0, *cuts), (*cuts, config.num_layers))])
                   for cuts in itertools.combinations(range(1, config.num_layers), stages - 1))
        assert max(cut.costs) == bottleneck(cut.stage_layers) == best
    # A large vocabulary makes the head weigh several blocks: the last stage gets fewer.
    heavy_head = partition(LLAMA.replace(vocab_size=4096), 4, SEQ)
    assert heavy_head.stage_layers[-1] < heavy_head.stage_layers[0]


@pytest.mark.parametrize("stages, stage_layers, message", [
    (16, None, "at least one transformer layer each, but the model has 8"),
    (4, [3, 3, 3, 3], "sums to 12 but the model has 8 layers"),
    (4, [4, 4, 0, 0], "gives a stage no transformer layer"),
    (4, [4, 4], "lists 2 stages but pp\\*vpp = 4"),
])
def test_bad_partitions_say_what_to_change(stages, stage_layers, message):
    with pytest.raises(ConfigError, match=message):
        partition(LLAMA, stages, stage_layers=stage_layers)


def test_bad_step_arguments_say_what_to_change():
    executor = single_rank_executor(LLAMA, "1f1b", 4)
    with pytest.raises(ConfigError, match="does not split into 4 equal microbatches"):
        executor.step(batch(0)[:6])
    stages = build_stages(build_model(LLAMA), partition(LLAMA, 1), 1, 0)
    with pytest.raises(ConfigError, match="schedule is for pp=2"):
        PipelineExecutor(stages, build_schedule("1f1b", 2, 4), Group("pp", (0,), 0), Comm())


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb"])
def test_the_stage_hook_sees_each_microbatchs_weight_gradients_complete(schedule):
    """What ZeRO-2/3 reduce on: at each `after_stage_backward` call the stage's gradients have
    grown by exactly one microbatch's whole gradient (after W when the backward is split)."""
    microbatches = 4
    model = build_model(LLAMA)
    tokens = batch(0)
    per_microbatch = []
    for window in tokens.chunk(microbatches):
        model.zero_grad()
        loss = F.cross_entropy(model(window[:, :-1]).flatten(0, 1), window[:, 1:].flatten())
        (loss / microbatches).backward()
        per_microbatch.append({n: p.grad.clone() for n, p in model.named_parameters()})
    executor = single_rank_executor(LLAMA, schedule, microbatches)
    params = executor.named_parameters()
    snapshots = []
    executor.after_stage_backward = lambda stage: snapshots.append(
        {n: torch.zeros_like(p) if p.grad is None else p.grad.clone() for n, p in params.items()})
    executor.step(tokens)
    assert len(snapshots) == microbatches
    unmatched = list(range(microbatches))
    previous = {n: torch.zeros_like(p) for n, p in params.items()}
    for snapshot in snapshots:
        added = {n: snapshot[n] - previous[n] for n in params}
        match = [j for j in unmatched if all(
            relative_error(added[n], per_microbatch[j][n]) < 1e-4 for n in params)]
        assert match, (schedule, "a hook call saw no single microbatch's whole gradient")
        unmatched.remove(match[0])
        previous = snapshot
