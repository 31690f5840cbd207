"""Hugging Face deepseek_v3 and gpt_oss (and Mistral with a sliding window) through tools/checkpoint_convert.py,
against transformers itself (fp32): DeepSeek-V3 with q_lora_rank and YaRN (mscale, mscale_all_dim), without
q_lora_rank, group-limited sigmoid routing with a correction bias, a dense first layer and a shared expert;
gpt-oss with sinks, sliding-window layers that a 12-token sequence exercises (window 4), YaRN, and clamped
GeGLU experts with biases. Imports at tp 1, tp 2 (sequence parallel) and ep 2 give transformers' logits (and
greedy tokens); exports load back into transformers with no missing or unexpected keys; a hub DeepSeek-V3
folder's MTP layer (layer ``num_hidden_layers``) becomes ``mtp.layers.0`` and is written back."""
import json

import pytest
import torch

from tests.integration.test_hf_families import TOKENS, _convert, _hf_logits

transformers = pytest.importorskip("transformers")

YARN = {"rope_type": "yarn", "factor": 4.0, "mscale": 1.0, "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 16, "beta_fast": 32.0, "beta_slow": 1.0, "rope_theta": 10000.0}
DEEPSEEK = dict(hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_attention_heads=4,
                num_key_value_heads=4, num_hidden_layers=2, n_routed_experts=4, num_experts_per_tok=2, n_group=2,
                topk_group=1, first_k_dense_replace=1, n_shared_experts=1, routed_scaling_factor=2.5, vocab_size=100,
                kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8, max_position_embeddings=64,
                initializer_range=0.2, tie_word_embeddings=False)
FAMILIES = {
    "deepseek_v3": (transformers.DeepseekV3Config, dict(DEEPSEEK, q_lora_rank=16, rope_parameters=YARN)),
    "deepseek_v3_no_q_lora": (transformers.DeepseekV3Config, dict(DEEPSEEK, q_lora_rank=None)),
    "gpt_oss": (transformers.GptOssConfig, dict(
        hidden_size=32, intermediate_size=16, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2, vocab_size=100, sliding_window=4,
        layer_types=["sliding_attention", "full_attention"], max_position_embeddings=64, initializer_range=0.2,
        rope_parameters={**YARN, "truncate": False, "mscale": None, "mscale_all_dim": None})),
    "mistral_window": (transformers.MistralConfig, dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=100, max_position_embeddings=64, initializer_range=0.2, sliding_window=4)),
}
MOE = ("deepseek_v3", "deepseek_v3_no_q_lora", "gpt_oss")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """{family: (HF folder, transformers' logits)}; routers and sinks drawn wide so that no two experts tie."""
    base = tmp_path_factory.mktemp("hf_frontier")
    out = {}
    for i, (family, (config_class, extra)) in enumerate(FAMILIES.items()):
        torch.manual_seed(40 + i)
        model = transformers.AutoModelForCausalLM.from_config(config_class(**extra)).eval()
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith(("gate.weight", "router.weight", "sinks", "e_score_correction_bias")):
                    param.normal_(0.0, 1.0)
            for name, buffer in model.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    buffer.normal_(0.0, 0.1)
        model.save_pretrained(base / family)
        with torch.no_grad():
            out[family] = (base / family, model(TOKENS).logits)
    return out


@pytest.mark.parametrize("family", list(FAMILIES))
def test_import_at_tp1_matches_transformers(folders, family, tmp_path, capsys):
    assert _convert(folders[family][0], tmp_path / "tp1", "--check") == 0
    difference = float(capsys.readouterr().out.split("= ")[-1])
    assert difference <= 1e-5, (family, difference)
    config = json.loads(next((tmp_path / "tp1").glob("iter_*/metadata.json")).read_text())["config"]
    if family.startswith("deepseek"):
        assert config["multi_latent_attention"] and config["moe_router_num_groups"] == 2
        assert config["moe_layer_freq"] == [0, 1] and config["moe_router_topk_scaling_factor"] == 2.5
    if family == "gpt_oss":
        assert config["softmax_type"] == "learnable" and config["window_size"] == [3, 0]
        assert config["window_attn_skip_freq"] == [1, 0] and config["quick_geglu"]
    if family == "mistral_window":
        assert config["window_size"] == [3, 0]


def _logits(directories, tokens, tp, ep):
    from megatron_core import initialize_model_parallel
    from megatron_core.inference import load_gpt_from_checkpoint, pipeline_forward
    state = initialize_model_parallel(tp, 1, expert_model_parallel_size=ep)
    with torch.no_grad():
        return [pipeline_forward(load_gpt_from_checkpoint(d, state, sequence_parallel=tp > 1)[0], state, tokens)
                for d in directories]


