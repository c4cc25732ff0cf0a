"""The serving engine: `LLM(path).generate(prompts, SamplingParams(...))`, a streaming iterator, and
the add_request / step / abort interface the server drives from its engine thread.

One step = schedule (scheduler.py) -> run the model over the paged cache (runner.py) -> sample
(sampler.py) -> append tokens, detokenize, stop, retire finished sequences. With more than one
rank (tp, pp, ep, dp: layout.py) the model step runs on all of them (ranks.py) and, with dp > 1,
each dp rank has a scheduler of its own here (data_parallel.py); everything else stays in this
process.
"""

from __future__ import annotations

import copy
import itertools
import json
import time
import traceback
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from tetrad.spec.model import from_dict
from tetrad.errors import ConfigError
from tetrad.inference.core.block_manager import BlockManager
from tetrad.inference.worker.config import EngineConfig, serving_device
from tetrad.inference.worker.kv_cache import TORCH_DTYPES, check_tokenizer_fits, resolve_dtype
from tetrad.inference.ranks.layout import check_servable
from tetrad.inference.worker.logprobs import (logits_layout, prompt_logprobs, sample_rows,
                                       sampled_logprobs)
from tetrad.inference.core.metrics import EngineMetrics, engine_stats, kv_utilization
from tetrad.inference.core.output import RequestOutput, TokenLogprob
from tetrad.inference.core.params import RequestFailed, SamplingParams
from tetrad.inference.worker.runner import StepPlan, load_runner
from tetrad.inference.worker.sampler import Sampler
from tetrad.inference.core.scheduler import Scheduler, SchedulerConfig
from tetrad.inference.core.sequence import Sequence
from tetrad.inference.core.tracker import RequestTracker
from tetrad.models.hf import load_pretrained, pretrained_config
from tetrad.models.host_memory import large_blocks_mapped
from tetrad.models.quant_store import stored_quantization
from tetrad.spec.hf import resolve_checkpoint
from tetrad.planner.quantized import check_quantizable

if TYPE_CHECKING:
    # Multi-rank serving only: they bring torch.distributed's compiler stack (torch._dynamo,
    # sympy: ~75 MB resident), which one process on one device never uses.
    from tetrad.inference.ranks.driver import ServingDriver


