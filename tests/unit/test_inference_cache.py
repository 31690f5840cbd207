"""The KV cache gives the logits of the full forward; openai_gelu; the streaming safetensors writer."""
import hashlib

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from megatron_core import initialize_model_parallel
from megatron_core.checkpointing.streaming import StreamingSafetensorsWriter
from megatron_core.inference import sample_token
from megatron_core.transformer import InferenceCache
from megatron_core.transformer.mlp import MLP
from tests.model_helpers import SEQ, VOCAB, build_model, tiny_config


@pytest.mark.parametrize("overrides", [{}, {"num_query_groups": 2, "position_embedding_type": "rope",
                                            "activation": "swiglu", "normalization": "RMSNorm"}])
def test_incremental_decoding_equals_full_forward(overrides):
    state = initialize_model_parallel()
    model = build_model(tiny_config(**overrides), state).eval()
    tokens = torch.randint(0, VOCAB, (2, SEQ))
    positions = torch.arange(SEQ).unsqueeze(0).expand(2, SEQ)
    with torch.no_grad():
        full = model(tokens, positions)
        cache = InferenceCache(max_sequence_length=SEQ, batch_size=2)
        steps = [model(tokens[:, :3], None, inference_cache=cache)]
        steps += [model(tokens[:, i:i + 1], None, inference_cache=cache) for i in range(3, 5)]
        steps.append(model(tokens[:, 5:], None, inference_cache=cache))  # several new tokens after a cache
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=0, atol=1e-5)
    assert cache.offset == SEQ
    with pytest.raises(ValueError, match="inference cache holds 8 tokens"):
        model(tokens[:, :1], None, inference_cache=cache)


def test_openai_gelu_is_the_tanh_approximation():
    state = initialize_model_parallel()
    mlp = MLP(tiny_config(openai_gelu=True), layer_number=1, parallel_state=state)
    x = torch.randn(5) * 3
    torch.testing.assert_close(mlp.activation(x), F.gelu(x, approximate="tanh"))
    assert not torch.allclose(mlp.activation(x), F.gelu(x))
    with pytest.raises(ValueError, match="openai_gelu=True .* activation='swiglu'"):
        tiny_config(openai_gelu=True, activation="swiglu")


def test_streaming_writer_writes_a_safetensors_file(tmp_path):
    tensors = {"a": torch.randn(3, 5), "b": torch.arange(7, dtype=torch.int64), "c": torch.randn(2).bfloat16()}
    writer = StreamingSafetensorsWriter(str(tmp_path / "x.safetensors"),
                                        [(k, v.dtype, v.shape) for k, v in tensors.items()])
    with pytest.raises(ValueError, match="expected tensor 'a' next"):
        writer.write("b", tensors["b"])
    for name, tensor in tensors.items():
        writer.write(name, tensor)
    writer.close()
    loaded = load_file(tmp_path / "x.safetensors")
    assert all(torch.equal(loaded[k], v) for k, v in tensors.items())
    data = (tmp_path / "x.safetensors").read_bytes()  # hashed while written: no second read for metadata.json
    assert (writer.sha256, writer.size) == (hashlib.sha256(data).hexdigest(), len(data))


def test_sampling_respects_top_k_and_top_p():
    logits = torch.tensor([0.0, 5.0, 4.0, -1.0])
    g = torch.Generator().manual_seed(0)
    assert sample_token(logits, greedy=True) == 1
    assert {sample_token(logits, greedy=False, top_k=2, generator=g) for _ in range(50)} <= {1, 2}
    assert {sample_token(logits, greedy=False, top_p=0.5, generator=g) for _ in range(50)} == {1}
