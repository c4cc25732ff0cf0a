"""The training loop. It knows nothing of how the model is spread over processes: that is the
strategy's job (tetrad.train.strategy). With LocalStrategy it is plain single-process training,
the reference every parallel layout is compared with."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tqdm import tqdm

from tetrad.spec.model import ModelConfig, TrainConfig
from tetrad.spec.layout import FORWARD_AGAIN
from tetrad.errors import ConfigError, TetradError
from tetrad.models.transformer import Transformer, count_parameters
from tetrad.parallel.compile import CompileClock
from tetrad.parallel.launch import local_device, rank_device
from tetrad.parallel.recompute import (activation_buffer_peak, host_activations_peak,
                                       recompute_peak_bytes)
from tetrad.train import checkpoint as ckpt
from tetrad.train.data import AnyTokenizer, Dataset
from tetrad.train.job import PreparedJob, prepare_job
from tetrad.train.metrics import build_report, rank_entry, write_json_atomic, zero_per_comm_kind
from tetrad.train.optim import learning_rate
from tetrad.train.prediction import device_gpu, predict, prediction_hardware
from tetrad.train.sample import sample_text
from tetrad.train.stop import StopRequest, check_cap, check_fits, device_bytes
from tetrad.train.strategy import Strategy, build_strategy

VALIDATION_BATCHES = 8


@dataclass
class TrainResult:
    report: dict[str, Any]
    checkpoint: Path | None
    sample: str
    stopped_by: int = 0  # the signal (SIGTERM, SIGINT) that stopped the run early; 0: none


def build_model(model_config: ModelConfig, config: TrainConfig) -> Transformer:
    torch.manual_seed(config.seed)
    model = Transformer(model_config)
    source = Path(config.model)
    if source.is_dir() and any(source.glob("*.safetensors")):
        from tetrad.models.hf import load_hf_weights
        load_hf_weights(model, source)
    return model


def run_device(config: TrainConfig) -> torch.device:
    """Where this rank computes: in a process group, the device its backend was set up for (a
    rank of an NCCL job on its own GPU, gloo ranks on the CPU even beside GPUs); in one process,
    config.device's choice."""
    return rank_device() if dist.is_initialized() else local_device(0, 1, config.device)


def cuda_memory(device: torch.device) -> dict[str, int] | None:
    """The CUDA caching allocator's peaks on `device` since the run began (None on the CPU):
    what the allocator measured, beside the bytes the report counts from the tensors."""
    if device.type != "cuda":
        return None
    return {"allocated_peak": torch.cuda.max_memory_allocated(device),
            "reserved_peak": torch.cuda.max_memory_reserved(device)}


def check_finite(loss: float, grad_norm: float, step: int, model: torch.nn.Module,
                 loss_scaling: bool) -> None:
    """Stop on a non-finite loss or gradient, naming the step and the first bad parameter. Under
    fp16 loss scaling an overflowing gradient is expected now and then: the step is skipped."""
    if not math.isfinite(loss):
        raise TetradError(f"the loss is {loss} at step {step}: lower --lr or use --dtype fp32")
    if not math.isfinite(grad_norm) and not loss_scaling:
        culprit = next((name for name, p in model.named_parameters()
                        if p.grad is not None and not torch.isfinite(p.grad).all()), "unknown")
        raise TetradError(f"the gradient norm is {grad_norm} at step {step}, first non-finite "
                          f"gradient in {culprit}: lower --lr or use --dtype fp32")


