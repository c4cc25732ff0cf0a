"""tetrad: plan, train and serve large transformers on one shared model and cluster description.

    from tetrad import LLM, SamplingParams            # serve (vLLM's names)
    from tetrad import TrainConfig, train_model       # train
    from tetrad import load_pretrained                # a model folder or checkpoint as a module

`import tetrad` stays torch-free (the planner runs anywhere, in milliseconds): every name below is
imported on first use through the module-level `__getattr__`.
"""

from __future__ import annotations

_LAZY = {
    "LLM": "tetrad.inference.engine",
    "SamplingParams": "tetrad.inference.core.params",
    "EngineConfig": "tetrad.inference.worker.config",
    "train_model": "tetrad.train.launch",
    "TrainConfig": "tetrad.spec.model",
    "ParallelConfig": "tetrad.spec.model",
    "ModelConfig": "tetrad.spec.model",
    "load_pretrained": "tetrad.models.hf",
    "load_hf_weights": "tetrad.models.hf",
    "load_tokenizer": "tetrad.tokenizer",
}

__all__ = list(_LAZY)


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'tetrad' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
