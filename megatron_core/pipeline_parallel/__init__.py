"""Pipeline parallelism: point-to-point transfers, the schedules, and a timeline of what each rank did."""
from megatron_core.pipeline_parallel.schedules import (
    PipelineError,
    forward_backward_no_pipelining,
    forward_backward_pipelining_with_interleaving,
    forward_backward_pipelining_without_interleaving,
    get_forward_backward_func,
)
from megatron_core.pipeline_parallel.timeline import Timeline

__all__ = ["get_forward_backward_func", "forward_backward_no_pipelining",
           "forward_backward_pipelining_without_interleaving", "forward_backward_pipelining_with_interleaving",
           "PipelineError", "Timeline"]