class LLM:
    def __init__(self, model: str | Path | nn.Module, tokenizer=None, *, log=print,
                 **engine_config):
        """model: an HF folder, a tetrad checkpoint folder, or a tetrad Transformer (tests).
        tokenizer: anything with encode / decode / eos_id; by default the model folder's.
        With tp*pp*dp > 1 the engine starts that many processes less one (or joins a process
        group of that many ranks: see tetrad.inference.ranks.driver); close() stops them.
        Whatever needs no weights (the settings, the layout against the model, the device, the
        tokenizer's fit) is checked before any weight is read or any rank starts."""
        config = from_dict(EngineConfig, engine_config)
        device = serving_device(config.device, config.world_size)
        self.path = None if isinstance(model, nn.Module) else Path(model)
        model_config = model.config if self.path is None else pretrained_config(self.path)
        config = _with_stored_quantization(config, model if self.path is None else self.path)
        check_servable(config, model_config)
        check_quantizable(model_config, config, config.quantization)
        self.max_model_len = min(config.max_model_len or model_config.max_seq_len,
                                 model_config.max_seq_len)
        scheduling = SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens,
                                     self.max_model_len, config.preemption)
        self.eos_token_ids: tuple[int, ...] = ()
        self.tokenizer = self._tokenizer(tokenizer, model_config)
        if self.path is not None:
            self.eos_token_ids = _config_eos_ids(self.path)
        if getattr(self.tokenizer, "eos_id", None) is not None:
            self.eos_token_ids = tuple(sorted({*self.eos_token_ids, self.tokenizer.eos_id}))
        config = replace(config, dtype=resolve_dtype(config.dtype, self.path or model,
                                                     config.quantization))
        self.config = config
        if self.path is not None:
            # Multi-rank layouts split the model on the host, then move each rank's share. One
            # rank keeps an FP8 checkpoint's projections in FP8; the tensor/expert-parallel
            # splits shard nn.Linear parameters, so several ranks dequantise them at load.
            single = config.world_size == 1
            with large_blocks_mapped():  # a converted tensor's stored copy leaves no hole
                model = load_pretrained(self.path, device if single else "cpu",
                                        TORCH_DTYPES[config.dtype], keep_fp8=single)
        if self.path is None and config.world_size == 1 and config.quantization != "none":
            model = copy.deepcopy(model)  # quantizing swaps its layers: the caller's stays
        self.model_config = model.config
        # A vocabulary rounded up past the tokenizer's: sample only ids the tokenizer decodes.
        self.num_sampleable = min(model.config.vocab_size,
                                  getattr(self.tokenizer, "vocab_size", model.config.vocab_size))
        self.driver: ServingDriver | None = None
        if config.world_size > 1:
            # The driver splits the model in place: the caller's model object stays whole. The
            # other ranks load the folder themselves, or get the model object pickled. Its own
            # failures stop the ranks it started; the rest of the set-up's close them here.
            from tetrad.inference.ranks.driver import ServingDriver

            source = model if self.path is None else str(self.path)
            self.driver = ServingDriver(copy.deepcopy(model) if self.path is None else model,
                                        source, config, self.max_model_len, device)
        try:
            with large_blocks_mapped():  # nor do the 16-bit weights that quantizing replaces
                self._start(model, device, scheduling, log)
        except BaseException:
            self.close()
            raise

    def _tokenizer(self, tokenizer, model_config):
        """The tokenizer passed in, or the model folder's (which must fit the model)."""
        if tokenizer is not None:
            return tokenizer
        if self.path is None:
            raise ConfigError("pass a tokenizer along with a model object")
        import tetrad

        tokenizer = tetrad.load_tokenizer(self.path)
        check_tokenizer_fits(tokenizer, model_config.vocab_size)
        return tokenizer

    def _start(self, model: nn.Module, device: torch.device, scheduling: SchedulerConfig,
               log) -> None:
        """The runner (this rank's, or the driver's over every rank), its KV pool, and the
        scheduler(s) over the pool's blocks."""
        config = self.config
        if self.driver is not None:
            self.runner, plan = self.driver.runner, self.driver.kv_plan
            self._execute = self.driver.execute
        else:
            self.runner, plan = load_runner(model, config, self.max_model_len, device)
            self._execute = self.runner.execute
        self.model = self.runner.model
        self.kv_plan = plan
        if log:
            stages = ("" if config.world_size == config.tp else
                      f"; one such pool on each of the {config.world_size} ranks "
                      f"({config.describe()})")
            log(plan.describe() + stages)

        def blocks() -> BlockManager:
            return BlockManager(plan.num_blocks, plan.block_size, plan.num_cpu_blocks,
                                config.enable_prefix_caching, config.watermark)

        if config.dp > 1:  # each dp rank's pool, block ids and sequences are its own
            from tetrad.inference.ranks.data_parallel import DataParallelScheduler

            self.scheduler = DataParallelScheduler(scheduling, blocks, config.dp)
        else:
            self.scheduler = Scheduler(scheduling, blocks())
        self.block_manager = self.scheduler.block_manager
        self.sampler = Sampler(config.seed)
        self.metrics = EngineMetrics()
        self.tracker = RequestTracker(self.tokenizer, self.metrics)
        self._ids = itertools.count()
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
            # map, min and max loop in C: the server calls this on its event loop, where a
            # Python loop over a 3,000-id prompt held the GIL the engine thread waits for.
            text, prompt_ids = None, list(map(int, prompt))
        vocab = self.model_config.vocab_size
        if prompt_ids and (min(prompt_ids) < 0 or max(prompt_ids) >= vocab):
            raise ConfigError(f"prompt token ids must be in 0..{vocab - 1} (the model's vocab)")
        request_id = request_id or f"req-{next(self._ids)}"
        params = self.scheduler.validate(len(prompt_ids), params)
        self.tracker.add(request_id, text, prompt_ids, params)
        return request_id

    def abort(self, request_id: str) -> None:
        """Stop a request and free its blocks at the next step (a client that went away)."""
        self.tracker.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.tracker.has_unfinished()

    def num_waiting(self) -> int:
        """Requests not started yet (a cheap, possibly stale read from any thread)."""
        return len(self.scheduler.waiting) + self.tracker.num_incoming()

    # ---- one step (the engine thread) ----------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one step; the outputs of the requests it advanced (each with this step's deltas).
        A step whose model call or sampling raises finishes the requests it ran with
        finish_reason "error" (RequestOutput.error says why), and a request whose text cannot be
        made (its detokenizer raises) finishes so alone; the others go on. Only an engine that
        cannot step again (a rank of a multi-rank layout died) raises."""
        touched = self.tracker.begin_step(self.scheduler)
        batch = self.scheduler.schedule()
        self.peak_blocks_used = max(self.peak_blocks_used, self.block_manager.num_used_blocks)
        sampled = []
        # A batch with no sequence carries no block copies either (tests/test_scheduler.py checks
        # it on random workloads): the oldest running sequence always fits once the newer ones
        # are preempted, as validate() bounds it by the pool; only a newer one is swapped out.
        if batch.seqs:
            try:
                sampled = self._run(batch)
            except Exception as error:
                if self.failure is not None:
                    raise
                traceback.print_exc()  # a bug, not a bad request: keep its trace
                concerned = {seq.request_id for seq in [*batch.seqs, *batch.preempted]}
                self.tracker.fail(self.scheduler, concerned, error, touched)
        now = time.perf_counter()
        for seq, token, logprobs in sampled:
            try:
                self.tracker.record(self.scheduler, seq, [token], logprobs, now, touched)
            except Exception as error:
                traceback.print_exc()
                self.tracker.fail(self.scheduler, {seq.request_id}, error, touched)
        if batch.seqs:
            self.metrics.record_step(len(sampled), now)
        return self.tracker.end_step(touched)

    def _run(self, batch) -> list[tuple[Sequence, int, list[TokenLogprob]]]:
        """The model step and sampling: (sequence, its new token, the token's log-probability
        if it asked) for every sequence that sampled; the prompt scores it computed are
        recorded."""
        plan = StepPlan.from_batch(batch, self.kv_plan.block_size)
        if self.driver is None:
            logits = self._execute(plan)
        else:  # one plan per dp rank: a DataParallelBatch's parts, or the one batch
            logits = self._execute(batch.plans(self.kv_plan.block_size) if self.config.dp > 1
                                   else [plan])
        layout = logits_layout(plan)
        for seq, position, scores in prompt_logprobs(logits, plan, layout, batch.seqs):
            self.tracker.record_prompt(seq, position, scores)
        to_sample = self.scheduler.advance(batch)
        rows = sample_rows(layout, batch.samples)
        picked = [rows[row] for _, row in to_sample]
        seqs = [seq for seq, _ in to_sample]
        if picked != list(range(len(logits))):  # forked samples share a row; prompt rows go
            logits = logits[torch.tensor(picked, dtype=torch.long, device=logits.device)]
        token_ids = self.sampler(logits[:, :self.num_sampleable], seqs).token_ids if seqs else None
        self._prepare_next_step()
        # The step's one device-to-host copy: the sampled ids.
        tokens = token_ids.tolist() if seqs else []
        logprobs = sampled_logprobs(logits, seqs, tokens)
        self.scheduler.append_tokens(list(zip(seqs, tokens)), self.eos_token_ids)
        return list(zip(seqs, tokens, logprobs))

    def _prepare_next_step(self) -> None:
        """Host work for the next step that this step's tokens cannot change, done while the
        device computes them (before the sampled ids are read back): new requests join the
        waiting queue and their prompts' prefix-cache hashes are computed. Who runs next, and
        with which tokens, waits for the ids: a sampled end-of-sequence or stop string finishes a
        sequence, and aborts free blocks the step may still be writing."""
        self.tracker.take_in(self.scheduler)
        self.scheduler.prepare_admission()

    # ---- the other ranks -----------------------------------------------------------------------

    @property
    def failure(self) -> BaseException | None:
        """Why the other ranks stopped (the engine cannot step again), or None."""
        return None if self.driver is None else self.driver.failure

    def close(self) -> None:
        """Stop the other ranks (nothing to do in one process); no step after this."""
        if self.driver is not None:
            self.driver.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    # ---- state ---------------------------------------------------------------------------------

    def kv_utilization(self) -> float:
        return kv_utilization(self.scheduler, self.block_manager)

    def stats(self) -> dict[str, float]:
        return engine_stats(self.scheduler, self.block_manager)

    def metrics_text(self) -> str:
        """Prometheus text for /metrics (call it where steps run: the server's engine thread)."""
        return self.metrics.prometheus(self.stats())

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
                    done[output.request_id] = check_output(output)
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
                        yield check_output(output)
        finally:
            if not finished:
                self.abort(request_id)
                self.step()


def _with_stored_quantization(config: EngineConfig, model: Path | nn.Module) -> EngineConfig:
    """A model stored quantized (quant_store) serves in its own method: --quantization may name
    it or be left at none, but cannot ask for another (its 16-bit weights are not stored)."""
    if isinstance(model, nn.Module):
        stored = getattr(getattr(model, "stored_quantized", None), "method", None)
    else:
        stored = stored_quantization(resolve_checkpoint(model))
    if stored is None or config.quantization == stored:
        return config
    if config.quantization != "none":
        raise ConfigError(f"{model} is stored quantized to {stored} (tetrad create --quantize): "
                          f"it serves as {stored} only, not --quantization "
                          f"{config.quantization}; store it again from its 16-bit weights for "
                          f"another method")
    return replace(config, quantization=stored)


def check_output(output: RequestOutput) -> RequestOutput:
    if output.error is not None:
        raise RequestFailed(f"request {output.request_id} failed: {output.error}")
    return output


def _config_eos_ids(folder: Path) -> tuple[int, ...]:
    """End-of-sequence ids an HF folder's config.json / generation_config.json name."""
    ids: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        file = folder / name
        if folder.is_dir() and file.is_file():
            value = json.loads(file.read_text()).get("eos_token_id")
            ids.update(value if isinstance(value, list) else [] if value is None else [value])
    return tuple(sorted(ids))
