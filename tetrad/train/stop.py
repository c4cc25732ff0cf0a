"""Stopping a run early without losing it, and refusing one that cannot fit.

SIGTERM (what a cluster sends a pre-empted job) and SIGINT (Ctrl-C) ask the run to stop at the
next step boundary: the ranks agree on the signal there (Strategy.agree_on_signal, so they all
stop after the same step), the trainer saves that step's checkpoint and the command exits with
128 + the signal's number. A second signal exits at once (the save is atomic: the previous
checkpoint stays). Signals within SAME_REQUEST_S of the first are the same request: Ctrl-C reaches
a launcher and its ranks together, and the launcher forwards it too.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Callable, Iterable, Iterator

import torch

from tetrad.spec.model import TrainConfig
from tetrad.errors import ConfigError, TetradError

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
SAME_REQUEST_S = 1.0


class StopRequest:
    """The first stop signal this process received (0: none) and what the ranks agreed on."""

    def __init__(self):
        self.signal = 0
        self.stopped_by = 0
        self._first_at = 0.0

    def _receive(self, signum: int, frame) -> None:
        if not self.signal:
            self.signal, self._first_at = signum, time.monotonic()
        elif time.monotonic() - self._first_at > SAME_REQUEST_S:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    def steps(self, steps: Iterable[int], agree: Callable[[int], int]) -> Iterator[int]:
        """`steps`, ended early once the ranks `agree` on a signal after a step; the handlers are
        this process's only meanwhile (not in threads other than the main one, which Python does
        not let install them, nor for a SIGINT the parent ignores)."""
        previous = {}
        if threading.current_thread() is threading.main_thread():
            for signum in STOP_SIGNALS:
                if signal.getsignal(signum) is not signal.SIG_IGN:
                    previous[signum] = signal.signal(signum, self._receive)
        try:
            for step in steps:
                yield step
                self.stopped_by = agree(self.signal)
                if self.stopped_by:
                    return
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)


def exit_status(signum: int) -> int:
    """What a shell reports for a process a signal ended: 130 for SIGINT, 143 for SIGTERM."""
    return 128 + signum


def memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


# What a rank holds in its device's memory, by the run report's byte names; host_* bytes are in
# host memory (the same memory on a CPU run), disk_* bytes in --offload nvme's files.
DEVICE_BYTES = ("params", "params_gathered_peak", "grads", "optimizer", "activations_peak",
                "zero_buffers", "activation_buffer")


def device_bytes(held: dict[str, float]) -> float:
    """The device-resident part of a rank's bytes (predicted, or counted from its tensors)."""
    return sum(held.get(kind, 0) for kind in DEVICE_BYTES)


def check_fits(predicted: dict, config: TrainConfig, device: torch.device,
               world_size: int) -> None:
    """Refuse a run whose rank needs more memory than its device has (a --batch-size of 10^8
    would otherwise build its batch for minutes, then fail or swap), or than
    --device-memory-cap allows: the planner's bytes for the rank, plus the global batch of token
    ids each rank builds. The CPU's memory is shared by the ranks on this machine, and holds
    what offload puts in host memory too; files are not memory."""
    if "bytes" not in predicted:  # a layout the cost model does not cover
        return
    batch_bytes = config.batch_size * (config.seq_len + 1) * 8
    on_device = device_bytes(predicted["bytes"])
    cap = config.device_memory_cap
    if cap and on_device > cap:
        raise ConfigError(f"a rank would hold {on_device:,.0f} bytes in device memory (the "
                          f"planner's count), over --device-memory-cap {cap:,}: offload "
                          f"(--offload params with --zero 3), more ranks or a smaller batch")
    in_memory = on_device + sum(value for kind, value in predicted["bytes"].items()
                                if kind.startswith("host_") and device.type == "cpu")
    need = in_memory + batch_bytes
    sharing = 1 if device.type == "cuda" else int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    have = memory_bytes(device) // sharing
    if need > have:
        raise ConfigError(f"--batch-size {config.batch_size} x --seq-len {config.seq_len} needs "
                          f"about {need / 2**30:,.1f} GiB per rank (the planner's bytes and the "
                          f"batch's token ids) but {device.type} memory holds "
                          f"{have / 2**30:,.1f} GiB per rank: lower --batch-size or --seq-len")


def check_cap(held: dict[str, int], activations_peak: int, cap: int, step: int) -> None:
    """Stop a run whose rank counted more device-resident bytes than --device-memory-cap."""
    counted = device_bytes(held) + activations_peak
    if cap and counted > cap:
        raise TetradError(f"step {step}: this rank holds {counted:,} bytes in device memory "
                          f"(counted from its tensors), over --device-memory-cap {cap:,}")
