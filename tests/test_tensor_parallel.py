"""Tensor and sequence parallelism against single-process training of the same model on the same
batches (fp32, AdamW, gradient clipping, 5 steps).

Two spawns carry every distributed check: tp=2 and tp=4, each training llama-style GQA models
(kv heads >= tp and < tp, one with q/k/v biases), a GPT-2-style model (biases, learned positions,
tied embeddings) and tiny-moe, with and without sequence parallelism. Per case: losses, gradient
norms and the final parameters gathered whole match the reference; the bytes Comm counted equal
the formula below, computed here from the config alone; the activation bytes saved for backward
drop under SP by exactly the norms' share. On tp=2 the same model also trains under DTensor
(ColwiseParallel / RowwiseParallel / SequenceParallel + loss_parallel) with the same losses.
"""

import contextlib
from fractions import Fraction

import pytest
import torch
import torch.nn.functional as F
from dist import run_ranks
from peers import dtensor_tensor_parallel
from reference import clip_grad_norm, spread

from tetrad.spec.model import ModelConfig, ParallelConfig
from tetrad.errors import ConfigError
from tetrad.memory import ActivationMeter
from tetrad.models.layers import make_norm
from tetrad.models.transformer import Transformer
from tetrad.parallel.comm import Comm, CommCounter
from tetrad.parallel.mesh import Group, build_mesh
from tetrad.parallel.tensor_parallel import (apply_tensor_parallel, check_tensor_parallel,
                                             qkv_rows, up_rows)
from tetrad.spec.presets import preset

LLAMA = ModelConfig(name="tp-llama", vocab_size=64, hidden_size=32, num_layers=2, num_heads=8,
                    num_kv_heads=4, ffn_hidden_size=64, max_seq_len=16)
GQA = LLAMA.replace(name="tp-gqa", num_kv_heads=2)  # kv heads replicated at tp=4
MQA = LLAMA.replace(name="tp-mqa", num_kv_heads=1, qkv_bias=True)  # replicated at tp=2 and 4
GPT2 = LLAMA.replace(name="tp-gpt2", norm="layernorm", position="learned", mlp="gelu", bias=True,
                     tie_embeddings=True, num_kv_heads=8)
MODELS = {"llama": LLAMA, "gqa": GQA, "mqa": MQA, "gpt2": GPT2, "moe": preset("tiny-moe")}
BATCH, SEQ, STEPS, SEED = 4, 8, 5, 0
LR, WEIGHT_DECAY, MAX_NORM = 1e-3, 0.1, 0.5
# AdamW's eps: 1e-6, not torch's 1e-8. Tensor parallelism sums in another order, and an element
# whose gradient is ~1e-8 (rounding level for sums of 1e-3-sized terms) would take a step of any
# size up to LR on either side under eps=1e-8: one such element, not a wrong gradient, would
# decide a tensor's relative error. Losses and gradient norms agree to ~1e-7 either way.
EPS = 1e-6

# (model, sequence_parallel, microbatches)
TP2_CASES = [("llama", False, 1), ("llama", True, 1), ("mqa", False, 2), ("mqa", True, 1),
             ("gpt2", False, 1), ("gpt2", True, 1), ("moe", False, 1), ("moe", True, 1)]
TP4_CASES = [("llama", False, 1), ("llama", True, 1), ("gqa", True, 1), ("mqa", False, 1),
             ("gpt2", False, 2), ("gpt2", True, 2), ("moe", False, 1), ("moe", True, 1)]


def batch(step: int, config: ModelConfig) -> torch.Tensor:
    return torch.randint(config.vocab_size, (BATCH, SEQ + 1),
                         generator=torch.Generator().manual_seed(1000 + step))


def build_model(config: ModelConfig) -> Transformer:
    torch.manual_seed(SEED)
    return Transformer(config)


def train(config: ModelConfig, microbatches: int, forward, loss_fn, params: list,
          clip_grad_norm, finish=lambda: None, meter: ActivationMeter | None = None) -> dict:
    """The loop every layout runs: accumulate microbatches (MoE's load-balance loss is defined per
    microbatch), finish the gradients, clip, step."""
    optimizer = torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY, eps=EPS)
    losses, norms = [], []
    for step in range(STEPS):
        total = 0.0
        for window in batch(step, config).chunk(microbatches):
            with meter.measure() if meter else contextlib.nullcontext():
                loss, aux = loss_fn(forward(window[:, :-1]), window[:, 1:])
                objective = loss if aux is None else loss + config.router_aux_loss_coef * aux
            (objective / microbatches).backward()
            if meter:
                meter.finish_microbatch()
            total += loss.item() / microbatches
        finish()
        losses.append(total)
        norms.append(clip_grad_norm())
        optimizer.step()
        optimizer.zero_grad()
    return {"losses": losses, "norms": norms}


