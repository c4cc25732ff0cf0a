"""The serving engine: `LLM(path).generate(prompts, SamplingParams(...))`, a streaming iterator, and
the add_request / step / abort interface the server drives from its engine thread.

One step = schedule (scheduler.py) -> run the model over the paged cache (runner.py) -> sample
(sampler.py) -> append tokens, detokenize, stop, retire finished sequences. With tp > 1 the model
step runs on tp ranks (tp.py); everything else stays in this process.
"""

from __future__ import annotations

import copy
import itertools
import json
import queue
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from tetrad.config import from_dict
from tetrad.errors import ConfigError
from tetrad.inference.block_manager import BlockManager
from tetrad.inference.config import EngineConfig
from tetrad.inference.kv_cache import TORCH_DTYPES, check_tokenizer_fits, resolve_dtype
from tetrad.inference.metrics import EngineMetrics
from tetrad.inference.output import CompletionOutput, Detokenizer, RequestOutput
from tetrad.inference.params import SamplingParams
from tetrad.inference.runner import StepPlan, load_runner
from tetrad.inference.sampler import Sampler
from tetrad.inference.scheduler import Scheduler, SchedulerConfig
from tetrad.inference.sequence import Sequence
from tetrad.inference.tp import TensorParallelDriver


class _Request:
    def __init__(self, request_id: str, prompt: str | None, prompt_ids: list[int],
                 params: SamplingParams, tokenizer):
        self.params = params
        self.output = RequestOutput(request_id, prompt, prompt_ids,
                                    [CompletionOutput(i) for i in range(params.n)],
                                    arrival_time=time.perf_counter())
        self.detokenizers = [Detokenizer(tokenizer, params) for _ in range(params.n)]
        self.num_finished = 0


