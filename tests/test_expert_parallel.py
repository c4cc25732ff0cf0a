"""Expert parallelism against one process, on tetrad's `tiny-moe` (4 experts, top-2, 1 shared).

One spawn per world size (2 and 4 ranks) carries every distributed check. Per layout: losses,
load-balance losses, gradient norms and final parameters (assembled whole from every rank's
pieces) match
single-process training with the batch split into the data-parallel shards as microbatches
(fp32, 1e-5 relative, 5 AdamW steps), and match training the same layout without EP; the
all-to-all bytes counted by Comm equal the slots each rank sent to and received from other
ranks (counted here from the router's decisions) times hidden times 4 bytes; expert gradients
cross only the expert-data-parallel group.
"""

import pytest
import torch
from dist import run_ranks
from reference import clip_grad_norm, objective, seeded_model, spread, token_batch, train_reference

from tetrad.spec.model import ParallelConfig
from tetrad.errors import ConfigError
from tetrad.models.moe import MoE
from tetrad.models.transformer import Transformer
from tetrad.parallel.comm import Comm, CommCounter
from tetrad.parallel.expert_parallel import (SPLITS_TAG, TOKENS_TAG, ExpertParallelMoE,
                                             apply_expert_parallel, check_expert_parallel)
from tetrad.parallel.mesh import build_mesh
from tetrad.spec.presets import preset

MOE = preset("tiny-moe")
BATCH, SEQ, STEPS, SEED = 8, 32, 5, 0
LR, WEIGHT_DECAY, MAX_NORM = 1e-3, 0.1, 0.5
CAPACITY = 0.5  # small enough that every step drops slots
# (dp, cp, ep, capacity_factor) per spawn; ep=1 is the same layout trained without EP.
CASES = {2: [(2, 1, 1, None), (2, 1, 2, None), (1, 2, 2, None), (2, 1, 2, CAPACITY)],
         4: [(4, 1, 4, None), (4, 1, 2, None)]}


def batch(step: int) -> torch.Tensor:
    return token_batch(MOE.vocab_size, BATCH, SEQ, step)


def build_model() -> Transformer:
    return seeded_model(MOE, SEED)


def one_rank_mesh():
    return build_mesh(ParallelConfig(), 0, 1)


def reference(microbatches: int, capacity: float | None) -> dict:
    """One process, the batch split into `microbatches` (the data-parallel shards: the
    load-balance loss is per microbatch, as under --grad-accum). Capacity needs the EP layer,
    here on a group of one."""
    model = build_model()
    if capacity is not None:
        apply_expert_parallel(model, one_rank_mesh(), Comm(), capacity)
    return train_reference(model, batch, STEPS, microbatches, LR, WEIGHT_DECAY, MAX_NORM)


