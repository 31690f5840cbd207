"""The engine at dp 2 equals a single-process plain-torch loop (same weights, data, optimizer) within 1e-5 in
fp32: at ZeRO stages 0-3, on models we did not write (transformers' GPT-2 with Conv1D and tied embeddings, an
nn.Sequential, a module used twice with a parameter used twice and a buffer), with SGD, param groups, a client
optimizer and scheduler, gradient accumulation, and CPU / NVMe offload of optimizer states and ZeRO-3 shards."""
import pytest
import torch

from megatron_core import engine as deepspeed
from tests.engine.common import (
    EPS,
    GLOBAL_BATCH,
    LR,
    MICRO,
    MODELS,
    STEPS,
    WEIGHT_DECAY,
    batch,
    ds_config,
    full_state,
    loss_of,
    reference,
    train_steps,
)

ATOL = 1e-5


def _no_decay_groups(model):
    """HF's usual groups: no weight decay on biases and norm weights."""
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    rest = [p for n, p in model.named_parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": rest, "weight_decay": 0.0}]


class _Recomputed(torch.nn.Module):
    """nn.Sequential's layers, each recomputed in backward through the engine's checkpointing.checkpoint."""

    def __init__(self, layers):
        super().__init__()
        self.layers = layers

    def forward(self, x):
        for layer in self.layers:
            x = deepspeed.checkpointing.checkpoint(layer, x)
        return x


def _frozen_positions(model):
    model.transformer.wpe.weight.requires_grad_(False)
    return model


def _run(kind, config, *, groups=None, client_optimizer=None, client_scheduler=None, steps=STEPS,
         recompute=False, freeze=False):
    model = MODELS[kind]()
    if freeze:
        model = _frozen_positions(model)
        groups = lambda m: [p for p in m.parameters() if p.requires_grad]  # noqa: E731 (DeepSpeed's idiom)
    if recompute and kind == "gpt2":  # transformers' own (torch.utils.checkpoint, not reentrant)
        model.gradient_checkpointing_enable()
    elif recompute:
        model = _Recomputed(model)
    params = groups(model) if groups is not None else model.parameters()
    optimizer = client_optimizer(params) if client_optimizer is not None else None
    scheduler = client_scheduler(optimizer) if client_scheduler is not None else None
    engine, engine_optimizer, _, engine_scheduler = deepspeed.initialize(
        model=model, model_parameters=params if optimizer is None else None, optimizer=optimizer,
        lr_scheduler=scheduler, config=config)
    losses = train_steps(engine, kind, range(steps))
    engine.eval()
    with torch.no_grad():  # an eval forward (ZeRO-3: gathered and freed without grad)
        eval_loss = float(loss_of(kind, engine, batch(kind, 99)))
    engine.train()
    counters = {"eval_loss": eval_loss,"global_steps": engine.global_steps, "micro_steps": engine.micro_steps,
                "global_samples": engine.global_samples, "lr": engine.get_lr(),
                "grad_norm": engine.get_global_grad_norm(), "dtypes": {p.dtype for p in engine.module.parameters()},
                "optimizer_is_returned": engine_optimizer is engine.optimizer,
                "scheduler_is_returned": engine_scheduler is engine.lr_scheduler,
                "released": all(p.numel() == 0 for p in engine.module.parameters())}
    return losses, full_state(engine), counters


def _assert_equal(results, expected_losses, expected_state, atol=ATOL):
    for losses, state, _ in results:
        assert losses == pytest.approx(expected_losses, abs=atol, rel=0)
        assert state.keys() == expected_state.keys()
        for name, value in state.items():
            torch.testing.assert_close(value, expected_state[name], rtol=0, atol=atol, msg=name)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_gpt2_matches_plain_torch_at_every_stage(distributed, stage):
    losses, state, norms = reference("gpt2")
    results = distributed(2, _run, "gpt2", ds_config(stage))
    _assert_equal(results, losses, state)
    counters = results[0][2]
    accumulation = GLOBAL_BATCH // MICRO // 2
    assert (counters["global_steps"], counters["micro_steps"], counters["global_samples"]) == \
        (STEPS, STEPS * accumulation, STEPS * GLOBAL_BATCH)
    assert counters["grad_norm"] == pytest.approx(norms[-1], rel=1e-5)  # the clipped step's unclipped norm
    assert counters["lr"] == [LR] and counters["optimizer_is_returned"]
    assert counters["released"] == (stage == 3)  # ZeRO-3: every parameter freed outside forward and backward
    trained = MODELS["gpt2"]()
    trained.load_state_dict(state)
    trained.eval()
    with torch.no_grad():
        assert counters["eval_loss"] == pytest.approx(float(loss_of("gpt2", trained, batch("gpt2", 99))), abs=1e-5)
    assert torch.equal(results[0][1]["lm_head.weight"], results[0][1]["transformer.wte.weight"])  # still tied


@pytest.mark.parametrize("kind, stage", [("sequential", 1), ("sequential", 3), ("shared_use", 0),
                                         ("shared_use", 3)])
def test_models_we_did_not_write(distributed, kind, stage):
    losses, state, _ = reference(kind)
    _assert_equal(distributed(2, _run, kind, ds_config(stage)), losses, state)


def test_zero3_units_without_grouping_small_parameters(distributed):
    """stage3_param_persistence_threshold 0: every module's biases and norm weights are its own units."""
    config = ds_config(3)
    config["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    losses, state, _ = reference("gpt2")
    _assert_equal(distributed(2, _run, "gpt2", config), losses, state)


@pytest.mark.parametrize("kind", ["gpt2", "sequential"])
def test_activation_checkpointing_at_stage_3(distributed, kind):
    losses, state, _ = reference(kind)
    results = distributed(2, _run, kind, ds_config(3), recompute=True)
    if kind == "sequential":  # the wrapper's names
        results = [(losses_, {k.replace("layers.", "", 1): v for k, v in s.items()}, c) for losses_, s, c in results]
    _assert_equal(results, losses, state)


@pytest.mark.parametrize("stage", [1, 3])
def test_frozen_parameters(distributed, stage):
    """model_parameters=filter(requires_grad): the frozen position embedding stays as built."""
    losses, state, _ = reference("gpt2", model=_frozen_positions(MODELS["gpt2"]()),
                                 groups=lambda m: [p for p in m.parameters() if p.requires_grad])
    results = distributed(2, _run, "gpt2", ds_config(stage), freeze=True)
    _assert_equal(results, losses, state)
    assert torch.equal(results[0][1]["transformer.wpe.weight"], MODELS["gpt2"]().transformer.wpe.weight)


def test_sgd_with_momentum(distributed):
    losses, state, _ = reference("sequential", optimizer="sgd")
    _assert_equal(distributed(2, _run, "sequential", ds_config(2, optimizer="SGD")), losses, state)


def test_param_groups_without_weight_decay(distributed):
    losses, state, _ = reference("gpt2", groups=_no_decay_groups)
    _assert_equal(distributed(2, _run, "gpt2", ds_config(3), groups=_no_decay_groups), losses, state)


def _client_adamw(params):
    return torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY, eps=EPS)


def _client_lambda(optimizer):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))


