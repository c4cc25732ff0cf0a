"""The server's work between a request's JSON and the engine's queue (chat templates, tokenizing),
kept from stalling the event loop or other clients.

- A prompt that cannot fit the context is refused from its UTF-8 length, before any tokenizing
  (`prompt_byte_limit`): a 10 MB prompt used to be tokenized into 10 million ids first.
- Small prompts are tokenized on the event loop (faster than a hand-off to a thread), larger ones
  on a pool of their own that chat templates never occupy.
- A chat template renders on a thread of its own, at most MAX_RENDERS at once, within the
  server's --template-timeout and the prompt's byte limit; a render past its time, or whose client
  left, is stopped where it stands (an exception raised in its thread between two bytecodes).
- `health()` tells a stalled front end: a render that does not stop, or a prompt waiting for a
  tokenizer thread.
"""

from __future__ import annotations

import asyncio
import ctypes
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from tetrad.errors import TetradError
from tetrad.inference.entrypoints.api import ApiError
from tetrad.inference.entrypoints.async_engine import settle
from tetrad.inference.entrypoints.chat import ChatFormatter

INLINE_TOKENIZE_BYTES = 1024  # a BPE tokenizes this in about a ms: less than a thread hand-off
TOKENIZE_THREADS = 4
MAX_RENDERS = 2  # chat templates rendering at once: each holds the GIL while it runs
STOP_GRACE_S = 2.0  # a stopped render still running this long after its deadline: stalled
TOKENIZE_STALL_S = 5.0  # a prompt waiting this long for a tokenizer thread: stalled
TEMPLATE_OUTPUT = "the chat prompt (the template's output)"


def prompt_byte_limit(tokenizer, max_model_len: int) -> int | None:
    """The most UTF-8 bytes a prompt of max_model_len tokens can hold: each token stands for at
    most the tokenizer's longest_token_bytes of text (tetrad/tokenizer.py says why), so a longer
    prompt is more tokens than the context. None for a tokenizer without that bound."""
    longest = getattr(tokenizer, "longest_token_bytes", None)
    return None if longest is None else max_model_len * longest


class _Stop(BaseException):
    """Raised inside a render's thread to stop it: not an Exception, so that no except clause in
    jinja2 or in a template's filters swallows it."""


class StoppableCall:
    """function() on a thread of its own, its outcome set on an asyncio future; stop() ends it
    between two Python bytecodes wherever it is."""

    def __init__(self, function: Callable, loop: asyncio.AbstractEventLoop,
                 future: asyncio.Future):
        self.function, self.loop, self.future = function, loop, future
        self.lock = threading.Lock()
        self.finished = self.stopping = False
        self.thread = threading.Thread(target=self._run, name="tetrad-chat-template",
                                       daemon=True)

    def _run(self) -> None:
        try:
            try:
                result, error = self.function(), None
            except Exception as failure:
                result, error = None, failure
            finally:
                with self.lock:  # stop() sends nothing after this
                    self.finished = True
        except _Stop:  # landed in the function, or at the latest in the lock's __exit__
            return
        try:
            self.loop.call_soon_threadsafe(settle, self.future, result, error)
        except RuntimeError:  # the loop closed (the server stopped) meanwhile
            pass

    def stop(self) -> None:
        with self.lock:
            if self.finished or self.stopping or self.thread.ident is None:
                return
            self.stopping = True
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self.thread.ident),
                                                       ctypes.py_object(_Stop))


