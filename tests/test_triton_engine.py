"""The engine with `--attention triton` generates greedily what full recompute does: prefill in
chunks over the cached prefix of earlier chunks (the one kernel for every token), decode steps
(the split-KV decode kernel), and decode steps padded to batch-size buckets through the CUDA
graphs' static buffers (`graph_step`; replayed eagerly without a GPU); a DeepSeek-V3 (MLA)
model, whose values are the latent columns of its keys, as HF generate() does. Where it cannot run,
`--attention triton` is one ConfigError, and on a GPU where triton runs auto picks it.

Without a GPU the engine runs in a fresh process under Triton's interpreter: TRITON_INTERPRET=1
must be set before triton is imported (tests/test_triton_attention.py says why).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from deepseek_models import hf_model
from test_engine import PROMPTS, hf_greedy, random_model, reference_greedy

from tetrad.errors import ConfigError
from tetrad.inference.worker import triton_attention
from tetrad.inference.worker.attention import resolve_backend

ENGINE_RUNS = """
import json
import sys
import torch
torch.set_num_threads(1)
from test_engine import GREEDY, PROMPTS, engine, random_model
from tetrad.inference.engine import LLM
from tetrad.inference.worker.cuda_graphs import DecodeGraphs

model = random_model()
# Few sequences: on a GPU few graph buckets to capture, so few kernel variants to compile.
chunked = engine(model, attention="triton", max_num_batched_tokens=7, num_blocks=32,
                 max_num_seqs=5)
outputs = chunked.generate(PROMPTS[:3], GREEDY.replace(max_tokens=6))
bucketed = engine(model, attention="triton", max_num_seqs=5, num_blocks=32)
runner = bucketed.runner
runner.graphs = DecodeGraphs(runner, 5, bucketed.max_model_len)
runner.graphs.capture()
sizes = []
run = runner.graphs.run
runner.graphs.run = lambda plan: sizes.append(len(plan.starts)) or run(plan)
replayed = bucketed.generate(PROMPTS[:3], GREEDY.replace(max_tokens=5))
latent = LLM(sys.argv[1], log=None, block_size=4, attention="triton", max_num_batched_tokens=7,
             max_num_seqs=5)
mla = latent.generate(PROMPTS[:3], GREEDY.replace(max_tokens=5))
print(json.dumps({"backend": runner.backend, "chunked": [o.token_ids for o in outputs],
                  "replayed": [o.token_ids for o in replayed], "graph_sizes": sizes,
                  "blocks_left": bucketed.block_manager.num_used_blocks,
                  "mla": [o.token_ids for o in mla]}))
"""


def test_the_engine_with_triton_attention_decodes_like_full_recompute(tmp_path):
    deepseek = hf_model("v3")
    deepseek.save_pretrained(tmp_path)
    env = dict(os.environ)
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    result = subprocess.run([sys.executable, "-c", ENGINE_RUNS, str(tmp_path)],
                            capture_output=True, text=True, timeout=600,
                            cwd=Path(__file__).parent, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    runs = json.loads(result.stdout.splitlines()[-1])
    model = random_model()
    expected = [reference_greedy(model, prompt, 6) for prompt in PROMPTS[:3]]
    assert runs["backend"] == "triton"
    assert runs["chunked"] == expected
    assert runs["replayed"] == [tokens[:5] for tokens in expected]
    assert runs["graph_sizes"] and set(runs["graph_sizes"]) == {3}  # padded to bucket 4
    assert runs["blocks_left"] == 0  # padding rows wrote only the pad block
    assert runs["mla"] == hf_greedy(deepseek, PROMPTS[:3], max_tokens=5)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                    reason="this session runs Triton's interpreter")
def test_triton_attention_on_a_cpu_without_the_interpreter_is_one_config_error():
    with pytest.raises(ConfigError, match="only under Triton's interpreter"):
        resolve_backend("triton", torch.device("cpu"), 16)


def test_auto_picks_triton_on_a_gpu_where_it_runs_and_gathers_where_it_does_not(monkeypatch):
    cuda = torch.device("cuda")  # resolve_backend only reads the device's type
    monkeypatch.setattr(triton_attention, "triton_available", lambda device: True)
    assert resolve_backend("auto", cuda, 16) == "triton"
    assert resolve_backend("auto", cuda, 16, latent=True) == "triton"  # MLA's narrower values
    monkeypatch.setattr(triton_attention, "triton_available", lambda device: False)
    with pytest.raises(ConfigError, match="no GPU driver"):
        resolve_backend("triton", cuda, 16)
    with pytest.warns(UserWarning, match="gathering attention on the GPU"):
        assert resolve_backend("auto", cuda, 16) == "auto"
