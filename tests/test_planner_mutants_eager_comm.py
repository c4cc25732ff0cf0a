"""The eager profile's collective calls counted by hand from the runtime's protocol (the module
doc of tetrad/planner/eager_comm.py): tensor parallelism's f and g around each block, the
embedding, head and vocab-parallel loss; sequence parallelism's gathers and scatters; context
parallelism's ring; a pipeline's sends; expert parallelism's all-to-alls; the tied embedding's
sum and the router loads. The precision is DDP's bf16 (fp32 stream, bf16 activations), so that
the stream's and the compute dtype's calls are told apart."""

from __future__ import annotations

from collections import Counter

import pytest

from tetrad.planner.eager_comm import rank_comm
from tetrad.planner.layout import TrainLayout
from tetrad.planner.precision import TrainingPrecision
from tetrad.spec.presets import preset

MIXED = TrainingPrecision("bf16", param_bytes=4, grad_bytes=4, master_bytes=0,
                          optimizer_bytes=8, activation_bytes=2)
TINY, TINY_MOE = preset("tiny"), preset("tiny-moe")
SEQ, MICRO = 16, 2
H, LAYERS = 64, 2


def _calls(config, layout, pp_rank=0, kinds=None, group=None) -> Counter:
    calls = rank_comm(config, layout, SEQ, MIXED, pp_rank).calls
    return Counter({key: count for key, count in calls.items()
                    if (kinds is None or key[0] in kinds) and (group is None or key[1] == group)})


@pytest.mark.parametrize("grad_accum", [1, 3])
def test_tensor_parallel_calls_of_a_step(grad_accum):
    """tp 2: per block two g forward (S_a) and two f backward (S_p); the embedding's all-reduce
    forward, the head's f backward (S_p); the loss's max and sums (fp32, T and 2T); the
    gradient norm's fp64 partial sum."""
    m, t = grad_accum, MICRO * SEQ
    s_p, s_a = t * H * 4, t * H * 2
    expected = Counter({("all_reduce", 2, s_a): LAYERS * 2 * m,
                        ("all_reduce", 2, s_p): LAYERS * 2 * m + 2 * m,
                        ("all_reduce", 2, t * 4): m, ("all_reduce", 2, 2 * t * 4): m,
                        ("all_reduce", 2, 8): 1})
    assert _calls(TINY, TrainLayout(tp=2, micro_batch=MICRO, grad_accum=grad_accum)) == expected


def test_sequence_parallel_calls_of_a_step():
    """Under SP f becomes an all-gather forward and a reduce-scatter backward of S_p, g a
    reduce-scatter forward and an all-gather backward of S_a; the embedding reduce-scatters
    forward and gathers backward, the head gathers forward and reduce-scatters backward."""
    m, t = 2, MICRO * SEQ
    s_p, s_a = t * H * 4, t * H * 2
    expected = Counter({("all_gather", 2, s_p): LAYERS * 2 * m + 2 * m,
                        ("reduce_scatter", 2, s_p): LAYERS * 2 * m + 2 * m,
                        ("reduce_scatter", 2, s_a): LAYERS * 2 * m,
                        ("all_gather", 2, s_a): LAYERS * 2 * m})
    layout = TrainLayout(tp=2, sequence_parallel=True, micro_batch=MICRO, grad_accum=m)
    assert _calls(TINY, layout, kinds=("all_gather", "reduce_scatter")) == expected


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_zero_bubble_and_recomputation_repeat_a_later_stage_collectives(recompute):
    """tp 2 x pp 2 under zero bubble: stage 1's backward collectives run twice (B and W), and
    full recomputation reruns each forward's f/g but the MLP's closing g once per backward
    walk; stage 0 walks backward once."""
    m, t = 4, MICRO * SEQ
    s_a = t * H * 2
    layout = TrainLayout(tp=2, pp=2, schedule="zb", microbatches=m, micro_batch=MICRO,
                         recompute=recompute)
    for pp_rank, walks in ((0, 1), (1, 2)):
        reruns = walks if recompute == "full" else 0
        # One block per stage: 2 exits each forward, 1 each rerun (the closing g is left).
        exits = m * (2 + reruns)
        assert _calls(TINY, layout, pp_rank)["all_reduce", 2, s_a] == exits


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("recompute", ["none", "full"])
def test_context_parallel_ring_sends(cp, recompute):
    """Ring attention per block and microbatch: cp - 1 K/V blocks forward (again for each
    recomputed forward) and as many backward, plus the fp32 dK/dV accumulators backward."""
    m = 3
    t = MICRO * SEQ // cp
    kv = 2 * t * TINY.num_kv_heads * TINY.head_dim
    forwards = 2 if recompute == "full" else 1
    layout = TrainLayout(cp=cp, micro_batch=MICRO, grad_accum=m, recompute=recompute)
    assert _calls(TINY, layout, kinds=("p2p",)) == Counter({
        ("p2p", 1, kv * 2): LAYERS * m * (cp - 1) * (forwards + 1),
        ("p2p", 1, kv * 4): LAYERS * m * (cp - 1)})


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_pipeline_stages_send_their_output_and_input_gradient(sequence_parallel):
    """Each stage sends its output forward (not the last) and its input's gradient backward (not
    the first), once per microbatch: the residual stream (1/tp of the tokens under SP)."""
    m, tp = 4, 2
    tokens = MICRO * SEQ // (tp if sequence_parallel else 1)
    layout = TrainLayout(pp=3, tp=tp, sequence_parallel=sequence_parallel, microbatches=m,
                         micro_batch=MICRO, stage_layers=(1, 2, 1))
    config = TINY.replace(num_layers=4)
    for pp_rank in range(3):
        sends = (pp_rank < 2) + (pp_rank > 0)
        assert _calls(config, layout, pp_rank, kinds=("p2p",)) == Counter(
            {("p2p", 1, tokens * H * 4): sends * m})


