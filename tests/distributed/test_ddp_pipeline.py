"""DistributedDataParallel inside the pipeline schedules (pp 2 x dp 2): no_sync over micro-batches,
finalize_model_grads (tied embeddings across stages), fp32 results equal at every ZeRO stage, and the tied
copies stay identical."""
import pytest
import torch

from megatron_core import destroy_model_parallel, initialize_model_parallel
from megatron_core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron_core.optimizer import OptimizerConfig, get_optimizer
from megatron_core.pipeline_parallel import get_forward_backward_func
from tests.distributed.test_pipeline_schedules import MICRO_BATCH, _batches, _build_chunks, _forward_step
from tests.model_helpers import SEQ


def _pipeline_ddp(stage: int, zero_bubble: bool = False, defer=None):
    """Two optimizer steps of pp 2 x dp 2 at ZeRO ``stage``: (parameters, the tied weight, grad norms, the
    order the buckets were reduced in)."""
    state = initialize_model_parallel(pipeline_model_parallel_size=2)
    _, (model,) = _build_chunks(state, 4, None)
    ddp = DistributedDataParallel(model, config=DistributedDataParallelConfig(zero_stage=stage, bucket_size=300),
                                  dp_group=state.dp_group)
    optimizer = get_optimizer(OptimizerConfig(lr=1e-2, weight_decay=0.1, clip_grad=0.5), ddp,
                              parallel_state=state)
    schedule = get_forward_backward_func(2, zero_bubble=zero_bubble, zero_bubble_defer=defer)
    norms = []
    for step in range(2):
        optimizer.zero_grad()
        batches = _batches(8)[state.dp_rank * 4:(state.dp_rank + 1) * 4]
        schedule(forward_step_func=_forward_step, data_iterator=iter(batches), model=ddp, num_microbatches=4,
                 seq_length=SEQ, micro_batch_size=MICRO_BATCH, parallel_state=state)
        ok, norm, _ = optimizer.step()
        assert ok
        norms.append(norm)
    params = {name: value.clone() for name, value in ddp.state_dict().items()}
    tied = params["embedding.word_embeddings.weight" if state.is_pipeline_first_stage else "output_layer.weight"]
    launches = list(ddp.launch_log)
    destroy_model_parallel(state)
    return params, tied, norms, launches


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_stages_in_pipeline_match_stage0(distributed, stage):
    reference = distributed(4, _pipeline_ddp, 0)
    results = distributed(4, _pipeline_ddp, stage)
    for rank, ((params, _, norms, _), (ref_params, _, ref_norms, _)) in enumerate(zip(results, reference)):
        for name, value in params.items():
            torch.testing.assert_close(value, ref_params[name], rtol=0, atol=1e-5, msg=f"rank {rank} {name}")
        torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), rtol=1e-5, atol=0)
    # ranks 0, 1: first stage (dp 0, 1); ranks 2, 3: last stage. Tied copies equal, dp replicas equal.
    assert torch.equal(results[0][1], results[2][1]) and torch.equal(results[0][1], results[1][1])
