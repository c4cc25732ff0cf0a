"""The parameter server's part of the run report (docs/parameter_server.md, "The run report"): a
server's rank entry, and the scheduler's assembly of every rank's entry and the run summary."""

from __future__ import annotations

import time

from tetrad.parallel.ps.protocol import empty_entry, per_step_by_tag


def server_entry(server) -> dict:
    """A ParameterServer's run-report entry."""
    entry = empty_entry(server.rank, "server")
    entry["server"] = server.index
    entry["bytes"] = server.bytes_held()
    entry["comm_bytes"].update(server.comm.counter.totals_per_step())
    entry["idle_fraction"] = server.idle_s / max(time.perf_counter() - server.started, 1e-9)
    entry["parameter_server"] = {"sent_per_step": per_step_by_tag(server.comm.counter),
                                 "received_per_step": per_step_by_tag(server.received),
                                 "updates_applied": server.updates,
                                 "key_ranges": sorted(server.served),
                                 "replica_bytes": server.standby.bytes_held()}
    return entry


def run_report(scheduler) -> dict:
    """Every rank's entry, in rank order (dead ranks' zero, marked "dead"), and the summary:
    what the scheduler (a ParameterServer) sends the workers at the end of the run."""
    entries = {rank: {**entry, "role": "worker"} for rank, entry in scheduler.done.items()}
    for worker in scheduler.book.dead:
        entries[worker] = {**empty_entry(worker, "worker"), "dead": True}
    for server in scheduler.standby.dead_servers:
        entries[server] = {**empty_entry(server, "server"), "dead": True}
    for spare in scheduler.roles.spares:  # a spare that never joined
        entries.setdefault(spare, empty_entry(spare, "spare"))
    entries.update(scheduler.server_entries)
    entries[scheduler.rank] = server_entry(scheduler)
    summary = {**scheduler.book.summary(), "num_servers": scheduler.roles.num_servers,
               "dead_servers": sorted(scheduler.standby.dead_servers),
               "joined": {str(spare): slot for spare, slot in scheduler.members.joined.items()}}
    return {"ranks": [entries[rank] for rank in range(scheduler.world.size)],
            "summary": summary}
