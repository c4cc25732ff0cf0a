"""The `tetrad` runtime profile: what tetrad's own trainer holds and sends, counted tensor by tensor
on every rank of its layout.

The planner's default accounting (`runtime="megatron"`, memory.py) is Korthikanti et al.'s for
Megatron-LM's fused kernels, the stack behind the published figures it is calibrated on. `tetrad
train` runs tetrad's Transformer (tetrad/models) under eager PyTorch autograd instead, and that
keeps different tensors for backward. This profile lists them, op by op, as PyTorch 2.13's
kernels save them (the run report's ActivationMeter counts exactly these storages), with T the
tokens one rank's matmuls see per microbatch (micro_batch * seq_len / cp), T_s those of the
residual stream (T / tp under sequence parallelism), h hidden, q/kv the query and key-value widths
and f the FFN width on the rank (1/tp of the heads and units), V the vocabulary rows on the rank
(V / tp), a the bytes of the compute (autocast) dtype and p those of the parameters (fp32 under
autocast, the compute dtype under ZeRO), which is also the dtype of the residual stream:

  RMSNorm (fp32 math)  its fp32 input (a copy when the stream is 16-bit), the fp32 reciprocal RMS
                       per token, the normalized values in the stream's dtype: T_s(4h + 4 + ph)
  LayerNorm            input, mean, rstd, in the stream's dtype: T_s p (h + 2)
  every matmul         its input in the compute dtype (under SP the gathered sequence, T tokens);
                       under autocast also a copy of its weight in the compute dtype (autocast
                       casts each fp32 weight once per forward; 16-bit ones are used as they are)
  rotary               new q and k (T(q + kv)a), and the cos/sin tables (2 (s/cp) d_head fp32,
                       once per stage forward)
  SDPA (flash kernel)  q, k, v (v is a view of the fused QKV output, which it keeps whole: T(q +
                       2kv)a), the output T q a (also the output projection's input) and the
                       fp32 log-sum-exp T heads 4; selective recomputation drops the latter
  ring attention (cp)  the same (its log-sum-exp kept under selective recomputation too), and
                       the output projection gets a copy of the output in token order: T q a
  SwiGLU               the fused gate+up output (2Tfa, viewed by silu and the product), silu's
                       output Tfa, the product Tfa (the down projection's input); GELU 2Tfa
  residual adds, TP's f/g and SP's gathers: nothing of their own
  loss                 cross-entropy's fp32 log-probabilities (4TV, not the logits), the int64
                       targets, its 4-byte weight total; vocab-parallel: this rank's fp32
                       softmax 4TV, its int64 targets and the bool mask of those it holds
  token ids            the embedding's: views of the rank's batch of the step [batch, s + 1]
                       int64 (a pipeline's or context parallelism's microbatch is a copy, 8T; a
                       vocab-parallel embedding keeps its shifted ids and a bool mask, 9T); learned
                       positions keep the positions looked up (int64)
  MoE router           softmax probabilities 4TE, top-k indices 8Tk and weights 4Tk, their sum 4T,
                       the routed fraction 4E (aux loss)
  MoE, per routed copy (Tk of them; dropless, so the total does not depend on the routing):
                       two int64 indices (five under ep: three where the token lives, two where
                       its expert does), its gate weight and the contribution in the stream's
                       dtype p(1 + h), the expert's input, MLP and output in the compute dtype; a
                       second cast of the router's input for the shared expert under autocast
  full recomputation   each block keeps its input alone, T_s h p (the recomputed forward runs in
                       backward, where the meter does not look)

With a pipeline each stage keeps this per microbatch, the first stage the token ids, the last
the final norm, head and loss; a rank's peak is the sum over the microbatches its schedule has in
flight at once (forward to backward, to W under zero bubble), walked through its action list.

Model state (eager_state), communication (eager_comm) and the tensors each rank holds
(eager_params) have modules of their own. The profile covers every layout tetrad's runtime
trains: data parallelism and ZeRO 0-3 (offload) alone or under any pipeline schedule, tensor
(sequence), context and expert parallelism, recomputation, gradient accumulation. Measured on CPU
(gloo): every count equals the run report's measurement on every rank (tests/test_report.py,
test_report_layouts.py), except what routing decides under expert parallelism, taken as a
balanced router sends it: each rank's share of the routed copies (their sum over the ep group is
exact) and how many cross ranks; and on CPU a data-parallel rank's token ids without a pipeline,
tp or cp, views of the whole global batch there (the profile counts the rank's rows, what a GPU
rank copies). Left out: an expert that receives no token skips its weight casts under autocast;
CUDA's attention and norm kernels may save slightly different statistics.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

from tetrad.spec.model import ModelConfig
from tetrad.planner.comm import CommLedger
from tetrad.planner.eager_activations import activations_peak
from tetrad.planner.eager_buffers import activation_buffer_bytes, zero_buffer_bytes
from tetrad.planner.eager_comm import rank_comm
from tetrad.planner.eager_state import ModelState, model_state
from tetrad.planner.layout import TrainLayout, with_runtime_cut
from tetrad.planner.precision import TrainingPrecision


@dataclass(frozen=True)
class RankBytes:
    """One rank's model state, activation peak and bytes sent per step."""

    state: ModelState
    activations: float
    comm: CommLedger = field(compare=False)
    zero_buffers: float = 0.0  # ZeRO-R's buffers (eager_buffers)
    activation_buffer: float = 0.0
    host_activations: float = 0.0  # --offload-activations: kept block inputs, not in the total

    @property
    def total(self) -> float:
        return (self.state.params + self.state.grads + self.state.optimizer
                + self.activations + self.zero_buffers + self.activation_buffer)


@lru_cache(maxsize=256)
def pipeline_ranks(config: ModelConfig, layout: TrainLayout, seq_len: int,
                   precision: TrainingPrecision) -> tuple[RankBytes, ...]:
    """What one rank of each pipeline rank holds and sends (every tp, cp and dp rank of a
    pipeline rank alike, up to the routing), with the stages the run cuts."""
    layout = with_runtime_cut(config, layout, seq_len)
    return tuple(RankBytes(model_state(config, layout, precision, rank),
                           activations_peak(config, layout, seq_len, precision, rank),
                           rank_comm(config, layout, seq_len, precision, rank),
                           zero_buffer_bytes(config, layout, precision, rank),
                           activation_buffer_bytes(config, layout, seq_len, precision, rank),
                           activations_peak(config, layout, seq_len, precision, rank, host=True))
                 for rank in range(layout.pp))