def reference(config: ModelConfig, microbatches: int) -> dict:
    model = build_model(config)

    def loss_fn(logits, targets):
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten()), model.aux_loss()

    result = train(config, microbatches, model, loss_fn, list(model.parameters()),
                   lambda: float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
    return {**result, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def train_tetrad(mesh, case: tuple) -> dict:
    name, sequence_parallel, microbatches = case
    config = MODELS[name]
    counter = CommCounter()
    parallel = spread(build_model(config), mesh, Comm(counter),
                      ParallelConfig(tp=mesh.dims.tp, sequence_parallel=sequence_parallel), SEQ)
    model = parallel.module
    meter = ActivationMeter(model)

    def loss_fn(logits, targets):
        assert logits.shape[-1] == config.vocab_size // mesh.dims.tp  # never the full vocab
        return parallel.loss(logits, targets), model.aux_loss()

    def finish():
        parallel.reduce_gradients()  # the data-parallel engine sums tp's partial gradients
        counter.end_step()

    result = train(config, microbatches, model, loss_fn, list(parallel.params.values()),
                   lambda: clip_grad_norm(parallel, MAX_NORM), finish, meter)
    bytes_by_tag = {tag: counter.totals((tag,)) for tag in counter.tags()}
    return {**result, "params": parallel.whole_state(), "activation_bytes": meter.peak_bytes,
            "bytes": bytes_by_tag}


def train_dtensor(world_size: int, config: ModelConfig, sequence_parallel: bool) -> list[float]:
    """The same model under torch's DTensor TP (tests/peers.py)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel

    model = dtensor_tensor_parallel(build_model(config), config, world_size, sequence_parallel)
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY, eps=EPS)
    losses = []
    for step in range(STEPS):
        window = batch(step, config)
        with loss_parallel():
            loss = F.cross_entropy(model(window[:, :-1]).flatten(0, 1), window[:, 1:].flatten())
            loss.backward()
        losses.append(loss.full_tensor().item())
        grads = [p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad for p in params]
        norm = torch.stack([grad.square().sum() for grad in grads]).sum().sqrt()
        for param in params:
            param.grad.mul_((MAX_NORM / (norm + 1e-6)).clamp(max=1.0))
        optimizer.step()
        optimizer.zero_grad()
    return losses


def run_cases(rank: int, world_size: int, cases: list, dtensor: bool) -> dict:
    mesh = build_mesh(ParallelConfig(tp=world_size), rank, world_size)
    return {"tetrad": [train_tetrad(mesh, case) for case in cases],
            "dtensor": {sp: train_dtensor(world_size, LLAMA, sp) for sp in (False, True)}
            if dtensor else {}}


@pytest.fixture(scope="module")
def references() -> dict:
    return {(name, mb): reference(MODELS[name], mb)
            for name, mb in sorted({(c[0], c[2]) for c in TP2_CASES + TP4_CASES})}


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp(min=1e-12))


def expected_bytes(config: ModelConfig, tp: int, sequence_parallel: bool, microbatches: int
                   ) -> dict[str, dict[str, Fraction]]:
    """Bytes one rank sends over the run by tag and kind, from the config alone. A ring
    all-reduce of S bytes over tp ranks sends 2(tp-1)/tp*S, a reduce-scatter or all-gather
    (tp-1)/tp*S. Per microbatch, in [b, s, h] activations:
      dense layer: 2 all-reduces forward (after attention, after the MLP), 2 backward (before each)
      MoE layer:   attention's 2 + 2 (routed experts whole, same input on every rank), and
                   the shared experts' g forward and f backward, all-reduces under SP too
      embedding:   1 all-reduce forward; head: 1 all-reduce backward (its input)
    Under SP each all-reduce is an all-gather + reduce-scatter pair, and an MoE layer adds an
    all-gather forward (its input) and one backward (its output gradient).
    Loss: all-reduces of [tokens] (max logit) and [2, tokens] (sum of exps, target logit).
    Per step, "grads": kv rows replicated when kv heads < tp; under SP the replicated
    parameters outside MoE layers (norms, row-parallel biases, learned positions); "grad_norm":
    one float64 all-reduce of the squared norm (ParallelModel.grad_norm)."""
    h, fp32, fp64 = config.hidden_size, 4, 8
    tokens = BATCH // microbatches * SEQ
    activation = tokens * h * fp32
    num_moe = sum(config.is_moe_layer(layer) for layer in range(config.num_layers))
    all_reduces = 4 * (config.num_layers - num_moe) + 2 * num_moe + 2
    shared = 2 * num_moe if config.num_shared_experts else 0  # inside the MoE layer
    ar, half = Fraction(2 * (tp - 1), tp), Fraction(tp - 1, tp)
    runs = STEPS * microbatches
    zero = {"all_reduce": 0, "all_gather": 0, "reduce_scatter": 0}
    if sequence_parallel:
        activations = {**zero, "all_gather": runs * (all_reduces + 2 * num_moe) * half * activation,
                       "reduce_scatter": runs * all_reduces * half * activation,
                       "all_reduce": runs * shared * ar * activation}
    else:
        activations = {**zero, "all_reduce": runs * (all_reduces + shared) * ar * activation}
    grads = 0
    if config.num_kv_heads < tp:
        kv_rows = 2 * config.num_kv_heads * config.head_dim
        grads += config.num_layers * kv_rows * (h + (config.qkv_bias or config.bias))
    if sequence_parallel:
        norm = h * (2 if config.norm == "layernorm" and config.bias else 1)
        grads += (2 * config.num_layers + 1) * norm
        grads += config.bias * h * (2 * config.num_layers - num_moe)  # out and down biases
        grads += config.max_seq_len * h if config.position == "learned" else 0
    return {"activations": activations,
            "loss": {**zero, "all_reduce": runs * 3 * tokens * fp32 * ar},
            "grads": {**zero, "all_reduce": STEPS * grads * fp32 * ar},
            "grad_norm": {**zero, "all_reduce": STEPS * fp64 * ar}}


def norm_bytes(config: ModelConfig, rows: int, seq: int) -> int:
    """What one norm saves for backward on [rows, seq, hidden], measured on its own."""
    norm = make_norm(config)
    meter = ActivationMeter(norm)
    with meter.measure():
        norm(torch.randn(rows, seq, config.hidden_size, requires_grad=True))
    return meter.finish_microbatch()


def check_parameter(config: ModelConfig, key: str, value: torch.Tensor, expected: torch.Tensor,
                    where: tuple) -> None:
    """Relative error under 1e-5, except for the key bias: its gradient is exactly zero (softmax
    ignores a constant added to every key's score), so it holds only rounding noise, which AdamW's
    normalization turns into steps of up to about LR that no two summation orders agree on. Its
    copies may only drift apart by that much."""
    if key.endswith("qkv.bias"):
        keys = slice(config.q_size, config.q_size + config.kv_size)
        assert (value[keys] - expected[keys]).abs().max() <= LR * STEPS, (*where, key)
        value, expected = value.clone(), expected.clone()
        value[keys] = expected[keys] = 0.0
    assert relative_error(value, expected) < 1e-5, (*where, key)


def check_cases(cases: list, per_rank: list[dict], references: dict) -> None:
    tp = len(per_rank)
    for index, case in enumerate(cases):
        name, sequence_parallel, microbatches = case
        config = MODELS[name]
        expected = references[name, microbatches]
        kinds = expected_bytes(config, tp, sequence_parallel, microbatches)
        for rank, result in enumerate(r["tetrad"][index] for r in per_rank):
            assert result["losses"] == pytest.approx(expected["losses"], rel=1e-5), (case, rank)
            assert result["norms"] == pytest.approx(expected["norms"], rel=1e-5), (case, rank)
            # The same names: a tied embedding stays one tensor (no lm_head.weight appears).
            assert set(result["params"]) == set(expected["params"])
            for key, value in result["params"].items():
                check_parameter(config, key, value, expected["params"][key], (case, rank))
            assert set(result["bytes"]) <= set(kinds)  # no traffic the formula leaves out
            for tag, by_kind in kinds.items():
                counted = {kind: result["bytes"].get(tag, {}).get(kind, 0) for kind in by_kind}
                assert counted == by_kind, (case, rank, tag)
    # Sequence parallelism keeps the norms' activations on [b, s/tp, h]: the bytes saved for
    # backward drop by exactly that (2 norms per layer and the final one); nothing else changes.
    for index, (name, sequence_parallel, microbatches) in enumerate(cases):
        if not sequence_parallel or (name, False, microbatches) not in cases:
            continue
        config = MODELS[name]
        without = per_rank[0]["tetrad"][cases.index((name, False, microbatches))]
        rows = BATCH // microbatches
        saved = (2 * config.num_layers + 1) * (norm_bytes(config, rows, SEQ)
                                               - norm_bytes(config, rows, SEQ // tp))
        for result in (r["tetrad"][index] for r in per_rank):
            assert without["activation_bytes"] - result["activation_bytes"] == saved > 0, name


def test_tensor_parallel_on_two_ranks_matches_one_process_and_dtensor(references):
    results = run_ranks(run_cases, 2, TP2_CASES, True)
    check_cases(TP2_CASES, results, references)
    for result in results:
        for sequence_parallel, losses in result["dtensor"].items():
            assert losses == pytest.approx(references["llama", 1]["losses"], rel=1e-5), \
                sequence_parallel


def test_tensor_parallel_on_four_ranks_matches_one_process(references):
    check_cases(TP4_CASES, run_ranks(run_cases, 4, TP4_CASES, False), references)


# In one process --------------------------------------------------------------------------------

@pytest.mark.parametrize("config, tp", [(LLAMA, 2), (LLAMA, 8), (GQA, 4), (MQA, 8)])
def test_slices_cover_every_row_and_replicate_only_kv(config, tp):
    """Over the ranks, qkv slices hold every q row once and every kv row tp/kv times (once when
    kv heads >= tp); gate/up slices hold every row once, in [gate; up] order on each rank."""
    counts = torch.bincount(torch.cat([qkv_rows(config, tp, r) for r in range(tp)]),
                            minlength=config.q_size + 2 * config.kv_size)
    copies = max(1, tp // config.num_kv_heads)
    assert counts[:config.q_size].eq(1).all() and counts[config.q_size:].eq(copies).all()
    for r in range(tp):  # each rank's q heads read exactly the kv heads it holds
        rows = qkv_rows(config, tp, r)
        q_heads = rows[:config.q_size // tp:config.head_dim] // config.head_dim
        kv_heads = (rows[config.q_size // tp::config.head_dim] - config.q_size) // config.head_dim
        group = config.num_heads // config.num_kv_heads
        assert set((q_heads // group).tolist()) == set(kv_heads[:len(kv_heads) // 2].tolist())
    up = [up_rows(64, True, tp, r) for r in range(tp)]
    assert sorted(torch.cat(up).tolist()) == list(range(128))
    assert all(rows[:len(rows) // 2].max() < 64 <= rows[len(rows) // 2:].min() for rows in up)


@pytest.mark.parametrize("config, tp, sequence_parallel, message", [
    (LLAMA, 3, False, "tp 3 does not divide num_heads 8.*that fit this model: 1, 2, 4, 8"),
    (LLAMA.replace(num_heads=12, num_kv_heads=6, head_dim=4), 4, False,
     "tp 4 and num_kv_heads 6 do not fit"),
    (LLAMA.replace(num_heads=12, num_kv_heads=4, head_dim=4), 6, False,
     "tp 6 and num_kv_heads 4 do not fit"),
    (LLAMA.replace(vocab_size=66), 4, False, "pad the vocabulary to 68"),
    (LLAMA.replace(ffn_hidden_size=66), 4, False, "does not divide ffn_hidden_size 66"),
    (LLAMA, 4, True, "seq_len 10 is not a multiple of 4"),
])
def test_layouts_that_cannot_split_say_what_to_change(config, tp, sequence_parallel, message):
    with pytest.raises(ConfigError, match=message):
        check_tensor_parallel(config, tp, sequence_parallel, seq_len=10)
    with pytest.raises(ConfigError, match=message):  # before any communication
        apply_tensor_parallel(build_model(config), Group("tp", tuple(range(tp)), 0), Comm(),
                              sequence_parallel, seq_len=10)


def test_experts_are_kept_whole_so_their_ffn_need_not_divide():
    """Routed experts stay whole; the shared experts (2 x 66 units here) split like an MLP."""
    moe = preset("tiny-moe").replace(moe_ffn_hidden_size=66, ffn_hidden_size=66,
                                     num_shared_experts=2)
    check_tensor_parallel(moe, 4, True, seq_len=8)  # every layer is MoE: no dense MLP to split
    with pytest.raises(ConfigError, match="ffn_hidden_size 66"):
        check_tensor_parallel(moe.replace(num_dense_layers=1), 4)
    with pytest.raises(ConfigError, match="shared experts' 66 hidden units"):
        check_tensor_parallel(moe.replace(num_shared_experts=1), 4)


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_one_rank_is_the_single_process_model(sequence_parallel):
    """tp=1 runs without torch.distributed: same logits, loss and gradients as the model."""
    model = build_model(GPT2)
    parallel = build_model(GPT2)
    split = apply_tensor_parallel(parallel, Group("tp", (0,), 0), Comm(), sequence_parallel)
    tokens = batch(0, GPT2)
    logits = model(tokens[:, :-1])
    assert torch.equal(parallel(tokens[:, :-1]), logits)
    loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    tp_loss = split.loss(parallel(tokens[:, :-1]), tokens[:, 1:])
    assert tp_loss.item() == pytest.approx(loss.item(), rel=1e-6)
    loss.backward()
    tp_loss.backward()
    # What the data-parallel engine does with each bucket before reducing it.
    split.sum_partial_gradients({id(p): p.grad for p in parallel.parameters()})
    grads = {name: p.grad for name, p in parallel.named_parameters()}
    for name, param in model.named_parameters():
        assert relative_error(grads[name], param.grad) < 1e-5, name
    with pytest.raises(ConfigError, match="longer than max_seq_len 16"):
        parallel(torch.zeros(1, 17, dtype=torch.long))
