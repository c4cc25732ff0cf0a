"""Communication overlapped with compute (ParallelConfig.overlap) against the same layouts without
it and against one process (fp32, AdamW, clipping, 3 steps), in one spawn of 2 ranks.

Cases: tensor parallelism with and without sequence parallelism (chunked async collectives around
the column- and row-parallel matmuls, tetrad.parallel.tp_overlap; biases and learned positions in
the SP case), and expert parallelism with a shared expert (the dispatch all-to-all issued async
and waited for after the shared expert, forward and backward). Per case and setting: losses,
gradient norms and the final parameters gathered whole match single-process training to 1e-5;
both settings send exactly the same bytes of every kind; the exposed communication Comm timed is
there for the kinds each layout uses. The planner's overlap model is checked on a hand example.
"""

import math

import pytest
import torch
from dist import run_ranks
from reference import clip_grad_norm, objective, seeded_model, spread, token_batch

from tetrad.spec.model import ModelConfig, ParallelConfig
from tetrad.hardware.profile import cluster as make_cluster
from tetrad.parallel.comm import Comm, CommCounter
from tetrad.parallel.mesh import build_mesh
from tetrad.planner import predict_training
from tetrad.planner.comm import call_time
from tetrad.planner.compute import layer_times
from tetrad.planner.eager_overlap import exposed
from tetrad.spec.presets import preset

DENSE = ModelConfig(name="overlap-llama", vocab_size=64, hidden_size=32, num_layers=2,
                    num_heads=4, num_kv_heads=2, ffn_hidden_size=64, max_seq_len=16)
GPT2 = DENSE.replace(name="overlap-gpt2", norm="layernorm", position="learned", mlp="gelu",
                     bias=True)
MOE = preset("tiny-moe")
BATCH, SEQ, STEPS, SEED = 4, 16, 3, 0
LR, WEIGHT_DECAY, MAX_NORM = 1e-3, 0.1, 0.5
EPS = 1e-6  # see tests/test_tensor_parallel.py: sums in another order, gradients near 1e-8
# name -> (model, layout): the collectives each one overlaps
CASES = {"tp2 sp": (GPT2, dict(tp=2, sequence_parallel=True)),
         "tp2": (DENSE, dict(tp=2)),
         "dp2 ep2": (MOE, dict(dp=2, ep=2))}
KINDS = {"tp2 sp": ("all_gather", "reduce_scatter"), "tp2": ("all_reduce",),
         "dp2 ep2": ("all_to_all",)}


def batch(config: ModelConfig, step: int) -> torch.Tensor:
    return token_batch(config.vocab_size, BATCH, SEQ, step)


def reference(name: str) -> dict:
    """One process; the data-parallel shards are its microbatches (the load-balance loss is
    defined per microbatch)."""
    config, layout = CASES[name]
    model = seeded_model(config, SEED)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, eps=EPS)
    microbatches = layout.get("dp", 1)
    losses, norms = [], []
    for step in range(STEPS):
        loss_sum = 0.0
        for window in batch(config, step).chunk(microbatches):
            loss, _, total = objective(model, model(window[:, :-1]), window[:, 1:])
            (total / microbatches).backward()
            loss_sum += loss.item() / microbatches
        losses.append(loss_sum)
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        optimizer.step()
        optimizer.zero_grad()
    return {"losses": losses, "norms": norms,
            "params": {name: p.detach().clone() for name, p in model.named_parameters()}}


