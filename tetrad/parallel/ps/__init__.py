"""Parameter-server training (docs/parameter_server.md): server ranks own key ranges of the
parameters and run the optimizer; worker ranks push gradients and pull parameters; the first
server schedules (membership, clocks, bounded staleness). The worker's strategy is
tetrad.train.ps_strategy."""

from tetrad.parallel.ps.protocol import KeyLayout, PSOptions, Roles
from tetrad.parallel.ps.server import ParameterServer
from tetrad.parallel.ps.worker import WorkerClient

__all__ = ["KeyLayout", "PSOptions", "Roles", "ParameterServer", "WorkerClient"]