def test_client_optimizer_and_scheduler(distributed):
    """A torch.optim.AdamW over param groups and a LambdaLR on it, passed in instead of the config's."""
    config = {k: v for k, v in ds_config(1).items() if k != "optimizer"}
    losses, state, _ = reference("gpt2", groups=_no_decay_groups, scheduler=_client_lambda)
    results = distributed(2, _run, "gpt2", config, groups=_no_decay_groups, client_optimizer=_client_adamw,
                          client_scheduler=_client_lambda)
    _assert_equal(results, losses, state)
    assert results[0][2]["lr"] == [pytest.approx(LR / (1 + STEPS))] * 2 and results[0][2]["scheduler_is_returned"]


@pytest.mark.parametrize("stage, optimizer_device, param_device", [(2, "cpu", "none"), (1, "nvme", "none"),
                                                                    (3, "nvme", "nvme")])
def test_offload_matches_plain_torch(distributed, tmp_path, stage, optimizer_device, param_device):
    zero = {"stage": stage, "offload_optimizer": {"device": optimizer_device, "nvme_path": str(tmp_path)}}
    if param_device != "none":
        zero["offload_param"] = {"device": param_device, "nvme_path": str(tmp_path)}
    losses, state, _ = reference("gpt2")
    _assert_equal(distributed(2, _run, "gpt2", {**ds_config(stage), "zero_optimization": zero}), losses, state)


def test_bf16_close_to_fp32_with_fp32_masters(distributed):
    losses, _, _ = reference("gpt2")
    results = distributed(2, _run, "gpt2", {**ds_config(2), "bf16": {"enabled": True}})
    bf16_losses, state, counters = results[0]
    assert counters["dtypes"] == {torch.bfloat16}
    assert bf16_losses == pytest.approx(losses, abs=3e-2)
    assert bf16_losses != pytest.approx(losses, abs=1e-6)  # it did run in bf16


def _logged(config):
    import logging
    records = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logger = logging.getLogger("megatron_core.engine.engine")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        _run("sequential", config)
    finally:
        logger.removeHandler(handler)
    return records


def test_steps_per_print_and_wall_clock_breakdown(distributed):
    records = distributed(2, _logged, {**ds_config(1), "steps_per_print": 2, "wall_clock_breakdown": True})
    assert records[1] == []  # rank 0 reports
    steps = [r for r in records[0] if r.startswith("step=")]
    assert [s.split(",")[0] for s in steps] == ["step=2", "step=4"] and "lr=[0.01]" in steps[0]
    assert sum(r.startswith("time (ms) | forward: ") for r in records[0]) == 2