def test_expert_parallel_all_to_alls():
    """Per MoE block and microbatch: the per-expert counts (int64) forward, dispatch (the
    stream's dtype) and combine (the compute dtype) forward and again backward, each over the T k
    routed copies; and the experts' loss scalar over ep."""
    m, t, k, e = 2, MICRO * SEQ, TINY_MOE.num_experts_per_token, TINY_MOE.num_experts
    layout = TrainLayout(dp=2, ep=2, micro_batch=MICRO, grad_accum=m)
    assert _calls(TINY_MOE, layout, kinds=("all_to_all",)) == Counter({
        ("all_to_all", 2, e * 8): LAYERS * m,
        ("all_to_all", 2, t * k * H * 4): LAYERS * m * 2,
        ("all_to_all", 2, t * k * H * 2): LAYERS * m * 2})


@pytest.mark.parametrize("zero", [0, 2])
def test_tied_embedding_gradient_summed_between_its_pipeline_ranks(zero):
    """A tied embedding's two copies (first and last pipeline rank) sum their gradient once per
    step; ZeRO-2 sums each rank's padded shard of it."""
    config = TINY.replace(num_layers=4, tie_embeddings=True, vocab_size=257)
    dp = 3 if zero else 1
    layout = TrainLayout(pp=2, dp=dp, zero=zero, microbatches=2, micro_batch=MICRO)
    elements = config.vocab_size * H
    shard = -(-elements // dp) if zero else elements
    for pp_rank in range(2):
        assert _calls(config, layout, pp_rank, group=2)[("all_reduce", 2, shard * 4)] == 1


def test_router_loads_summed_over_data_ranks_for_aux_loss_free_balancing():
    """The routers' expert loads (fp32, one per expert and MoE layer) are summed over dp x cp
    after each step when the bias update is on, and not otherwise."""
    balanced = TINY_MOE.replace(router_score="sigmoid", router_bias_update_rate=1e-3)
    layout = TrainLayout(dp=2, cp=2, micro_batch=MICRO)
    loads = ("all_reduce", 4, LAYERS * TINY_MOE.num_experts * 4)
    assert _calls(balanced, layout)[loads] == 1
    assert _calls(balanced.replace(router_bias_update_rate=0.0), layout)[loads] == 0


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_partial_gradients_summed_over_tp_once_per_reduction(zero):
    """Under SP every norm's gradient is partial on a tp rank (it saw a shard of the tokens):
    tp sums them just before the gradient reduction that carries them, one call per DDP or
    ZeRO-1/2 bucket (tiny: one), per microbatch under ZeRO-2, per ZeRO-3 unit (each block's two
    norms; the final norm in the head's unit) every microbatch."""
    m, t = 3, SEQ
    layout = TrainLayout(tp=2, sequence_parallel=True, dp=3, zero=zero, grad_accum=m)
    calls = Counter({key: count for key, count in _calls(TINY, layout, kinds=("all_reduce",),
                                                          group=2).items()
                     if key[2] > 2 * t * 4})
    norms = H * 4
    if zero == 3:
        expected = Counter({("all_reduce", 2, 2 * norms): LAYERS * m,
                            ("all_reduce", 2, norms): m})
    else:
        expected = Counter({("all_reduce", 2, (2 * LAYERS + 1) * norms): m if zero == 2 else 1})
    assert calls == expected
