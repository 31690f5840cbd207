"""A DeepSpeed-compatible engine for any PyTorch model, configured by DeepSpeed's JSON (see docs/engine.md).

    from megatron_core import engine as deepspeed      # instead of `import deepspeed`

    deepspeed.init_distributed()
    model_engine, optimizer, loader, lr_scheduler = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), training_data=dataset, config="ds_config.json")
    for batch in loader:
        loss = model_engine(batch)
        model_engine.backward(loss)
        model_engine.step()
    model_engine.save_checkpoint("checkpoints", client_state={"epoch": 1})

A thin shell over megatron_core: ``DistributedDataParallel`` (ZeRO 0-3, its buckets and gathers), the
``MegatronOptimizer`` (fp32 masters, loss scaling, clipping, CPU/NVMe offload) and the checkpoint pieces.
"""
from megatron_core.engine import activation_checkpointing as checkpointing
from megatron_core.engine import lr_schedules, zero
from megatron_core.engine.checkpoint import FORMAT as CHECKPOINT_FORMAT
from megatron_core.engine.config import EngineConfig
from megatron_core.engine.data import EngineDataLoader, RepeatingLoader
from megatron_core.engine.engine import Engine
from megatron_core.engine.initialize import init_distributed, initialize
from megatron_core.engine.schema import UnusedConfigWarning

DeepSpeedEngine = Engine  # DeepSpeed's name for it

__all__ = ["CHECKPOINT_FORMAT", "DeepSpeedEngine", "Engine", "EngineConfig", "EngineDataLoader", "RepeatingLoader",
           "UnusedConfigWarning", "checkpointing", "init_distributed", "initialize", "lr_schedules", "zero"]
