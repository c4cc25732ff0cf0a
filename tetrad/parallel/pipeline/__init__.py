"""Pipeline parallelism: the model cut into stages (the cut is tetrad.planner.partition's, which
the planner shares) and one executor that runs any schedule of tetrad.schedules over them with
counted point-to-point messages. See the Runtime section of docs/pipeline.md."""

from tetrad.parallel.pipeline.executor import PipelineExecutor, StepStats
from tetrad.parallel.pipeline.stage import PipelineStage, build_stages, embedding_group
from tetrad.planner.partition import Partition, partition, piece_costs

__all__ = ["PipelineExecutor", "StepStats", "Partition", "partition", "piece_costs",
           "PipelineStage", "build_stages", "embedding_group"]