def kept_slots(experts: torch.Tensor, capacity_factor: float | None) -> list[int]:
    """The experts of the slots that are sent, in slot order: all of them, or per expert the
    first ceil(factor * tokens * k / E) slots."""
    slots = experts.flatten().tolist()
    if capacity_factor is None:
        return slots
    limit = -(-capacity_factor * experts.numel() // MOE.num_experts)
    taken = [0] * MOE.num_experts
    kept = []
    for expert in slots:
        if taken[expert] < limit:
            taken[expert] += 1
            kept.append(expert)
    return kept


def train(rank: int, world_size: int, case: tuple) -> dict:
    dp, cp, ep, capacity = case
    mesh = build_mesh(ParallelConfig(dp=dp, cp=cp, ep=ep), rank, world_size)
    counter = CommCounter()
    comm = Comm(counter)
    parallel = spread(build_model(), mesh, comm, ParallelConfig(dp=dp, cp=cp, ep=ep), SEQ)
    model, experts = parallel.module, parallel.experts
    for layer in (experts.layers.values() if experts else ()):
        layer.capacity_factor = capacity
    routes = []  # [steps][layers] -> slots sent to each ep rank
    for block in model.layers:
        block.mlp.router.register_forward_hook(lambda _, __, out: routes[-1].append(out[1]))
    optimizer = torch.optim.AdamW(parallel.params.values(), lr=LR, weight_decay=WEIGHT_DECAY)
    losses, auxes, norms, token_bytes = [], [], [], []
    grad_bytes = 0
    group = mesh["dp_cp"]
    for step in range(STEPS):
        routes.append([])
        rows = BATCH // dp
        window = batch(step)[mesh.coords["dp"] * rows:(mesh.coords["dp"] + 1) * rows]
        inputs, targets, positions = parallel.split(window)
        before = counter.totals((TOKENS_TAG,))["all_to_all"]
        loss, aux, total = objective(model, model(inputs, positions=positions), targets)
        total.backward()
        token_bytes.append(int(counter.totals((TOKENS_TAG,))["all_to_all"] - before))
        # ParallelModel.reduce_gradients in its two parts, to count what the experts' part sends.
        parallel.engine.reduce_gradients()
        if experts is not None:
            before = counter.totals(("grads",))["all_reduce"]
            experts.reduce_expert_gradients()
            grad_bytes += int(counter.totals(("grads",))["all_reduce"] - before)
        norms.append(clip_grad_norm(parallel, MAX_NORM))
        metrics = torch.stack([loss, aux]).detach()
        comm.all_reduce(metrics, group, "metrics")
        losses.append(metrics[0].item() / group.size)
        auxes.append(metrics[1].item() / group.size)
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)  # in place: DDP's gradients are bucket views
    num_local = MOE.num_experts // ep
    sends = [[[sum(1 for e in kept_slots(layer, capacity) if e // num_local == owner)
               for owner in range(ep)] for layer in step_routes] for step_routes in routes]
    return {"losses": losses, "auxes": auxes, "norms": norms, "token_bytes": token_bytes,
            "sends": sends, "slots": [sum(len(kept_slots(layer, None)) for layer in r)
                                      for r in routes],
            "split_bytes": int(counter.totals((SPLITS_TAG,))["all_to_all"]),
            "grad_bytes": grad_bytes, "params": parallel.whole_state()}


def run_cases(rank: int, world_size: int, cases: list) -> list[dict]:
    return [train(rank, world_size, case) for case in cases]


@pytest.fixture(scope="module")
def references() -> dict:
    keys = {(dp, capacity) for cases in CASES.values() for dp, _, _, capacity in cases}
    return {(dp, capacity): reference(dp, capacity) for dp, capacity in keys}


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).detach().norm() / b.detach().norm().clamp(min=1e-12))