def train(rank: int, world_size: int, name: str, overlap: bool) -> dict:
    config, layout = CASES[name]
    parallel_config = ParallelConfig(**layout, overlap=overlap)
    mesh = build_mesh(parallel_config, rank, world_size)
    counter = CommCounter()
    comm = Comm(counter)
    parallel = spread(seeded_model(config, SEED), mesh, comm, parallel_config, SEQ)
    model = parallel.module
    optimizer = torch.optim.AdamW(parallel.params.values(), lr=LR, weight_decay=WEIGHT_DECAY,
                                  eps=EPS)
    dp, group = mesh["dp"], mesh["dp_cp"]
    rows = BATCH // dp.size
    losses, norms = [], []
    for step in range(STEPS):
        window = batch(config, step)[dp.index * rows:(dp.index + 1) * rows]
        inputs, targets, positions = parallel.split(window)
        logits = model(inputs, positions=positions)
        loss = parallel.loss(logits, targets)
        aux = model.aux_loss()
        parallel.backward(loss if aux is None else loss + config.router_aux_loss_coef * aux,
                          True)
        parallel.reduce_gradients()
        norms.append(clip_grad_norm(parallel, MAX_NORM))
        total = loss.detach().reshape(1)
        comm.all_reduce(total, group, "metrics")
        losses.append(total.item() / group.size)
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)  # in place: DDP's gradients are bucket views
        counter.end_step()
    return {"losses": losses, "norms": norms, "params": parallel.whole_state(),
            "bytes": {kind: int(value) for kind, value in counter.totals().items()},
            "exposed": counter.exposed_per_step()}


def run_cases(rank: int, world_size: int) -> dict:
    return {(name, overlap): train(rank, world_size, name, overlap)
            for name in CASES for overlap in (True, False)}


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp(min=1e-12))


def test_overlapped_collectives_train_as_one_process_and_send_the_same_bytes():
    per_rank = run_ranks(run_cases, 2)
    for name in CASES:
        expected = reference(name)
        for rank, results in enumerate(per_rank):
            on, off = results[name, True], results[name, False]
            for result in (on, off):
                assert result["losses"] == pytest.approx(expected["losses"], rel=1e-5), name
                assert result["norms"] == pytest.approx(expected["norms"], rel=1e-5), name
                assert set(result["params"]) == set(expected["params"])
                for key, value in result["params"].items():
                    assert relative_error(value, expected["params"][key]) < 1e-5, (name, key)
            assert on["bytes"] == off["bytes"], (name, rank)
            for result in (on, off):
                total, by_kind = result["exposed"]
                assert total == pytest.approx(sum(by_kind.values()))
                for kind in KINDS[name]:
                    assert result["bytes"][kind] > 0 and by_kind[kind] > 0, (name, kind)


def test_the_overlap_model_on_hand_examples():
    # 4 s of communication in 4 chunks: the first chunk always waits; compute covers the rest
    # when it is longer, else leaves the difference's share of the other three chunks.
    assert exposed(4.0, 10.0, 4) == pytest.approx(1.0)
    assert exposed(4.0, 2.0, 4) == pytest.approx(1.0 + 0.75 * 2.0)
    assert exposed(4.0, 10.0, 1) == pytest.approx(4.0)  # one chunk: nothing to overlap
    assert exposed(4.0, 3.0, math.inf) == pytest.approx(1.0)  # issued whole beside compute
    # tp=2 without SP on an H100, fp32: per block two forward g and two backward f, all-reduces
    # of [micro_batch * seq, hidden] fp32, chunked behind 3x the block's forward matmuls.
    config, micro_batch, seq = preset("tiny"), 4, 128
    times = {overlap: predict_training(config, ParallelConfig(tp=2, overlap=overlap),
                                       micro_batch, seq, gpu="h100-sxm")["comm_exposed_s"]
             for overlap in (True, False)}
    cluster = make_cluster("h100-sxm", 2, 2)
    block = 4 * call_time(cluster, "all_reduce", 2, micro_batch * seq * config.hidden_size * 4)
    matmuls = [3 * layer_times(config, cluster.gpu, layer, micro_batch, seq, 2, 1, 1, False,
                               "none", True, False, "fp32", 4, 4,
                               portable_attention=True).matmul_forward
               for layer in range(config.num_layers)]
    hidden = sum(block - (block / 4 + 0.75 * max(0.0, block - m)) for m in matmuls)
    assert times[False] - times[True] == pytest.approx(hidden)
    assert hidden > 0
