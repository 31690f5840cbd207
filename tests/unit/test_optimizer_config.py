"""Config validation (errors name the bad value) and the loss scalers, without a process group."""
import pytest
import torch
from torch import nn

from megatron_core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron_core.optimizer import DynamicGradScaler, OptimizerConfig, get_optimizer


@pytest.mark.parametrize("kwargs, message", [
    (dict(zero_stage=4), "zero_stage 4"),
    (dict(zero_stage=-1), "zero_stage -1"),
    (dict(bucket_size=0), "bucket_size 0"),
])
def test_bad_ddp_config_names_the_value(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DistributedDataParallelConfig(**kwargs)


@pytest.mark.parametrize("kwargs, message", [
    (dict(fp16=True, bf16=True), "fp16=True and bf16=True"),
    (dict(optimizer="lamb"), "optimizer 'lamb'"),
    (dict(hysteresis=0), "hysteresis 0"),
    (dict(loss_scale=-1.0), "loss_scale -1.0"),
])
def test_bad_optimizer_config_names_the_value(kwargs, message):
    with pytest.raises(ValueError, match=message):
        OptimizerConfig(**kwargs)


def test_sharding_strategy_names_map_to_stages():
    assert DistributedDataParallelConfig.from_sharding_strategy("optim_grads_params").zero_stage == 3
    with pytest.raises(ValueError, match="'full'"):
        DistributedDataParallelConfig.from_sharding_strategy("full")


def test_dynamic_scaler_hysteresis_and_growth():
    scaler = DynamicGradScaler(initial_scale=8.0, min_scale=2.0, growth_interval=2, hysteresis=2)
    for found_inf, expected in [(True, 8.0), (True, 4.0), (True, 2.0), (True, 2.0), (False, 2.0), (False, 4.0)]:
        scaler.update(found_inf)
        assert scaler.scale == expected


def test_single_process_wrapper_matches_plain_module():
    """dp group None: DDP is a pass-through whose optimizer steps equal the unwrapped module's."""
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    torch.manual_seed(0)
    wrapped = DistributedDataParallel(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)),
                                      config=DistributedDataParallelConfig(bucket_size=10), dp_group=None)
    x = torch.randn(5, 4)
    optimizers = [get_optimizer(OptimizerConfig(lr=0.1), m) for m in (plain, wrapped)]
    for _ in range(3):
        for model, optimizer in zip((plain, wrapped), optimizers):
            optimizer.zero_grad()
            model(x).square().mean().backward()
            assert optimizer.step()[0]
    for a, b in zip(plain.state_dict().values(), wrapped.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    wrapped.module.vocab_size = 11
    assert wrapped.vocab_size == 11  # attributes not on the wrapper are looked up on the module