@pytest.mark.parametrize("tp, ep", [(2, 1), (1, 2)])
def test_import_at_tp2_and_ep2_matches_transformers(distributed, folders, tmp_path, tp, ep):
    families = list(FAMILIES) if ep == 1 else list(MOE)
    for family in families:
        assert _convert(folders[family][0], tmp_path / family, "--target-tensor-parallel-size", str(tp),
                        "--target-expert-parallel-size", str(ep)) == 0
    results = distributed(2, _logits, [str(tmp_path / f) for f in families], TOKENS, tp, ep)
    for family, logits in zip(families, results[0]):
        torch.testing.assert_close(logits, folders[family][1], rtol=0, atol=1e-5, msg=f"{family} tp{tp} ep{ep}")
        assert torch.equal(logits.argmax(-1), folders[family][1].argmax(-1))  # greedy tokens


@pytest.mark.parametrize("family", list(FAMILIES))
def test_export_loads_in_transformers(folders, family, tmp_path):
    assert _convert(folders[family][0], tmp_path / "ours", "--target-tensor-parallel-size", "2") == 0
    assert _convert(tmp_path / "ours", tmp_path / "hf", loader="mcore", saver="hf") == 0
    logits, info = _hf_logits(tmp_path / "hf")
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    torch.testing.assert_close(logits, folders[family][1], rtol=0, atol=1e-5)
    exported = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert exported["model_type"] == family.removesuffix("_no_q_lora").removesuffix("_window")


def test_mtp_layer_of_a_hub_folder_is_imported_and_written_back(folders, tmp_path):
    """A hub DeepSeek-V3 folder holds its MTP module as layer num_hidden_layers (transformers ignores it)."""
    from safetensors.torch import load_file, save_file

    from megatron_core.models.hf.io import open_hf_weights
    source, reference = folders["deepseek_v3"]
    hub = tmp_path / "hub"
    hub.mkdir()
    for name in ("config.json",):
        (hub / name).write_text((source / name).read_text())
    tensors = load_file(source / "model.safetensors")
    torch.manual_seed(0)
    for name, tensor in list(tensors.items()):  # layer 1 (an MoE layer) copied as the MTP layer 2, perturbed
        if name.startswith("model.layers.1."):
            tensors[name.replace("layers.1.", "layers.2.")] = tensor + 0.01 * torch.randn_like(tensor)
    h = DEEPSEEK["hidden_size"]
    tensors.update({"model.layers.2.enorm.weight": torch.rand(h) + 0.5, "model.layers.2.hnorm.weight": torch.rand(h),
                    "model.layers.2.eh_proj.weight": torch.randn(h, 2 * h) * 0.1,
                    "model.layers.2.shared_head.norm.weight": torch.rand(h) + 0.5,
                    "model.layers.2.embed_tokens.weight": tensors["model.embed_tokens.weight"].clone(),
                    "model.layers.2.shared_head.head.weight": tensors["lm_head.weight"].clone()})
    save_file(tensors, hub / "model.safetensors", metadata={"format": "pt"})
    assert _convert(hub, tmp_path / "ours", "--target-tensor-parallel-size", "2", "--check") == 0
    metadata = json.loads(next((tmp_path / "ours").glob("iter_*/metadata.json")).read_text())
    assert metadata["config"]["mtp_num_layers"] == 1
    assert "mtp.layers.0.eh_proj.weight" in metadata["tensors"]
    assert "mtp.layers.0.transformer_layer.mlp.router.expert_bias" in metadata["tensors"]
    assert _convert(tmp_path / "ours", tmp_path / "hf", loader="mcore", saver="hf") == 0
    assert set(open_hf_weights(str(tmp_path / "hf"))[0]) == set(tensors)
    written = load_file(tmp_path / "hf" / "model.safetensors")
    for name in ("model.layers.2.eh_proj.weight", "model.layers.2.mlp.experts.3.down_proj.weight"):
        torch.testing.assert_close(written[name], tensors[name], rtol=0, atol=0)
    logits, _ = _hf_logits(tmp_path / "hf")  # transformers ignores the MTP layer: the same logits
    torch.testing.assert_close(logits, reference, rtol=0, atol=1e-5)


def _greedy(directory, prompt, new):
    from megatron_core import initialize_model_parallel
    from megatron_core.inference import load_gpt_from_checkpoint
    from megatron_core.inference.generation import generate
    state = initialize_model_parallel()
    model, _ = load_gpt_from_checkpoint(directory, state)
    with torch.no_grad():
        return generate(model.eval(), state, prompt, max_new_tokens=new, greedy=True)["tokens"]


@pytest.mark.parametrize("family", ["deepseek_v3", "gpt_oss"])
def test_greedy_generation_with_the_cache_matches_transformers(folders, family, tmp_path):
    """Incremental decoding: DeepSeek-V3 with the latent cache, gpt-oss past its 4-token window."""
    prompt, new = [5, 17, 3, 42, 8, 11, 64], 8
    model = transformers.AutoModelForCausalLM.from_pretrained(folders[family][0], dtype=torch.float32).eval()
    with torch.no_grad():
        expected = model.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False, min_new_tokens=new,
                                  pad_token_id=0)[0, len(prompt):].tolist()
    assert _convert(folders[family][0], tmp_path / "ours") == 0
    assert _greedy(str(tmp_path / "ours"), prompt, new) == expected
