"""Serving metrics: per-request latencies (TTFT, TPOT, end to end), token counts and throughput,
rendered in Prometheus' text format for `/metrics`, and summarized as percentiles for reports and
benchmarks. Plain Python."""

from __future__ import annotations

import time
from collections import deque

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0,
                   2.5, 5.0, 7.5, 10.0, 30.0, 60.0)
THROUGHPUT_WINDOW_S = 10.0


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100); 0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))]


class Histogram:
    """Prometheus bucket counts over all observations, and the latest ones kept for percentiles."""

    def __init__(self, name: str, help_text: str, keep: int = 10000):
        self.name, self.help = name, help_text
        self.bucket_counts = [0] * len(LATENCY_BUCKETS)
        self.count, self.sum = 0, 0.0
        self.values: deque[float] = deque(maxlen=keep)

    def observe(self, value: float) -> None:
        self.count += 1
        self.sum += value
        self.values.append(value)
        for index, bound in enumerate(LATENCY_BUCKETS):
            if value <= bound:
                self.bucket_counts[index] += 1

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        lines += [f'{self.name}_bucket{{le="{bound}"}} {count}'
                  for bound, count in zip(LATENCY_BUCKETS, self.bucket_counts)]
        return lines + [f'{self.name}_bucket{{le="+Inf"}} {self.count}',
                        f"{self.name}_sum {self.sum}", f"{self.name}_count {self.count}"]

    def summary(self) -> dict[str, float]:
        values = list(self.values)
        return {f"p{q}": percentile(values, q) for q in (50, 90, 99)}


class EngineMetrics:
    def __init__(self):
        self.ttft = Histogram("tetrad_time_to_first_token_seconds", "Time to first token.")
        self.tpot = Histogram("tetrad_time_per_output_token_seconds",
                              "Time per output token after the first.")
        self.e2e = Histogram("tetrad_e2e_request_latency_seconds", "Request latency.")
        self.num_prompt_tokens = 0
        self.num_generated_tokens = 0
        self.num_finished_requests = 0
        self._recent: deque[tuple[float, int]] = deque()  # (time, tokens) of recent steps

    def record_step(self, num_tokens: int, now: float | None = None) -> None:
        now = time.perf_counter() if now is None else now
        self.num_generated_tokens += num_tokens
        self._recent.append((now, num_tokens))
        while self._recent and self._recent[0][0] < now - THROUGHPUT_WINDOW_S:
            self._recent.popleft()

    def tokens_per_second(self, now: float | None = None) -> float:
        now = time.perf_counter() if now is None else now
        recent = [tokens for moment, tokens in self._recent if moment >= now - THROUGHPUT_WINDOW_S]
        return sum(recent) / THROUGHPUT_WINDOW_S

    def record_finished(self, output) -> None:
        """output: a finished RequestOutput."""
        self.num_finished_requests += 1
        self.num_prompt_tokens += len(output.prompt_token_ids)
        self.e2e.observe(output.finish_time - output.arrival_time)
        if output.first_token_time is None:
            return  # aborted before its first token
        self.ttft.observe(output.first_token_time - output.arrival_time)
        num_tokens = max(len(completion.token_ids) for completion in output.outputs)
        if num_tokens > 1:
            self.tpot.observe((output.finish_time - output.first_token_time) / (num_tokens - 1))

    def prometheus(self, stats: dict[str, float]) -> str:
        """Prometheus text for /metrics, with the engine's state (engine_stats) as gauges."""
        gauges = {f"tetrad_{name}": (f"{name.replace('_', ' ').capitalize()}.", stats[name])
                  for name in stats if name != "preemptions"}
        counters = {"tetrad_preemptions_total": ("Sequences preempted (recompute or swap).",
                                                 stats["preemptions"])}
        return self.render(gauges, counters)

    def render(self, gauges: dict[str, tuple[str, float]],
               counters: dict[str, tuple[str, float]]) -> str:
        """Prometheus text format; gauges and counters: name -> (help, value) from the caller."""
        counters = {
            "tetrad_prompt_tokens_total": ("Prompt tokens of finished requests.",
                                           self.num_prompt_tokens),
            "tetrad_generation_tokens_total": ("Generated tokens.", self.num_generated_tokens),
            "tetrad_requests_finished_total": ("Finished requests.", self.num_finished_requests),
            **counters}
        gauges = {"tetrad_generation_tokens_per_second": (
            f"Generated tokens per second over the last {THROUGHPUT_WINDOW_S:g} s.",
            self.tokens_per_second()), **gauges}
        lines = []
        for kind, metrics in (("counter", counters), ("gauge", gauges)):
            for name, (help_text, value) in metrics.items():
                lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name} {value}"]
        for histogram in (self.ttft, self.tpot, self.e2e):
            lines += histogram.render()
        return "\n".join(lines) + "\n"


def kv_utilization(scheduler, block_manager) -> float:
    """Tokens stored / slots reserved in the blocks running sequences hold (shared blocks count
    once): only the last block of each sequence has free slots. A data-parallel scheduler's
    ranks each number their own blocks: they are counted rank by rank."""
    size, filled = block_manager.block_size, {}
    for rank, each in enumerate(getattr(scheduler, "schedulers", [scheduler])):
        for seq in each.running:
            for i, block_id in enumerate(seq.block_table):
                stored = min(size, seq.num_computed_tokens - i * size)
                filled[rank, block_id] = max(filled.get((rank, block_id), 0), stored)
    return sum(filled.values()) / (len(filled) * size) if filled else 1.0


def engine_stats(scheduler, block_manager) -> dict[str, float]:
    """Sequences by state, preemptions, KV blocks and the prefix-cache hit rate. Read it where
    the steps run: the scheduler's lists change during a step."""
    return {"running": len(scheduler.running), "waiting": len(scheduler.waiting),
            "swapped": len(scheduler.swapped), "preemptions": scheduler.num_preemptions,
            "kv_blocks_used": block_manager.num_used_blocks,
            "kv_blocks_total": block_manager.num_blocks,
            "kv_utilization": kv_utilization(scheduler, block_manager),
            "prefix_cache_hit_rate": (block_manager.num_prefix_hits
                                      / max(1, block_manager.num_prefix_queries))}
