"""The planner counts what optimizer offload moves off the device and, when no layout fits, recommends
``--optimizer-nvme-offload-dir`` with the best layout that fits once the states are offloaded."""
import contextlib
import io

import torch

from megatron_core.config import TransformerConfig
from megatron_core.planning.planner import Hardware, Workload, rank_plans
from tests.recipe import RECIPE
from tools.plan_parallelism import main

MODEL = [*RECIPE, "--num-layers", "8", "--hidden-size", "256", "--num-attention-heads", "8", "--seq-length", "256",
         "--max-position-embeddings", "256", "--micro-batch-size", "1", "--global-batch-size", "8", "--bf16",
         "--vocab-size", "1000"]


def test_offloadable_bytes_are_masters_and_adam_states():
    base = TransformerConfig(num_layers=8, hidden_size=256, num_attention_heads=8, max_position_embeddings=256,
                             params_dtype=torch.bfloat16, bf16=True)
    workload = Workload(vocab_size=1000, seq_length=256, micro_batch_size=1, global_batch_size=8)
    for plan in rank_plans(base, workload, Hardware(num_devices=8, memory_per_device_gb=0.008, peak_tflops=100.0)):
        # bf16: params 2 + grads 4 + masters 4 + Adam 8 bytes per element; masters and Adam are sharded by ZeRO
        assert 0 < plan.offloadable_bytes < plan.model_state_bytes
        assert plan.fits_with_offload == (plan.memory_bytes - plan.offloadable_bytes <= 0.008 * 2**30)


def test_recommends_nvme_offload_when_nothing_fits():
    for budget, expected in (("0.008", "--optimizer-nvme-offload-dir"), ("0.005", "not even with optimizer offload")):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            status = main(["--num-devices", "8", "--memory-per-device-gb", budget, *MODEL])
        assert status == 1 and expected in out.getvalue()


def test_optimizer_instances_shard_the_states_over_one_instance():
    """--num-distributed-optimizer-instances N: ZeRO-1 shards masters and Adam states over dp / N ranks."""
    from megatron_core.planning.planner import model_state_bytes, stage_parameters
    config = TransformerConfig(num_layers=8, hidden_size=256, num_attention_heads=8, max_position_embeddings=256,
                               params_dtype=torch.bfloat16, bf16=True, pipeline_model_parallel_size=1,
                               tensor_model_parallel_size=1)
    workload = Workload(vocab_size=1000, seq_length=256, micro_batch_size=1, global_batch_size=8)
    params, _ = stage_parameters(config, workload, pp_rank=0)
    flat, two = (model_state_bytes(config, workload, pp_rank=0, dp=4, zero_stage=1, instances=n) for n in (1, 2))
    assert two - flat == (4 + 8) * params * (1 / 2 - 1 / 4)  # fp32 masters + Adam, over 2 ranks instead of 4
    assert two == model_state_bytes(config, workload, pp_rank=0, dp=2, zero_stage=1)
