"""Request bookkeeping behind `LLM`: the requests in flight and their outputs. New requests and
aborts arrive from any thread and are taken in at the start of a step; what a step produced for a
sequence (tokens, log-probabilities) becomes text through the request's detokenizers, stop strings
and finish reasons; a request that fails is finished with its error without touching the others;
finished requests feed the metrics. Plain Python."""

from __future__ import annotations

import queue
import time
from collections.abc import Iterator

from tetrad.inference.core.metrics import EngineMetrics
from tetrad.inference.core.output import CompletionOutput, Detokenizer, RequestOutput, TokenLogprob
from tetrad.inference.core.params import SamplingParams
from tetrad.inference.core.scheduler import Scheduler
from tetrad.inference.core.sequence import Sequence


class TrackedRequest:
    def __init__(self, request_id: str, prompt: str | None, prompt_ids: list[int],
                 params: SamplingParams, tokenizer):
        self.params = params
        self.output = RequestOutput(request_id, prompt, prompt_ids,
                                    [CompletionOutput(i, logprobs=None if params.logprobs is None
                                                      else []) for i in range(params.n)],
                                    arrival_time=time.perf_counter())
        if params.prompt_logprobs is not None:
            self.output.prompt_logprobs = [None] * len(prompt_ids)
        self.detokenizers = [Detokenizer(tokenizer, params) for _ in range(params.n)]
        self.num_finished = 0


class RequestTracker:
    def __init__(self, tokenizer, metrics: EngineMetrics):
        self.tokenizer, self.metrics = tokenizer, metrics
        self.requests: dict[str, TrackedRequest] = {}
        self._incoming: queue.SimpleQueue = queue.SimpleQueue()  # TrackedRequests, any thread
        self._aborts: queue.SimpleQueue = queue.SimpleQueue()

    # ---- any thread ----------------------------------------------------------------------------

    def add(self, request_id: str, prompt: str | None, prompt_ids: list[int],
            params: SamplingParams) -> None:
        self._incoming.put(TrackedRequest(request_id, prompt, prompt_ids, params, self.tokenizer))

    def abort(self, request_id: str) -> None:
        self._aborts.put(request_id)

    def has_unfinished(self) -> bool:
        return bool(self.requests) or not self._incoming.empty()

    def num_incoming(self) -> int:
        return self._incoming.qsize()

    # ---- the engine thread ---------------------------------------------------------------------

    def take_in(self, scheduler: Scheduler) -> None:
        """Queue the new requests in the scheduler (waiting: no running step is affected)."""
        for request in iter_queue(self._incoming):
            self.requests[request.output.request_id] = request
            scheduler.add_request(request.output.request_id, request.output.prompt_token_ids,
                                  request.params)

    def begin_step(self, scheduler: Scheduler) -> dict[str, TrackedRequest]:
        """Take in new requests and aborts; the requests touched so far this step."""
        touched: dict[str, TrackedRequest] = {}
        self.take_in(scheduler)
        for request_id in iter_queue(self._aborts):
            if request_id in self.requests:
                self._stop(scheduler, request_id, "abort", touched)
        return touched

    def record(self, scheduler: Scheduler, seq: Sequence, tokens: list[int],
               logprobs: list[TokenLogprob], now: float,
               touched: dict[str, TrackedRequest]) -> None:
        """A sequence's new tokens (and their log-probabilities, if it asked): text, stop
        strings, and its finish if the scheduler finished it or a stop string did."""
        request = self._touch(seq.request_id, touched)
        output = request.output
        completion = output.outputs[seq.index]
        if tokens and output.first_token_time is None:
            output.first_token_time = now
            output.num_cached_tokens = seq.num_cached_tokens
        completion.token_ids += tokens
        completion.delta_token_ids += tokens
        if completion.logprobs is not None:
            completion.logprobs += logprobs
            completion.delta_logprobs += logprobs
        delta, stopped = request.detokenizers[seq.index].add(tokens, final=seq.is_finished)
        if stopped and not seq.is_finished:
            scheduler.finish(seq, "stop")
        completion.delta_text += delta
        completion.text = request.detokenizers[seq.index].text
        if seq.is_finished:
            self._finish(request, completion, seq.finish_reason, now)

    def record_prompt(self, seq: Sequence, position: int, logprobs: list[TokenLogprob]) -> None:
        """Log-probabilities of prompt tokens position, position + 1, ...; a prompt computed
        again after a preemption keeps the first ones (a view may already hold the list)."""
        scores = self.requests[seq.request_id].output.prompt_logprobs
        for offset, logprob in enumerate(logprobs):
            if scores[position + offset] is None:
                scores[position + offset] = logprob

    def fail(self, scheduler: Scheduler, request_ids: set[str], error: BaseException,
             touched: dict[str, TrackedRequest]) -> None:
        """Finish these requests with an error (their blocks are freed); the others go on."""
        for request_id in request_ids:
            if request_id in self.requests:
                self.requests[request_id].output.error = f"{type(error).__name__}: {error}"
                self._stop(scheduler, request_id, "error", touched)

    def end_step(self, touched: dict[str, TrackedRequest]) -> list[RequestOutput]:
        """The outputs of the touched requests; finished ones leave and feed the metrics."""
        for request in touched.values():
            if request.output.finished:
                del self.requests[request.output.request_id]
                self.metrics.record_finished(request.output)
        return [request.output for request in touched.values()]

    def _touch(self, request_id: str, touched: dict[str, TrackedRequest]) -> TrackedRequest:
        """The request, with new (empty) deltas when it is first touched in this step: the
        lists of the previous step's deltas may be held by a view and are never changed."""
        request = self.requests[request_id]
        if request_id not in touched:
            for each in request.output.outputs:
                each.delta_text, each.delta_token_ids, each.delta_logprobs = "", [], []
            touched[request_id] = request
        return request

    def _stop(self, scheduler: Scheduler, request_id: str, reason: str,
              touched: dict[str, TrackedRequest]) -> None:
        request = self._touch(request_id, touched)
        now = time.perf_counter()
        for seq in scheduler.abort(request_id):
            seq.finish_reason = reason
            if reason != "error":  # an error may come from the text itself: leave it as it is
                self.record(scheduler, seq, [], [], now, touched)
        for completion in request.output.outputs:  # samples not forked yet
            if completion.finish_reason is None:
                self._finish(request, completion, reason, now)

    def _finish(self, request: TrackedRequest, completion: CompletionOutput, reason: str,
                now: float) -> None:
        completion.finish_reason = reason
        request.num_finished += 1
        if request.num_finished == len(request.output.outputs):
            request.output.finished = True
            request.output.finish_time = now


def iter_queue(items: queue.SimpleQueue) -> Iterator:
    while True:
        try:
            yield items.get_nowait()
        except queue.Empty:
            return
