"""The multi-rank test helper: run a module-level function on N spawned gloo ranks (one thread
each, a free localhost port) and get every rank's return value, or the failing rank's error with
its rank and traceback. Timeouts on the rendezvous, the collectives and the whole job mean a
broken test fails instead of hanging."""

from tetrad.parallel.launch import spawn


def run_ranks(fn, nprocs: int, *args, timeout_s: float = 180.0) -> list:
    """fn(rank, world_size, *args) on every rank -> [result of rank 0, rank 1, ...]."""
    return spawn(fn, nprocs, args, timeout_s=timeout_s, collective_timeout_s=60.0)