def train(job: PreparedJob | TrainConfig, make_strategy: Callable[..., Strategy] = build_strategy,
          show_progress: bool = True, device: torch.device | None = None) -> TrainResult:
    """Run a job the launcher prepared (tetrad.train.job) on `device`, this rank's (None: the
    one run_device names). A TrainConfig is one process's whole job, prepared here: the tests and
    benchmarks that call the trainer directly."""
    if device is None:
        device = run_device(job if isinstance(job, TrainConfig) else job.config)
    if isinstance(job, TrainConfig):
        job = prepare_job(job)
    config, model_config, tokenizer = job.config, job.model_config, job.tokenizer
    dataset = Dataset(config.data, tokenizer, config.seq_len, config.seed)
    if device.type == "cuda":  # the report's cuda_memory peaks are this run's
        torch.cuda.reset_peak_memory_stats(device)
    model = build_model(model_config, config).to(device)
    num_parameters = count_parameters(model)  # before a layout spreads the model over ranks
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    gpu = device_gpu(device)
    predicted = predict(job.layout, config, prediction_hardware(config, gpu))
    check_fits(predicted, config, device, world_size)  # before the strategy allocates its state
    strategy = make_strategy(model, config, device)
    resume_from = job.resume_from
    start_step = resume(strategy, resume_from, model_config) if resume_from is not None else 0
    start_step += getattr(strategy, "first_step", 0)  # a parameter-server spare joins mid-run
    if start_step > config.steps:
        raise ConfigError(f"the checkpoint in {config.checkpoint_dir} is at step {start_step}, "
                          f"past --steps {config.steps}: raise --steps to continue it")
    peak_flops = gpu.peak(config.dtype) * world_size if gpu else None
    held: dict[str, int] = {}
    steps: list[dict[str, Any]] = []
    saved, last_saved_step = resume_from, start_step if resume_from else None
    tokens_per_step = config.batch_size * config.seq_len
    is_main = strategy.rank == 0
    # Compiling is kept out of the step times: a step's time_s leaves out what this rank spent
    # compiling (in a multi-rank run the first step may still wait for another rank's compile,
    # which is why the report's medians skip it).
    clock = CompileClock() if config.compile else None
    progress = tqdm(range(start_step, config.steps), initial=start_step, total=config.steps,
                    desc=f"train {model_config.name} ({num_parameters / 1e6:.2f}M)",
                    disable=not (show_progress and is_main), dynamic_ncols=True)
    done, stop_request = start_step, StopRequest()
    for step in stop_request.steps(progress, strategy.agree_on_signal):
        done = step + 1
        started = time.perf_counter()
        compiled_before = clock.seconds if clock else 0.0
        loss, aux = strategy.forward_backward(dataset.train.batch(step, config.batch_size))
        strategy.finish_gradients()
        held = {k: max(v, held.get(k, 0)) for k, v in strategy.bytes_held().items()}
        grad_norm = strategy.clip_grad_norm(config.grad_clip)
        check_finite(loss, grad_norm, step + 1, model, loss_scaling=config.dtype == "fp16")
        applied = strategy.step(learning_rate(step, config))
        held = {k: max(v, held.get(k, 0)) for k, v in strategy.bytes_held().items()}
        check_cap(held, strategy.activations_peak, config.device_memory_cap, step + 1)
        if device.type == "cuda":  # the optimizer step's kernels are this step's time too
            torch.cuda.synchronize(device)
        compile_s = clock.seconds - compiled_before if clock else 0.0
        elapsed = time.perf_counter() - started - compile_s
        record = {"step": step + 1, "loss": loss, "grad_norm": grad_norm, "time_s": elapsed,
                  "tokens": tokens_per_step, "tokens_per_s": tokens_per_step / elapsed,
                  "lr": learning_rate(step, config), "applied": applied}
        if aux is not None:
            record["aux_loss"] = aux
        if compile_s:
            record["compile_s"] = compile_s
        if peak_flops:
            record["mfu"] = predicted["model_flops_per_step"] / elapsed / peak_flops
        steps.append(record)
        progress.set_postfix(loss=f"{loss:.4f}", tok_s=f"{record['tokens_per_s']:,.0f}",
                             **({"mfu": f"{record['mfu']:.1%}"} if peak_flops else {}))
        if config.save_every and (step + 1) % config.save_every == 0:
            saved = save(strategy, config, model_config, tokenizer, step + 1)
            last_saved_step = step + 1
    progress.close()
    if clock:
        clock.close()
    if config.checkpoint_dir and last_saved_step != done:
        saved = save(strategy, config, model_config, tokenizer, done)
    # A stopped run reports its steps, not a validation loss or a sample: a pre-empted job has
    # seconds left, and every rank skips the same collectives.
    stopped = stop_request.stopped_by != 0
    if config.parallel.recompute == "sqrt":  # what backward's reruns of a segment saved
        held["recompute_peak"] = recompute_peak_bytes(model)
    if config.parallel.offload_activations:  # the kept block inputs waiting in host memory
        held["host_activations_peak"] = host_activations_peak(model)
    if config.parallel.contiguous_buffers and config.parallel.recompute in FORWARD_AGAIN:
        held["activation_buffer"] = activation_buffer_peak(model)  # the kept inputs' slots
    ranks = strategy.gather(rank_entry(
        strategy.rank, strategy.coords, held, strategy.activations_peak,
        strategy.comm.totals_per_step() if strategy.comm else None, strategy.idle_fraction,
        [record["time_s"] for record in steps], cuda_memory(device),
        strategy.comm.exposed_per_step() if strategy.comm else None)
        | ({"compile_time_s": clock.seconds} if clock else {})
        | {"comm_calls": strategy.comm.calls_per_step() if strategy.comm else zero_per_comm_kind()})
    whole = None if stopped else strategy.whole_model()  # collective: every parameter whole
    report = build_report(
        config={**config.to_dict(), "model_config": model_config.to_dict()}, steps=steps,
        ranks=ranks, predicted=predicted, num_parameters=num_parameters,
        device={"type": device.type, "gpu": gpu.name if gpu else None},
        validation_loss=evaluate(whole, dataset, config.batch_size, device)
        if is_main and not stopped else None,
        # The slowest rank's compile time (--compile; parameter servers compile nothing).
        **({"compile_time_s": max(rank.get("compile_time_s", 0.0) for rank in ranks)}
           if clock else {}),
        device_memory={"cap": config.device_memory_cap,
                       "predicted": device_bytes(predicted.get("bytes", {})),
                       "counted": max(device_bytes(rank["bytes"]) for rank in ranks)},
        # The parameter server's run summary (modes, staleness, dead workers); set by gather.
        **({"parameter_server": strategy.summary} if strategy.summary is not None else {}))
    if config.report and is_main:
        write_json_atomic(config.report, report)
    sample = sample_text(whole, tokenizer, "\n", config.sample_tokens, config.seq_len,
                         seed=config.seed) if is_main and not stopped else ""
    return TrainResult(report=report, checkpoint=saved, sample=sample,
                       stopped_by=stop_request.stopped_by)


