"""Context parallelism (ring attention) against one process on whole sequences.

One spawn per cp degree (2 and 4) carries every distributed check: ring attention on random
tensors equals full causal attention, forward and backward, for MHA, GQA and MQA; training a
model with its sequences split over the ring (load-balanced chunks) gives the single-process
losses, gradient norms and final parameters (fp32, 1e-5 relative, 5 AdamW steps) for RoPE and
learned positions, a MoE model and full recomputation; the p2p bytes counted by Comm equal the
ring's formula, computed here from the shapes.
"""

import pytest
import torch
import torch.nn.functional as F
from dist import run_ranks
from reference import objective, seeded_model, token_batch, train_reference

from tetrad.spec.model import ModelConfig, ParallelConfig
from tetrad.errors import ConfigError
from tetrad.models.transformer import Transformer
from tetrad.parallel.comm import Comm, CommCounter
from tetrad.parallel.context_parallel import (TAG, RingAttention, apply_context_parallel,
                                              check_context_parallel, chunk_positions)
from tetrad.parallel.mesh import Group, build_mesh
from tetrad.parallel.recompute import apply_recompute
from tetrad.spec.presets import preset

LLAMA = ModelConfig(name="cp-llama", vocab_size=64, hidden_size=32, num_layers=2, num_heads=4,
                    num_kv_heads=2, ffn_hidden_size=64, max_seq_len=64)
# Learned positions check that each chunk is embedded at its global position. No biases: the key
# bias has an exactly zero gradient that AdamW would turn into noise-sized full steps.
GPT2 = LLAMA.replace(name="cp-gpt2", norm="layernorm", position="learned", mlp="gelu",
                     tie_embeddings=True, num_kv_heads=4)
MOE = preset("tiny-moe")
MODELS = {"llama": LLAMA, "gpt2": GPT2, "moe": MOE}
BATCH, SEQ, STEPS, SEED = 4, 32, 5, 0
LR, WEIGHT_DECAY, MAX_NORM = 1e-3, 0.1, 0.5
# (model, recompute) per spawn
CASES = {2: [("llama", "none"), ("gpt2", "none"), ("moe", "none"), ("llama", "full")],
         4: [("llama", "none"), ("moe", "full")]}
HEADS = [(4, 4), (4, 2), (4, 1)]  # (heads, kv_heads): MHA, GQA, MQA
RING_BATCH, RING_SEQ, HEAD_DIM = 2, 16, 8


def batch(step: int) -> torch.Tensor:
    return token_batch(LLAMA.vocab_size, BATCH, SEQ, step)


def build_model(config: ModelConfig) -> Transformer:
    return seeded_model(config, SEED)


def reference(config: ModelConfig) -> dict:
    return train_reference(build_model(config), batch, STEPS, 1, LR, WEIGHT_DECAY, MAX_NORM)


def ring_tensors(heads: int, kv_heads: int) -> tuple[torch.Tensor, ...]:
    """q, k, v and the output gradient of a whole sequence, the same on every rank."""
    generator = torch.Generator().manual_seed(heads * 10 + kv_heads)
    shapes = [(heads, RING_SEQ), (kv_heads, RING_SEQ), (kv_heads, RING_SEQ), (heads, RING_SEQ)]
    return tuple(torch.randn(RING_BATCH, h, s, HEAD_DIM, generator=generator) for h, s in shapes)


def run_ring(group: Group, counter: CommCounter) -> list[dict]:
    ring = RingAttention(group, Comm(counter))
    positions = chunk_positions(RING_SEQ, group.size, group.index)
    results = []
    for heads, kv_heads in HEADS:
        q, k, v, dout = (t[:, :, positions].clone() for t in ring_tensors(heads, kv_heads))
        for t in (q, k, v):
            t.requires_grad_()
        counter.reset()
        out = ring(q, k, v)
        forward_bytes = int(counter.totals((TAG,))["p2p"])
        out.backward(dout)
        results.append({"out": out.detach(), "grads": [t.grad for t in (q, k, v)],
                        "forward_bytes": forward_bytes,
                        "backward_bytes": int(counter.totals((TAG,))["p2p"]) - forward_bytes})
    return results


def train(mesh, case: tuple) -> dict:
    name, recompute = case
    counter = CommCounter()
    comm = Comm(counter)
    cp = mesh["cp"]
    model = build_model(MODELS[name])
    context = apply_context_parallel(model, cp, comm)
    apply_recompute(model, recompute)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    losses, norms = [], []
    for step in range(STEPS):
        inputs, targets, positions = context.shard(batch(step))
        loss, _, total = objective(model, model(inputs, positions=positions), targets)
        total.backward()
        for param in model.parameters():  # CP ranks hold replicas: average like DP replicas
            comm.all_reduce(param.grad, cp, "grads")
            param.grad /= cp.size
        mean = loss.detach().clone()
        comm.all_reduce(mean, cp, "metrics")
        losses.append(mean.item() / cp.size)
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        optimizer.step()
        optimizer.zero_grad()
    ring_bytes = int(counter.totals((TAG,))["p2p"])
    routing_bytes = counter.totals(("routing",))["all_reduce"]
    # Back on whole sequences, the model computes the very logits the ring computed in shards.
    inputs, _, positions = context.shard(batch(0))
    with torch.no_grad():
        sharded = model(inputs, positions=positions)
        with context.whole_sequences():
            whole = model(batch(0)[:, :-1])
    return {"losses": losses, "norms": norms,
            "params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "ring_bytes": ring_bytes, "routing_bytes": routing_bytes,
            "whole_vs_sharded": float((whole[:, positions] - sharded).abs().max())}