class FrontEnd:
    def __init__(self, tokenizer, max_model_len: int, chat: ChatFormatter,
                 template_timeout: float):
        self.tokenizer, self.max_model_len, self.chat = tokenizer, max_model_len, chat
        self.template_timeout = template_timeout
        self.longest_token = getattr(tokenizer, "longest_token_bytes", None)
        self.max_prompt_bytes = prompt_byte_limit(tokenizer, max_model_len)
        self.pool = ThreadPoolExecutor(TOKENIZE_THREADS, thread_name_prefix="tetrad-tokenize")
        self.render_slots = asyncio.Semaphore(MAX_RENDERS)
        self.renders: dict[StoppableCall, float] = {}  # started renders -> their deadlines
        self.waiting: dict[object, float] = {}  # tokenizing jobs not started -> since when

    def close(self) -> None:
        for render in list(self.renders):
            render.stop()
        self.pool.shutdown(wait=False, cancel_futures=True)

    def check_prompt_bytes(self, text: str, what: str = "the prompt") -> None:
        limit = self.max_prompt_bytes
        # len(text) <= its UTF-8 length <= 4 * len(text): encode only where that decides.
        if limit is None or len(text) * 4 <= limit:
            return
        size = len(text) if len(text) > limit else len(text.encode("utf-8"))
        if size > limit:
            raise self._too_long(what, str(size))

    def _too_long(self, what: str, size: str) -> ApiError:
        return ApiError(400, f"{what} is {size} bytes: more than the model's context length of "
                             f"{self.max_model_len} tokens can hold with this tokenizer (at most "
                             f"{self.longest_token} bytes a token, so {self.max_prompt_bytes} "
                             f"bytes)")

    async def tokenize(self, prompts: list) -> list[list[int]]:
        """Each prompt's token ids (a string's, or ids already); refuses too long text first."""
        texts = [prompt for prompt in prompts if isinstance(prompt, str)]
        for text in texts:
            self.check_prompt_bytes(text)
        longest_ids = max((len(p) for p in prompts if not isinstance(p, str)), default=0)
        if longest_ids > self.max_model_len:  # before the engine converts each id
            raise ApiError(400, f"a prompt of {longest_ids} token ids is longer than the "
                                f"model's context length ({self.max_model_len} tokens)")

        def encode() -> list[list[int]]:
            return [self.tokenizer.encode(p) if isinstance(p, str) else p for p in prompts]

        if sum(map(len, texts)) <= INLINE_TOKENIZE_BYTES:
            return encode()
        return await self.off_loop(encode)

    async def detokenize(self, ids: list[int]) -> str:
        if len(ids) <= INLINE_TOKENIZE_BYTES:
            return self.tokenizer.decode(ids)
        return await self.off_loop(self.tokenizer.decode, ids)

    async def off_loop(self, function: Callable, *args):
        """function(*args) on the tokenizer pool; how long it waits there is what health()
        watches."""
        ticket = object()
        self.waiting[ticket] = time.monotonic()

        def started():
            self.waiting.pop(ticket, None)
            return function(*args)

        try:
            return await asyncio.get_running_loop().run_in_executor(self.pool, started)
        finally:
            self.waiting.pop(ticket, None)

    async def render(self, messages: list) -> str:
        """The chat prompt of `messages`, within the template's time and the prompt's size."""
        if self.chat.template is None:  # the plain transcript: linear in the messages
            prompt = self.chat.render(messages)
        else:
            deadline = time.monotonic() + self.template_timeout
            try:
                await asyncio.wait_for(self.render_slots.acquire(), self.template_timeout)
            except TimeoutError:
                raise ApiError(503, f"the server's {MAX_RENDERS} chat template renders stayed "
                                    f"busy for {self.template_timeout:g} s: retry later",
                               "server_error", {"Retry-After": "1"}) from None
            try:
                prompt = await self._render_on_thread(messages, deadline)
            finally:
                self.render_slots.release()
        self.check_prompt_bytes(prompt, TEMPLATE_OUTPUT)
        return prompt

    async def _render_on_thread(self, messages: list, deadline: float) -> str:
        from tetrad.inference.entrypoints.template_sandbox import RenderTooLong

        loop = asyncio.get_running_loop()
        future = loop.create_future()
        render = StoppableCall(lambda: self.chat.render(messages, self.max_prompt_bytes),
                               loop, future)
        self._forget_ended_renders()
        self.renders[render] = deadline
        render.thread.start()
        try:
            return await asyncio.wait_for(future, max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            raise ApiError(400, f"the chat template ran longer than {self.template_timeout:g} s "
                                f"on these messages and was stopped (tetrad serve "
                                f"--template-timeout)") from None
        except RenderTooLong:
            raise self._too_long(TEMPLATE_OUTPUT, f"over {self.max_prompt_bytes}") from None
        except TetradError:
            raise
        except Exception as error:  # the template raised: these messages do not fit it
            raise ApiError(400, f"the chat template failed on these messages: "
                                f"{type(error).__name__}: {error}") from None
        finally:
            render.stop()  # nothing when it finished; a client gone or a timeout: stop it

    def _forget_ended_renders(self) -> None:
        for render in [r for r in self.renders if not r.thread.is_alive()]:
            del self.renders[render]

    def health(self) -> str | None:
        """Why the front end is stalled, or None."""
        self._forget_ended_renders()
        now = time.monotonic()
        stuck = [now - deadline for deadline in self.renders.values()
                 if now - deadline > STOP_GRACE_S]
        if stuck:
            return (f"{len(stuck)} chat template renders still run {max(stuck):.0f} s past "
                    f"their time limit and do not stop")
        waited = now - min(self.waiting.copy().values(), default=now)  # a copy is atomic
        if waited > TOKENIZE_STALL_S:
            return (f"tokenizing is stalled: a prompt has waited {waited:.0f} s for one of the "
                    f"{TOKENIZE_THREADS} tokenizer threads")
        return None
