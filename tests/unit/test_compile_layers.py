"""What --compile changes without compiling anything (torch.compile is lazy): which layers get a compiled
forward, the ZeRO-3 units of a compiled layer (one unit, no hooks inside), the flag, and incremental decoding
(eager inside compiled layers). The compiled numerics are tested in tests/integration/test_compile.py."""
import torch

from megatron_core import initialize_model_parallel
from megatron_core.distributed.zero3 import plan_units
from megatron_core.training.arguments import parse_args, transformer_config
from megatron_core.transformer import InferenceCache, TransformerLayer
from megatron_core.transformer.compile import is_compiled
from tests.model_helpers import SEQ, VOCAB, build_model, tiny_config


def test_config_compile_compiles_each_layer_and_zero3_gathers_it_whole():
    state = initialize_model_parallel()
    model = build_model(tiny_config(compile=True), state)
    layers = [m for m in model.modules() if isinstance(m, TransformerLayer)]
    assert len(layers) == 2 and all(is_compiled(layer) for layer in layers)
    assert not is_compiled(model) and not is_compiled(model.decoder)
    assert list(model.state_dict()) == list(build_model(tiny_config(), state).state_dict())  # same names
    units = plan_units(model)
    for layer in layers:
        assert units[layer] == [p for p in layer.parameters() if p.requires_grad]
        assert not any(m in units for m in layer.modules() if m is not layer)  # no hook inside compiled code
    eager_units = plan_units(build_model(tiny_config(), state))
    assert len(eager_units) > len(units)


def test_compile_flag():
    assert transformer_config(parse_args(["--compile"])).compile
    assert not transformer_config(parse_args([])).compile


def test_incremental_decoding_of_a_compiled_model_runs_eager_and_matches():
    state = initialize_model_parallel()
    model = build_model(tiny_config(compile=True), state).eval()
    reference = build_model(tiny_config(), state).eval()
    tokens = torch.randint(0, VOCAB, (2, SEQ))
    with torch.no_grad():
        full = reference(tokens, torch.arange(SEQ).expand(2, SEQ))
        cache = InferenceCache(max_sequence_length=SEQ, batch_size=2)
        steps = [model(tokens[:, :4], None, inference_cache=cache)]
        steps += [model(tokens[:, i:i + 1], None, inference_cache=cache) for i in range(4, SEQ)]
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=0, atol=1e-5)