def run_cp(rank: int, world_size: int, cases: list) -> dict:
    mesh = build_mesh(ParallelConfig(cp=world_size), rank, world_size)
    counter = CommCounter()
    return {"ring": run_ring(mesh["cp"], counter),
            "train": [train(mesh, case) for case in cases]}


@pytest.fixture(scope="module")
def references() -> dict:
    return {name: reference(MODELS[name]) for name in {c[0] for cs in CASES.values() for c in cs}}


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).detach().norm() / b.detach().norm().clamp(min=1e-12))


def check_ring(cp: int, per_rank: list[dict]) -> None:
    for index, (heads, kv_heads) in enumerate(HEADS):
        q, k, v, dout = (t.clone().requires_grad_() for t in ring_tensors(heads, kv_heads))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                             enable_gqa=heads != kv_heads)
        out.backward(dout.detach())
        kv_bytes = 2 * RING_BATCH * kv_heads * (RING_SEQ // cp) * HEAD_DIM * 4
        for rank, result in enumerate(per_rank):
            mine = result["ring"][index]
            positions = chunk_positions(RING_SEQ, cp, rank)
            assert relative_error(mine["out"], out.detach()[:, :, positions]) < 1e-5
            for got, expected in zip(mine["grads"], (q.grad, k.grad, v.grad)):
                assert relative_error(got, expected[:, :, positions]) < 1e-5, (cp, heads, rank)
            # cp-1 hops of this rank's K/V forward; cp-1 of K/V and cp-1 of dK/dV (fp32) back.
            assert mine["forward_bytes"] == (cp - 1) * kv_bytes
            assert mine["backward_bytes"] == 2 * (cp - 1) * kv_bytes


def check_training(cp: int, per_rank: list[dict], references: dict) -> None:
    for index, (name, recompute) in enumerate(CASES[cp]):
        config, expected = MODELS[name], references[name]
        for result in (r["train"][index] for r in per_rank):
            assert result["losses"] == pytest.approx(expected["losses"], rel=1e-5), name
            assert result["norms"] == pytest.approx(expected["norms"], rel=1e-5), name
            for key, value in result["params"].items():
                assert relative_error(value, expected["params"][key]) < 1e-5, (name, key)
            assert result["whole_vs_sharded"] < 1e-5
            # Per layer and step: the forward's cp-1 K/V hops, the backward's cp-1 K/V and cp-1
            # dK/dV hops, and with full recomputation the forward's once more.
            kv_bytes = 2 * BATCH * config.num_kv_heads * (SEQ // cp) * config.head_dim * 4
            passes = 4 if recompute == "full" else 3
            assert result["ring_bytes"] == STEPS * config.num_layers * passes * (cp - 1) * kv_bytes
            forwards = 2 if recompute == "full" else 1
            routing = (STEPS * config.num_layers * forwards * 2 * (cp - 1) * config.num_experts * 4
                       / cp)
            assert result["routing_bytes"] == routing


@pytest.mark.parametrize("cp", [2, 4])
def test_ring_attention_and_training_match_one_process(cp, references):
    per_rank = run_ranks(run_cp, cp, CASES[cp])
    check_ring(cp, per_rank)
    check_training(cp, per_rank, references)


def test_one_rank_ring_is_causal_attention():
    """cp=1 runs without torch.distributed: the ring is the local causal block alone."""
    for heads, kv_heads in HEADS:
        q, k, v, dout = (t.requires_grad_() for t in ring_tensors(heads, kv_heads))
        counter = CommCounter()
        out = RingAttention(Group("cp", (0,), 0), Comm(counter))(q, k, v)
        grads = torch.autograd.grad(out, (q, k, v), dout)
        expected = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                  enable_gqa=heads != kv_heads)
        expected_grads = torch.autograd.grad(expected, (q, k, v), dout)
        assert relative_error(out, expected) < 1e-6
        for got, want in zip(grads, expected_grads):
            assert relative_error(got, want) < 1e-6
        assert counter.totals()["p2p"] == 0


def test_chunks_pair_early_with_late():
    assert chunk_positions(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert chunk_positions(16, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    held = torch.cat([chunk_positions(24, 3, index) for index in range(3)])
    assert sorted(held.tolist()) == list(range(24))


def test_bad_sequence_length_says_what_to_change():
    with pytest.raises(ConfigError, match="does not split into 2\\*cp = 8 equal chunks.*multiple "
                                          "of 8"):
        check_context_parallel(LLAMA, 4, 36)
    context = apply_context_parallel(build_model(LLAMA), Group("cp", (0,), 0), Comm())
    with pytest.raises(ConfigError, match="multiple of 2"):
        context.shard(torch.zeros(2, 8, dtype=torch.long))  # 7 input tokens
