"""A backend defined outside the package, in this file only, through the interface of
tetrad/inference/worker/attention/base.py: registered by name, the engine serves with it exactly
what full recompute and the gathering reference give (mixed steps of prefill chunks and decodes),
and the decode graphs (CUDA graphs; on a CPU the recorded forward over the same static buffers,
since capture itself is CUDA-only) make its step data through `graph_step`. Auto asks the
automatic backends in the registry's order and takes the first that accepts."""

import re

import pytest
import torch
from test_engine import GREEDY, PROMPTS, engine, random_model, reference_greedy

from tetrad.errors import ConfigError
from tetrad.inference.worker import triton_attention
from tetrad.inference.worker.attention import (AttentionBackend, DeviceStep, HostStep,
                                               register, registry, resolve_backend,
                                               sdpa_paged_attention)
from tetrad.inference.worker.config import EngineConfig
from tetrad.inference.worker.cuda_graphs import DecodeGraphs


class PaddedStep:
    """Every sequence's queries padded to the step's widest, gathered in one SDPA call."""

    def __init__(self, backend, step: DeviceStep, query_rows, token_index):
        self.backend, self.step = backend, step
        self.query_rows, self.token_index = query_rows, token_index

    def attend(self, layer, q, k, v):
        self.backend.layer_calls += 1
        cache = self.backend.kv_cache
        k_cache, v_cache = cache.layer(layer)
        q, k, v = (t[0].transpose(0, 1) for t in (q, k, v))  # [tokens, heads, head_dim]
        cache.write(layer, self.step.slots, k, v)
        out = sdpa_paged_attention(q[self.query_rows], k_cache, v_cache, self.step.tables,
                                   self.step.query_positions)
        return out.flatten(0, 1)[self.token_index].transpose(0, 1).unsqueeze(0)


class PaddedGathering(AttentionBackend):
    """Counts what the runner and the graphs ask of it."""

    name = "padded-gathering"

    def __init__(self, kv_cache, block_size, compile=False):
        super().__init__(kv_cache, block_size, compile)
        self.eager_steps: list[HostStep] = []
        self.graph_steps = self.layer_calls = 0

    def uploads(self, host):
        rows, index, row = [], [], 0
        for seq, num_new in enumerate(host.num_tokens):
            rows += [*range(row, row + num_new), *[row + num_new - 1] * (host.max_q - num_new)]
            index += range(seq * host.max_q, seq * host.max_q + num_new)
            row += num_new
        return {"query_rows": rows, "token_index": index}

    def prepare(self, host, step, sent):
        self.eager_steps.append(host)
        rows = sent["query_rows"].view(len(host.num_tokens), host.max_q)
        return PaddedStep(self, step, rows, sent["token_index"])

    def graph_step(self, step):
        self.graph_steps += 1
        rows = torch.arange(step.slots.shape[0], device=step.slots.device)
        return PaddedStep(self, step, rows[:, None], rows)


@pytest.fixture
def padded_gathering():
    register(PaddedGathering)
    try:
        yield PaddedGathering
    finally:
        del registry.BACKENDS[PaddedGathering.name]


def test_a_backend_from_one_file_serves_like_full_recompute_and_the_reference(padded_gathering):
    model = random_model()
    greedy = GREEDY.replace(max_tokens=6)
    expected = [reference_greedy(model, prompt, 6) for prompt in PROMPTS]
    reference = engine(model, attention="sdpa", max_num_batched_tokens=7)
    assert [o.token_ids for o in reference.generate(PROMPTS, greedy)] == expected
    llm = engine(model, attention=padded_gathering.name, max_num_batched_tokens=7)
    backend = llm.runner.attention
    assert isinstance(backend, padded_gathering)
    assert [o.token_ids for o in llm.generate(PROMPTS, greedy)] == expected
    steps = backend.eager_steps
    # Chunks of 7 tokens beside decodes, and decode-only steps: both kinds went through it.
    assert any(step.chunks and step.decodes for step in steps)
    assert any(step.all_decodes for step in steps)
    assert backend.layer_calls == len(steps) * model.config.num_layers
    assert backend.graph_steps == 0
    assert llm.block_manager.num_used_blocks == 0


def test_decode_graphs_make_the_backends_step_data_from_their_static_buffers(padded_gathering):
    model = random_model()
    prompts, greedy = PROMPTS[:3], GREEDY.replace(max_tokens=5)
    expected = [reference_greedy(model, prompt, 5) for prompt in prompts]
    llm = engine(model, attention=padded_gathering.name, max_num_seqs=5)
    runner, backend = llm.runner, llm.runner.attention
    runner.graphs = DecodeGraphs(runner, 5, llm.max_model_len)
    runner.graphs.capture()  # no CUDA: records the forward over the static buffers
    assert [o.token_ids for o in llm.generate(prompts, greedy)] == expected
    # The prompts' prefill ran eagerly; every decode step ran from the buffers of bucket 4,
    # four of them (the first token comes from the prefill), each asking graph_step again.
    assert backend.eager_steps and not any(step.all_decodes for step in backend.eager_steps)
    assert backend.graph_steps == 4
    assert backend.layer_calls == (len(backend.eager_steps) + 4) * model.config.num_layers
    assert llm.block_manager.num_used_blocks == 0


class Picky(PaddedGathering):
    """Runs on a CPU with blocks of 16 tokens only."""

    name = "picky"
    devices = ("cpu",)
    automatic = True

    @classmethod
    def refusal(cls, device, block_size, latent, dtype=None):
        return None if block_size == 16 else "--attention picky needs --block-size 16"


def test_auto_asks_the_automatic_backends_in_the_registrys_order(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    first = {"auto": registry.FALLBACK, "picky": Picky}
    monkeypatch.setattr(registry, "BACKENDS", {**first, **registry.BACKENDS})
    assert resolve_backend("auto", cpu, 16) == "picky"
    assert resolve_backend("auto", cpu, 8) == "cpu"  # refused: the next one is asked
    monkeypatch.setattr(triton_attention, "triton_available", lambda device: True)
    assert resolve_backend("auto", cuda, 16) == "triton"  # not picky's device
    monkeypatch.setattr(triton_attention, "triton_available", lambda device: False)
    with pytest.warns(UserWarning, match="gathering attention on the GPU"):
        assert resolve_backend("auto", cuda, 16) == "auto"
    with pytest.raises(ConfigError, match="picky needs --block-size 16"):
        resolve_backend("picky", cpu, 8)


def test_the_engines_attention_choices_are_the_registrys(padded_gathering):
    assert EngineConfig(attention=padded_gathering.name).attention == padded_gathering.name
    del registry.BACKENDS[padded_gathering.name]
    try:
        names = ", ".join(registry.BACKENDS)  # the registry's, without the one taken out
        with pytest.raises(ConfigError, match=re.escape(f"must be one of {names}, got")):
            EngineConfig(attention=padded_gathering.name)
    finally:
        register(padded_gathering)
