"""`tetrad plan train`'s ZeRO-R flags (--zero-bucket-size, --contiguous-buffers,
--partition-activations, --offload-activations): planned on tetrad's own stack only, and only
where every layout the search may try holds them as `tetrad train` would."""

from __future__ import annotations

from tetrad.errors import ConfigError
from tetrad.schedules.generate import V_SHAPED
from tetrad.spec.layout import ParallelConfig


def check_zero_r(space, stack: str, runtime: str) -> None:
    """One line for a ZeRO-R flag of the search `space` on another stack, or in a space
    `tetrad train` would refuse."""
    zero_r = [flag for flag, on in (("--zero-bucket-size", space.zero_bucket_size),
                                    ("--contiguous-buffers", space.contiguous_buffers),
                                    ("--partition-activations", space.partition_activations),
                                    ("--offload-activations", space.offload_activations)) if on]
    if not zero_r:
        return
    if runtime != "tetrad":
        raise ConfigError(f"{', '.join(zero_r)}: ZeRO-R as tetrad's runtime holds and sends "
                          f"it, planned on its stack only: add --stack tetrad (not {stack})")
    _check_searched_buffers(space)


def _check_searched_buffers(space) -> None:
    """Refuses ZeRO-R's options unless every layout the search may try with `space`'s given
    choices holds them as `tetrad train` would: ParallelConfig's refusals for the least the
    search tries (ZeRO 0, no recomputation, or full under the kept-input options) and the most
    (ZeRO-3, sqrt) where left open; a given schedule on a pipeline. Left open, tp is searched
    above 1 and sequence parallelism off under --partition-activations (planner.search)."""
    least = "full" if space.partition_activations or space.offload_activations else "none"
    schedule = space.schedule or "1f1b"
    pp = space.pp or (1 if schedule in ("1f1b", "gpipe") else 2)
    # Two microbatches per stage: enough for every schedule (DualPipe's least).
    pipeline = dict(schedule=schedule, pp=pp, microbatches=2 * pp,
                    vpp=space.vpp or (2 if schedule in ("interleaved", *V_SHAPED) else 1))
    searched = [dict(zero=space.zero or 0, recompute=space.recompute or least),
                dict(zero=3 if space.zero is None else space.zero,
                     recompute=space.recompute or "sqrt")]
    for choices in searched:
        ParallelConfig(**pipeline, tp=space.tp or (2 if space.partition_activations else 1),
                       sequence_parallel=bool(space.sequence_parallel),
                       zero_bucket_size=space.zero_bucket_size,
                       contiguous_buffers=space.contiguous_buffers,
                       partition_activations=space.partition_activations,
                       offload_activations=space.offload_activations, **choices)
