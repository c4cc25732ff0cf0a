"""The V-shaped schedules (ZB-V, DualPipeV) run by the one executor, against single-process
training of the same model on the same batches and against torch.distributed.pipelining's own
ScheduleZBVZeroBubble / ScheduleDualPipeV on the same stages.

Per case: losses, gradient norms and final parameters match the reference within 1e-5; p2p bytes
equal one activation per SEND in the list (the turn of the V, stages pp-1 and pp on the last
rank, hands its tensors over in memory and sends nothing); a tied embedding lives once, on rank
0 (first and last stage), and is never all-reduced; the in-flight count is the schedule's.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from dist import run_ranks
from reference import seeded_model
from test_pipeline import LLAMA, LR, MODELS, SEQ, STEPS, WEIGHT_DECAY, batch, reference
from test_pipeline import check_case as check_pipeline_case
from test_pipeline import train_pipeline

from tetrad.errors import ConfigError
from tetrad.parallel.mesh import build_mesh
from tetrad.parallel.pipeline import build_stages, partition
from tetrad.schedules import build_schedule
from tetrad.spec.model import ParallelConfig

# (model, schedule, vpp, microbatches, stage_layers)
PP2_CASES = [("llama", "zbv", 2, 4, None), ("llama", "zbv", 2, 2, None),
             ("gpt2", "zbv", 2, 4, None), ("moe", "zbv", 2, 4, None),
             ("llama", "dualpipe", 2, 4, None), ("gpt2", "dualpipe", 2, 8, None),
             ("moe", "dualpipe", 2, 4, None)]
PP4_CASES = [("llama", "zbv", 2, 8, None), ("gpt2", "dualpipe", 2, 8, None)]
TORCH_SCHEDULES = {"zbv": "ScheduleZBVZeroBubble", "dualpipe": "ScheduleDualPipeV"}


def train_torch_pipelining(rank: int, world_size: int, mesh, schedule: str,
                           microbatches: int) -> list[float]:
    """The same V-placed stages, run by torch.distributed.pipelining's schedule (no clipping:
    the losses of 5 AdamW steps are compared with tetrad's executor run the same way)."""
    from torch.distributed import pipelining

    num_stages = 2 * world_size
    stages = build_stages(seeded_model(LLAMA, 0), partition(LLAMA, num_stages, SEQ), world_size,
                          rank, v_shape=True)
    wrapped = [pipelining.PipelineStage(module, index, num_stages, torch.device("cpu"),
                                        group=mesh["pp"].handle)
               for index, module in sorted(stages.items())]
    loss_fn = lambda logits, targets: F.cross_entropy(logits.flatten(0, 1), targets.flatten())  # noqa: E731
    runner = getattr(pipelining, TORCH_SCHEDULES[schedule])(wrapped, microbatches,
                                                            loss_fn=loss_fn)
    params = {id(p): p for module in stages.values() for p in module.parameters()}
    optimizer = torch.optim.AdamW(params.values(), lr=LR, weight_decay=WEIGHT_DECAY)
    losses = []
    for step in range(STEPS):
        tokens = batch(step)
        inputs, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
        microbatch_losses: list = []
        if rank == 0:  # the first and the last stage
            runner.step(inputs, target=targets, losses=microbatch_losses)
        else:
            runner.step()
        loss = torch.tensor(sum(x.item() for x in microbatch_losses) / microbatches)
        dist.all_reduce(loss, group=mesh["pp"].handle)
        losses.append(loss.item())
        optimizer.step()
        optimizer.zero_grad()
    return losses


def unclipped_reference_losses() -> list[float]:
    model = seeded_model(LLAMA, 0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    losses = []
    for step in range(STEPS):
        tokens = batch(step)
        loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def run_cases(rank: int, world_size: int, cases: list, with_torch: bool) -> dict:
    mesh = build_mesh(ParallelConfig(pp=world_size), rank, world_size)
    return {"tetrad": [train_pipeline(rank, mesh, case) for case in cases],
            "torch": {name: train_torch_pipelining(rank, world_size, mesh, name, 2 * world_size)
                      for name in (TORCH_SCHEDULES if with_torch else ())}}


@pytest.fixture(scope="module")
def references() -> dict:
    cases = {(name, mb if MODELS[name].is_moe else 1) for name, _, _, mb, _ in
             PP2_CASES + PP4_CASES}
    return {(name, mb): reference(MODELS[name], mb) for name, mb in sorted(cases)}


def check_case(case: tuple, per_rank: list[dict], references: dict) -> None:
    """test_pipeline's checks, and the V's own: a tied embedding lives on rank 0 alone."""
    check_pipeline_case(case, per_rank, references)
    if MODELS[case[0]].tie_embeddings:
        assert all(("embed.weight" in r["params"]) == (rank == 0)
                   for rank, r in enumerate(per_rank))


def test_v_schedules_on_two_ranks_match_one_process_and_torch_pipelining(references):
    results = run_ranks(run_cases, 2, PP2_CASES, True)
    for index, case in enumerate(PP2_CASES):
        check_case(case, [r["tetrad"][index] for r in results], references)
    expected = unclipped_reference_losses()
    for name in TORCH_SCHEDULES:
        for result in results:
            assert result["torch"][name] == pytest.approx(expected, rel=1e-5), name


def test_v_schedules_on_four_ranks_match_one_process(references):
    results = run_ranks(run_cases, 4, PP4_CASES, False)
    for index, case in enumerate(PP4_CASES):
        check_case(case, [r["tetrad"][index] for r in results], references)


@pytest.mark.parametrize("schedule, vpp, microbatches, message", [
    ("zbv", 1, 4, "two model chunks per rank in a V: use --vpp 2"),
    ("dualpipe", 2, 3, "at least 2 \\* pp = 4 microbatches"),
])
def test_bad_v_layouts_say_what_to_change(schedule, vpp, microbatches, message):
    with pytest.raises(ConfigError, match=message):
        build_schedule(schedule, 2, microbatches, vpp)
    with pytest.raises(ConfigError, match="two model chunks per rank"):
        ParallelConfig(pp=2, schedule=schedule, vpp=1)