class LLM:
    def __init__(self, model: str | Path | nn.Module, tokenizer=None, *, log=print,
                 **engine_config):
        """model: an HF folder, a tetrad checkpoint folder, or a tetrad Transformer (tests).
        tokenizer: anything with encode / decode / eos_id; by default the model folder's.
        With tp > 1 the engine starts tp - 1 more processes (or joins a process group of tp
        ranks: see tetrad.inference.tp); close() stops them."""
        config = from_dict(EngineConfig, engine_config)
        self.eos_token_ids: tuple[int, ...] = ()
        self.path = None if isinstance(model, nn.Module) else Path(model)
        device = torch.device("cuda" if config.device == "auto" and torch.cuda.is_available()
                              else "cpu" if config.device == "auto" else config.device)
        if isinstance(model, nn.Module):
            if tokenizer is None:
                raise ConfigError("pass a tokenizer along with a model object")
            config = replace(config, dtype=resolve_dtype(config.dtype, model))
        else:
            import tetrad

            path = Path(model)
            folder_tokenizer = tokenizer is None
            tokenizer = tokenizer or tetrad.load_tokenizer(path)
            self.eos_token_ids = _config_eos_ids(path)
            config = replace(config, dtype=resolve_dtype(config.dtype, path))
            # Tensor-parallel ranks split the model on the host, then move their share.
            model = tetrad.load_pretrained(path, device if config.tp == 1 else "cpu",
                                           TORCH_DTYPES[config.dtype])
            if folder_tokenizer:
                check_tokenizer_fits(tokenizer, model.config.vocab_size)
        self.config = config
        self.tokenizer = tokenizer
        if getattr(tokenizer, "eos_id", None) is not None:
            self.eos_token_ids = tuple(sorted({*self.eos_token_ids, tokenizer.eos_id}))
        self.model_config = model.config
        # A vocabulary rounded up past the tokenizer's: sample only ids the tokenizer decodes.
        self.num_sampleable = min(model.config.vocab_size,
                                  getattr(tokenizer, "vocab_size", model.config.vocab_size))
        self.max_model_len = min(config.max_model_len or model.config.max_seq_len,
                                 model.config.max_seq_len)
        self.tp: TensorParallelDriver | None = None
        if config.tp > 1:
            # The driver splits the model in place: the caller's model object stays whole. The
            # other ranks load the folder themselves, or get the model object pickled.
            source = model if self.path is None else str(self.path)
            self.tp = TensorParallelDriver(copy.deepcopy(model) if self.path is None else model,
                                           source, config, self.max_model_len)
            self.runner, plan = self.tp.runner, self.tp.kv_plan
            self._execute = self.tp.execute
        else:
            self.runner, plan = load_runner(model, config, self.max_model_len, device)
            self._execute = self.runner.execute
        self.model = self.runner.model
        self.kv_plan = plan
        if log:
            log(plan.describe())
        self.block_manager = BlockManager(plan.num_blocks, plan.block_size, plan.num_cpu_blocks,
                                          config.enable_prefix_caching, config.watermark)
        self.scheduler = Scheduler(SchedulerConfig(config.max_num_seqs,
                                                   config.max_num_batched_tokens,
                                                   self.max_model_len, config.preemption),
                                   self.block_manager)
        self.sampler = Sampler(config.seed)
        self.requests: dict[str, _Request] = {}
        self._incoming: queue.SimpleQueue = queue.SimpleQueue()  # _Requests from any thread
        self._aborts: queue.SimpleQueue = queue.SimpleQueue()
        self._ids = itertools.count()
        self.metrics = EngineMetrics()
        self.peak_blocks_used = 0

    # ---- requests (callable from any thread) ---------------------------------------------------

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Queue a request for the next step; raises RequestRejected / ConfigError at once if it
        could never run."""
        params = params or SamplingParams()
        if isinstance(prompt, str):
            text, prompt_ids = prompt, self.tokenizer.encode(prompt)
        else:
            text, prompt_ids = None, [int(token) for token in prompt]
        vocab = self.model_config.vocab_size
        if any(not 0 <= token < vocab for token in prompt_ids):
            raise ConfigError(f"prompt token ids must be in 0..{vocab - 1} (the model's vocab)")
        request_id = request_id or f"req-{next(self._ids)}"
        params = self.scheduler.validate(len(prompt_ids), params)
        self._incoming.put(_Request(request_id, text, prompt_ids, params, self.tokenizer))
        return request_id

    def abort(self, request_id: str) -> None:
        """Stop a request and free its blocks at the next step (a client that went away)."""
        self._aborts.put(request_id)

    def has_unfinished(self) -> bool:
        return bool(self.requests) or not self._incoming.empty()

    # ---- one step (the engine thread) ----------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one step; the outputs of the requests it advanced (each with this step's deltas)."""
        touched: dict[str, _Request] = {}
        self._take_new_and_aborted(touched)
        batch = self.scheduler.schedule()
        self.peak_blocks_used = max(self.peak_blocks_used, self.block_manager.num_used_blocks)
        if batch.seqs:
            logits = self._execute(StepPlan.from_batch(batch, self.kv_plan.block_size))
            to_sample = self.scheduler.advance(batch)
            rows = [row for _, row in to_sample]
            seqs = [seq for seq, _ in to_sample]
            if rows != list(range(len(logits))):  # forked samples share their parent's row
                logits = logits[torch.tensor(rows, device=logits.device)]
            # The step's one device-to-host copy: the sampled ids.
            tokens = (self.sampler(logits[:, :self.num_sampleable], seqs).token_ids.tolist()
                      if seqs else [])
            self.scheduler.append_tokens(list(zip(seqs, tokens)), self.eos_token_ids)
            now = time.perf_counter()
            for seq, token in zip(seqs, tokens):
                self._record(seq, [token], now, touched)
            self.metrics.record_step(len(tokens), now)
        for request in touched.values():
            if request.output.finished:
                del self.requests[request.output.request_id]
                self.metrics.record_finished(request.output)
        return [request.output for request in touched.values()]

    def _take_new_and_aborted(self, touched: dict[str, _Request]) -> None:
        for request in iter_queue(self._incoming):
            self.requests[request.output.request_id] = request
            self.scheduler.add_request(request.output.request_id, request.output.prompt_token_ids,
                                       request.params)
        for request_id in iter_queue(self._aborts):
            request = self.requests.get(request_id)
            if request is None:
                continue
            now = time.perf_counter()
            for seq in self.scheduler.abort(request_id):
                self._record(seq, [], now, touched)
            for completion in request.output.outputs:  # samples not forked yet
                if completion.finish_reason is None:
                    self._finish(request, completion, "abort", now)
            touched[request_id] = request

    def _record(self, seq: Sequence, tokens: list[int], now: float,
                touched: dict[str, _Request]) -> None:
        request = self.requests[seq.request_id]
        output = request.output
        completion = output.outputs[seq.index]
        if output.request_id not in touched:
            for each in output.outputs:
                each.delta_text, each.delta_token_ids = "", []
            touched[output.request_id] = request
        if tokens and output.first_token_time is None:
            output.first_token_time = now
            output.num_cached_tokens = seq.num_cached_tokens
        completion.token_ids += tokens
        completion.delta_token_ids += tokens
        delta, stopped = request.detokenizers[seq.index].add(tokens, final=seq.is_finished)
        if stopped and not seq.is_finished:
            self.scheduler.finish(seq, "stop")
        completion.delta_text += delta
        completion.text = request.detokenizers[seq.index].text
        if seq.is_finished:
            self._finish(request, completion, seq.finish_reason, now)

    def _finish(self, request: _Request, completion: CompletionOutput, reason: str,
                now: float) -> None:
        completion.finish_reason = reason
        request.num_finished += 1
        if request.num_finished == len(request.output.outputs):
            request.output.finished = True
            request.output.finish_time = now

    # ---- tensor-parallel ranks -----------------------------------------------------------------

    @property
    def failure(self) -> BaseException | None:
        """Why the tensor-parallel ranks stopped (the engine cannot step again), or None."""
        return None if self.tp is None else self.tp.failure

    def close(self) -> None:
        """Stop the other tensor-parallel ranks (nothing to do with tp=1); no step after this."""
        if self.tp is not None:
            self.tp.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    # ---- state ---------------------------------------------------------------------------------

    def kv_utilization(self) -> float:
        """Tokens stored / slots reserved in the blocks running sequences hold (shared blocks
        count once): only the last block of each sequence has free slots."""
        size, filled = self.block_manager.block_size, {}
        for seq in self.scheduler.running:
            for i, block_id in enumerate(seq.block_table):
                stored = min(size, seq.num_computed_tokens - i * size)
                filled[block_id] = max(filled.get(block_id, 0), stored)
        return sum(filled.values()) / (len(filled) * size) if filled else 1.0

    def stats(self) -> dict[str, float]:
        manager, scheduler = self.block_manager, self.scheduler
        return {"running": len(scheduler.running), "waiting": len(scheduler.waiting),
                "swapped": len(scheduler.swapped), "preemptions": scheduler.num_preemptions,
                "kv_blocks_used": manager.num_used_blocks, "kv_blocks_total": manager.num_blocks,
                "kv_utilization": self.kv_utilization(),
                "prefix_cache_hit_rate": (manager.num_prefix_hits
                                          / max(1, manager.num_prefix_queries))}

    def metrics_text(self) -> str:
        """Prometheus text for /metrics."""
        stats = self.stats()
        gauges = {f"tetrad_{name}": (f"{name.replace('_', ' ').capitalize()}.", stats[name])
                  for name in stats if name != "preemptions"}
        counters = {"tetrad_preemptions_total": ("Sequences preempted (recompute or swap).",
                                                 stats["preemptions"])}
        return self.metrics.render(gauges, counters)

    # ---- convenience ---------------------------------------------------------------------------

    def generate(self, prompts: str | list[int] | list, params: SamplingParams | list | None = None
                 ) -> list[RequestOutput]:
        """Run prompts (strings or token-id lists) to completion; outputs in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        ids = [self.add_request(prompt, p) for prompt, p in zip(prompts, params_list)]
        done: dict[str, RequestOutput] = {}
        while len(done) < len(ids):
            for output in self.step():
                if output.finished:
                    done[output.request_id] = output
        return [done[request_id] for request_id in ids]

    def stream(self, prompt: str | list[int], params: SamplingParams | None = None
               ) -> Iterator[RequestOutput]:
        """Yield the request's output after every step that advanced it (read `delta_text`).
        Closing the iterator early aborts the request and frees its blocks."""
        request_id = self.add_request(prompt, params)
        finished = False
        try:
            while not finished:
                for output in self.step():
                    if output.request_id == request_id:
                        finished = output.finished
                        yield output
        finally:
            if not finished:
                self.abort(request_id)
                self.step()


def iter_queue(items: queue.SimpleQueue) -> Iterator:
    while True:
        try:
            yield items.get_nowait()
        except queue.Empty:
            return


def _config_eos_ids(folder: Path) -> tuple[int, ...]:
    """End-of-sequence ids an HF folder's config.json / generation_config.json name."""
    ids: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        file = folder / name
        if folder.is_dir() and file.is_file():
            value = json.loads(file.read_text()).get("eos_token_id")
            ids.update(value if isinstance(value, list) else [] if value is None else [value])
    return tuple(sorted(ids))
