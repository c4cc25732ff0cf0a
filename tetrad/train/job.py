"""A training job, prepared once: the model's config and the layout resolved against it (the
pipeline cut included), the tokenizer loaded and checked against the vocabulary, --hardware read,
the checkpoint to resume found and checked. The launcher prepares it before any rank starts
(under torchrun rank 0 does, and hands it to the others), so bad input costs one line, not a
traceback per rank, and every rank trains the very same `PreparedJob`: no rank reads the
tokenizer, the model's config or a checkpoint's metadata again.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from tetrad.errors import ConfigError
from tetrad.hardware.profile import gpu_or_profile
from tetrad.planner.rules import ResolvedLayout, resolve_layout
from tetrad.spec.model import ModelConfig, TrainConfig
from tetrad.spec.presets import resolve_model
from tetrad.tokenizer import load_tokenizer
from tetrad.train import checkpoint as ckpt
from tetrad.train.data import AnyTokenizer


@dataclass(frozen=True)
class PreparedJob:
    config: TrainConfig  # its parallel is layout.parallel, the one the strategies read
    layout: ResolvedLayout
    tokenizer: AnyTokenizer
    resume_from: Path | None  # the checkpoint --resume continues, checked

    @property
    def model_config(self) -> ModelConfig:
        return self.layout.model


def resolve_run(config: TrainConfig) -> ResolvedLayout:
    """The run's model and layout, checked against each other and with the pipeline cut."""
    return resolve_layout(resolve_model(config.model, config.model_overrides), config.parallel,
                          config.seq_len)


def prepare(config: TrainConfig, model_config: ModelConfig | None = None
            ) -> tuple[ModelConfig, AnyTokenizer, Path | None]:
    """Everything that can be wrong with the input, checked before any data or model is built
    (the layout's fit to the model is resolve_run's)."""
    model_config = model_config or resolve_model(config.model, config.model_overrides)
    tokenizer = load_tokenizer(config.tokenizer)
    if tokenizer.vocab_size > model_config.vocab_size:
        raise ConfigError(f"the tokenizer has {tokenizer.vocab_size} tokens but the model's "
                          f"vocab_size is {model_config.vocab_size}: raise vocab_size")
    if config.hardware:
        gpu_or_profile(config.hardware)  # a bad --hardware fails before any work
    resume_from = None
    if config.resume:
        resume_from = ckpt.find_checkpoint(config.checkpoint_dir)
        if resume_from is not None:  # a corrupt checkpoint fails here, before any rank starts
            ckpt.read_step(resume_from)
            ckpt.read_model_config(resume_from)
            ckpt.read_training_state(resume_from)
    return model_config, tokenizer, resume_from


def prepare_job(config: TrainConfig, layout: ResolvedLayout | None = None) -> PreparedJob:
    """`config` prepared for training; `layout` is its resolve_run when the launcher has checked
    it against the number of ranks already."""
    layout = layout or resolve_run(config)
    _, tokenizer, resume_from = prepare(config, layout.model)
    if layout.parallel is not config.parallel:  # the pipeline cut
        config = dataclasses.replace(config, parallel=layout.parallel)
    return PreparedJob(config, layout, tokenizer, resume_from)
