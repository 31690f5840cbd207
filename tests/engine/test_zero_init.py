"""``zero.Init`` (sharded construction of a model we did not write) and ``zero.GatheredParameters``: under Init a
transformers GPT-2 never has more than about one parameter's storage alive, each rank keeps 1/dp of it at
stage 3, the weights are the same at every dp size and stage (and follow the model's own init distributions),
training from them equals plain torch; GatheredParameters reads full weights and writes a modifier rank's."""
import pytest
import torch

from megatron_core import engine as deepspeed
from megatron_core.engine import zero
from megatron_core.utils.live_memory import LiveMemoryTracker
from tests.engine.common import STEPS, ds_config, full_state, gpt2, reference, train_steps


def _build(stage, *, train=False):
    with zero.Init():
        model = gpt2()
    recorded = all(p.is_meta and p.init_recipe is not None for p in model.parameters())
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config(stage))
    shard = sum(b.param_shard.numel() for b in engine.ddp.buckets) if stage == 3 else None
    state = full_state(engine)
    losses = train_steps(engine, "gpt2", range(STEPS)) if train else None
    return recorded, shard, state, losses


def test_weights_are_layout_independent_and_train_like_plain_torch(distributed):
    (recorded, _, single, _), = distributed(1, _build, 0)
    assert recorded
    results = distributed(2, _build, 3, train=True)
    total = sum(v.numel() for k, v in single.items() if k != "lm_head.weight")
    for recorded, shard, state, _ in results:
        assert recorded and shard <= total // 2 + 2 * len(state)  # 1/dp of the parameters (plus padding)
        for name, value in single.items():
            assert torch.equal(state[name], value), name  # bit for bit at dp 1 stage 0 and dp 2 stage 3
    # the model's own init distributions: N(0, 0.02), c_proj scaled by 1/sqrt(2 layers), biases 0, norms 1
    assert single["transformer.h.0.attn.c_attn.weight"].std() == pytest.approx(0.02, rel=0.1)
    assert single["transformer.h.1.mlp.c_proj.weight"].std() == pytest.approx(0.02 / 2, rel=0.1)
    assert not single["transformer.h.0.attn.c_attn.bias"].any() and single["transformer.ln_f.weight"].eq(1).all()
    assert torch.equal(single["lm_head.weight"], single["transformer.wte.weight"])
    plain = gpt2()
    plain.load_state_dict(single)
    losses, _, _ = reference("gpt2", model=plain)
    assert results[0][3] == pytest.approx(losses, abs=1e-5)


def test_construction_holds_about_one_parameter_at_a_time():
    def peak(sharded):
        with LiveMemoryTracker() as tracker:
            if sharded:
                with zero.Init():
                    model = gpt2(layers=4)
            else:
                model = gpt2(layers=4)
        return tracker.peak_total, model
    plain_peak, plain = peak(False)
    init_peak, model = peak(True)
    total = sum(p.numel() * 4 for p in plain.parameters())
    largest = max(p.numel() * 4 for p in plain.parameters())
    assert plain_peak >= total
    assert init_peak <= 2 * largest < total / 6, (init_peak, largest, total)  # the plain build: all of it
    assert all(p.is_meta for p in model.parameters())


def _gathered(modifier):
    with zero.Init():
        model = gpt2()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config(3))
    weight = engine.module.transformer.wte.weight
    outside = tuple(weight.shape)
    with zero.GatheredParameters(weight, modifier_rank=modifier):
        inside = tuple(weight.shape)
        with torch.no_grad():
            weight[0] = 0.5 if engine.state.dp_rank == 0 else 9.0  # only the modifier rank's change counts
    with zero.GatheredParameters([weight]):
        row = weight[0].clone()
    tied = engine.module.lm_head.weight is weight
    return outside, inside, row, tied, tuple(weight.shape)


def test_gathered_parameters_read_and_modify(distributed):
    for outside, inside, row, tied, after in distributed(2, _gathered, 0):
        assert outside == (0,) and after == (0,) and inside == (64, 32) and tied
        assert torch.equal(row, torch.full((32,), 0.5))
    rows = [r[2] for r in distributed(2, _gathered, None)]  # read-only: each rank's edit is dropped
    assert not torch.equal(rows[0], torch.full((32,), 0.5)) and torch.equal(rows[0], rows[1])


def test_init_options():
    with zero.Init(config_dict_or_path={"fp16": {"enabled": True}}):
        half = torch.nn.Linear(4, 4)
    assert half.weight.is_meta and half.weight.dtype == torch.float16
    with zero.Init(enabled=False):
        real = torch.nn.Linear(4, 4)
    assert not real.weight.is_meta
    with zero.Init():
        padded = torch.nn.Embedding(6, 3, padding_idx=2)
        trunc = torch.nn.Parameter(torch.empty(5, 5))
        holder = torch.nn.Module()
        holder.weight = trunc
        torch.nn.init.trunc_normal_(holder.weight, std=0.5, a=-0.4, b=0.4)
    from megatron_core.engine.zero_init import materialize_
    materialize_(padded, device=torch.device("cpu"))
    materialize_(holder, device=torch.device("cpu"))
    assert padded.weight[2].eq(0).all() and padded.weight[0].ne(0).all()
    assert holder.weight.abs().max() <= 0.4 and holder.weight.std() > 0.1
