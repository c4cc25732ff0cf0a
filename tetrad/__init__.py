"""tetrad: plan, train and serve large transformers on one shared model and cluster description.

`import tetrad` stays torch-free (the planner runs anywhere, in milliseconds): the entry points
that need torch are imported on first use through the module-level `__getattr__`.
"""

from __future__ import annotations

_LAZY = {
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