@torch.no_grad()
def evaluate(model, dataset: Dataset, batch_size: int, device: torch.device) -> float | None:
    """Mean loss on the held-out tail of the corpus."""
    if dataset.validation is None:
        return None
    was_training = model.training
    model.eval()
    losses = [F.cross_entropy(model(batch[:, :-1].to(device)).float().flatten(0, 1),
                              batch[:, 1:].to(device).flatten()).item()
              for batch in dataset.validation.in_order(batch_size, VALIDATION_BATCHES)]
    model.train(was_training)
    return sum(losses) / len(losses)


def resume(strategy: Strategy, folder: Path, model_config: ModelConfig) -> int:
    """Load a checkpoint of any layout into `strategy`; returns its step. The checkpoint's files
    are let go on return (pruning with --keep then frees their space)."""
    step, state = ckpt.load_checkpoint(folder, model_config)
    strategy.load_state_dict(state)
    # A rank the saving layout did not have continues from rank 0's generator.
    rngs = state["rng"]
    torch.set_rng_state(rngs[strategy.rank] if strategy.rank < len(rngs) else rngs[0])
    return step


def save(strategy: Strategy, config: TrainConfig, model_config: ModelConfig,
         tokenizer: AnyTokenizer, step: int) -> Path | None:
    """Every rank writes its pieces; rank 0 adds the shared state and every rank's RNG state."""
    pieces, shared = strategy.checkpoint_state()
    shared["rng"] = strategy.exchange(torch.get_rng_state())
    return ckpt.save_checkpoint(config.checkpoint_dir, step, strategy.rank, pieces,
                                strategy.exchange, shared, model_config,
                                {"config": config.to_dict()}, tokenizer=tokenizer, keep=config.keep)
