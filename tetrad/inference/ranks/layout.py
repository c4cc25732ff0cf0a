"""Which serving layouts (tetrad.spec.serving.ServeLayout: tensor (tp), pipeline (pp), expert (ep)
and data (dp) parallelism) the engine runs: the one place that says so.

The layouts are the planner's (tetrad.planner.serving, `tetrad plan serve`):
  tp x pp        ranks = tp * pp; stages own consecutive layers (the planner's stage_layer_counts),
                 each split over its tp ranks; one scheduler on rank 0 (tetrad.inference.ranks.pipeline);
                 with ep = tp each tp rank keeps whole experts (tetrad.inference.worker.tensor_experts)
  dp, ep | dp    attention data parallelism: every rank owns its requests and KV pool and holds the
                 dense weights whole; with ep > 1 the MoE layers' routed experts are spread over
                 each group of ep ranks (all of them when ep = dp) and tokens travel to them by
                 all-to-all (tetrad.inference.ranks.data_parallel); ep = 1 is plain replicas
Experts over part of a tensor-parallel group (1 < ep < tp), ep beyond tp with tp > 1, and dp beside
tp or pp are what the planner can also model; the engine refuses them here, with the layout it can
run instead.

Plain Python: the planner's rules need no torch.
"""

from __future__ import annotations

from tetrad.errors import ConfigError
from tetrad.planner.layout import stage_layer_counts
from tetrad.planner.memory import kv_bytes_per_token
from tetrad.planner.precision import element_bytes
from tetrad.planner.rules import check_degrees, check_runtime_model
from tetrad.planner.serving import weight_bytes_per_gpu
from tetrad.spec.model import ModelConfig
from tetrad.spec.serving import ServeLayout


def check_servable(layout: ServeLayout, config: ModelConfig) -> None:
    """Raise ConfigError (one line: what is wrong and what to run instead) when the engine
    cannot serve `config` under `layout`. The engine calls it before any weight is read or any
    rank starts (the degrees are positive: ServeLayout)."""
    check_runtime_model(config)  # a block the engine's layers do not build would serve wrong
    tp, pp, ep, dp, world = layout.tp, layout.pp, layout.ep, layout.dp, layout.world_size
    if dp > 1 and (tp > 1 or pp > 1):
        raise ConfigError(f"--dp {dp} with --tp {tp} --pp {pp}: data-parallel serving runs with "
                          f"tp 1 and pp 1 (--dp {world} --ep {world} for experts over all "
                          f"ranks)")
    if tp > 1 and ep not in (1, tp):
        raise ConfigError(f"--ep {ep} with --tp {tp}: experts spread inside a tensor-parallel "
                          f"group need --ep {tp} (whole experts on each tp rank) or --ep 1")
    if tp == 1 and dp % ep:
        raise ConfigError(f"--ep {ep} needs --dp {ep} (or a multiple): experts are spread over "
                          f"groups of ep attention data-parallel ranks (tp 1, pp 1), the "
                          f"planner's throughput layout; or --tp {ep}")
    # The engine splits with training's tensor-parallel layers (MLA by heads, each rank's KV pool
    # holding the whole latent): training's rules, kv heads replicated past their count.
    check_degrees(config, tp, pp, ep, training=True, kv_replicas=True, runtime=True)


def planned_bytes(layout: ServeLayout, config: ModelConfig, dtype: str,
                  stage: int) -> dict[str, float]:
    """What the planner predicts one rank of pipeline stage `stage` holds, with weights and KV
    cache in `dtype`: its weight bytes and KV-cache bytes per token (rank_share.held_bytes counts
    the same on a running engine)."""
    layers = stage_layer_counts(config.num_layers, layout.pp)[stage]
    return {"weights": weight_bytes_per_gpu(config, layout, dtype, stage),
            "kv_per_token": kv_bytes_per_token(config, element_bytes(dtype), layout.tp, layers)}
