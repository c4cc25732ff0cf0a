"""How a served model is split over processes: tensor (tp), pipeline (pp), expert (ep) and data
(dp) parallelism, and the one place that says which combinations the engine runs.

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

from dataclasses import dataclass

from tetrad.spec.model import ModelConfig
from tetrad.errors import ConfigError
from tetrad.planner.layout import stage_layer_counts
from tetrad.planner.memory import kv_bytes_per_token
from tetrad.planner.precision import element_bytes
from tetrad.planner.rules import check_degrees
from tetrad.planner.serving import ServeLayout, weight_bytes_per_gpu


@dataclass(frozen=True)
class ServingLayout:
    tp: int = 1
    pp: int = 1
    ep: int = 1
    dp: int = 1

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    def planner_layout(self) -> ServeLayout:
        return ServeLayout(tp=self.tp, pp=self.pp, dp=self.dp, ep=self.ep)

    def describe(self) -> str:
        return " ".join(f"{name}{getattr(self, name)}" for name in ("tp", "pp", "ep", "dp")
                        if getattr(self, name) > 1) or "one process"

    def check(self, config: ModelConfig) -> None:
        """Raise ConfigError (one line: what is wrong and what to run instead) when the engine
        cannot serve `config` under this layout (the degrees are positive: EngineConfig)."""
        if self.dp > 1 and (self.tp > 1 or self.pp > 1):
            raise ConfigError(f"--dp {self.dp} with --tp {self.tp} --pp {self.pp}: data-parallel "
                              f"serving runs with tp 1 and pp 1 (--dp {self.world_size} "
                              f"--ep {self.world_size} for experts over all ranks)")
        if self.tp > 1 and self.ep not in (1, self.tp):
            raise ConfigError(f"--ep {self.ep} with --tp {self.tp}: experts spread inside a "
                              f"tensor-parallel group need --ep {self.tp} (whole experts on each "
                              f"tp rank) or --ep 1")
        if self.tp == 1 and self.dp % self.ep:
            raise ConfigError(f"--ep {self.ep} needs --dp {self.ep} (or a multiple): experts are "
                              f"spread over groups of ep attention data-parallel ranks (tp 1, "
                              f"pp 1), the planner's throughput layout; or --tp {self.ep}")
        # The engine splits with training's tensor-parallel layers (MLA by heads, each rank's
        # KV pool holding the whole latent): training's rules, kv heads replicated past their
        # count.
        check_degrees(config, self.tp, self.pp, self.ep, training=True, kv_replicas=True,
                      runtime=True)

    def planned_bytes(self, config: ModelConfig, dtype: str, stage: int) -> dict[str, float]:
        """What the planner predicts one rank of pipeline stage `stage` holds, with weights and
        KV cache in `dtype`: its weight bytes and KV-cache bytes per token (rank_share.held_bytes
        counts the same on a running engine)."""
        layers = stage_layer_counts(config.num_layers, self.pp)[stage]
        return {"weights": weight_bytes_per_gpu(config, self.planner_layout(), dtype, stage),
                "kv_per_token": kv_bytes_per_token(config, element_bytes(dtype), self.tp, layers)}