def check_case(case: tuple, per_rank: list[dict], references: dict) -> None:
    dp, cp, ep, capacity = case
    expected = references[dp, capacity]
    dims = ParallelConfig(dp=dp, cp=cp, ep=ep)
    for rank, result in enumerate(per_rank):
        assert result["losses"] == pytest.approx(expected["losses"], rel=1e-5), (case, rank)
        assert result["auxes"] == pytest.approx(expected["auxes"], rel=1e-5), (case, rank)
        assert result["norms"] == pytest.approx(expected["norms"], rel=1e-5), (case, rank)
        assert set(result["params"]) == set(expected["params"])
        for key, value in result["params"].items():
            assert relative_error(value, expected["params"][key]) < 1e-5, (case, rank, key)

        # Dispatch and combine, forward and backward: every slot this rank sent to another rank
        # and every slot it received from another, hidden * 4 bytes each, four times.
        me = dims.coords(rank)["ep"]
        peers = next(group for group in dims.group_ranks("ep") if rank in group)
        for step in range(STEPS):
            rows = 0
            for layer, sends in enumerate(result["sends"][step]):
                rows += sum(n for owner, n in enumerate(sends) if owner != me)
                rows += sum(per_rank[peer]["sends"][step][layer][me] for peer in peers
                            if peer != rank)
            assert result["token_bytes"][step] == 2 * rows * MOE.hidden_size * 4, (case, rank)
        # Before each dispatch: one count per expert to each other ep rank, int64.
        assert result["split_bytes"] == (STEPS * MOE.num_layers * (ep - 1)
                                         * (MOE.num_experts // ep) * 8 if ep > 1 else 0)
        # Expert gradients: an all-reduce over the edp replicas only (none when edp = 1).
        edp = dims.edp
        local_expert_bytes = sum(v.numel() * 4 for k, v in result["params"].items()
                                 if ".experts." in k) // ep
        assert result["grad_bytes"] == (STEPS * 2 * (edp - 1) * local_expert_bytes // edp
                                        if ep > 1 else 0), case


def test_two_ranks_match_one_process_and_training_without_ep(references):
    per_case = list(zip(*run_ranks(run_cases, 2, CASES[2])))
    for case, per_rank in zip(CASES[2], per_case):
        check_case(case, per_rank, references)
    without_ep, with_ep, _, dropping = per_case
    assert with_ep[0]["losses"] == pytest.approx(without_ep[0]["losses"], rel=1e-5)
    # The capacity run really dropped slots, and so trained differently (beyond the tolerance
    # the equality checks use).
    assert all(sum(map(sum, steps)) < slots
               for steps, slots in zip(dropping[0]["sends"], dropping[0]["slots"]))
    assert dropping[0]["losses"] != pytest.approx(with_ep[0]["losses"], rel=1e-5)


def test_four_ranks_with_and_without_expert_replicas_match_one_process(references):
    per_case = list(zip(*run_ranks(run_cases, 4, CASES[4])))
    for case, per_rank in zip(CASES[4], per_case):
        check_case(case, per_rank, references)


# In one process: a group of one sends nothing.

def test_one_rank_layer_equals_the_moe_layer_and_drops_over_capacity():
    torch.manual_seed(SEED)
    moe = MoE(MOE)
    tokens = torch.randn(24, MOE.hidden_size, requires_grad=True)
    expected, expected_aux = moe(tokens)
    group = one_rank_mesh()["ep"]
    out, aux = ExpertParallelMoE(moe, group, Comm())(tokens)
    assert torch.allclose(out, expected, rtol=1e-6, atol=1e-7) and torch.equal(aux, expected_aux)
    grads = torch.autograd.grad(out.sum(), [tokens, *moe.parameters()])
    expected_grads = torch.autograd.grad(expected.sum(), [tokens, *moe.parameters()])
    for got, want in zip(grads, expected_grads):
        assert relative_error(got, want) < 1e-6

    # Capacity 0.5: 24 tokens * 2 / 4 experts * 0.5 = 6 slots per expert, earliest tokens first.
    out = ExpertParallelMoE(moe, group, Comm(), capacity_factor=CAPACITY)(tokens)[0]
    with torch.no_grad():
        weights, experts, _ = moe.router(tokens)
        manual = moe.shared(tokens)
        taken = [0] * MOE.num_experts
        dropped = 0
        for t in range(tokens.shape[0]):
            for j in range(MOE.num_experts_per_token):
                e = int(experts[t, j])
                if taken[e] < 6:
                    taken[e] += 1
                    manual[t] += weights[t, j] * moe.experts[e](tokens[t:t + 1])[0]
                else:
                    dropped += 1
    assert dropped > 0
    assert torch.allclose(out, manual, rtol=1e-5, atol=1e-6)


def test_an_expert_no_row_reached_keeps_the_autocast_dtype():
    """Under bf16 autocast a rank whose rows skip an expert sends bf16 like every other rank (an
    fp32 empty piece once promoted the whole output and the all-to-all sizes disagreed)."""
    torch.manual_seed(SEED)
    layer = ExpertParallelMoE(MoE(MOE), one_rank_mesh()["ep"], Comm())
    received = torch.randn(5, MOE.hidden_size)
    counts = torch.tensor([[2, 0, 3, 0][:MOE.num_experts]])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer._run_experts(received, counts)
    assert out.dtype == torch.bfloat16 and out.shape == received.shape


def test_bad_layouts_say_what_to_change():
    with pytest.raises(ConfigError, match="needs a mixture-of-experts model.*set --ep 1"):
        check_expert_parallel(preset("tiny"), 2)
    with pytest.raises(ConfigError, match="ep 3 does not divide num_experts 4: choose ep among "
                                          "1, 2, 4"):
        check_expert_parallel(MOE, 3)
    with pytest.raises(ConfigError, match="capacity factor must be positive"):
        check_expert_parallel(MOE, 2, capacity_factor=0.0)
    with pytest.raises(ConfigError, match="ep 4 must divide dp\\*cp = 2"):
        ParallelConfig(dp=2, ep=4)
