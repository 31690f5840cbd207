"""Quantized Hugging Face hub folders (DeepSeek-V3's block-wise fp8, gpt-oss's mxfp4 experts) through
tools/checkpoint_convert.py --loader hf, against transformers' own dequantization.

The folders are made as the hub holds them: a tiny transformers model is saved, then its safetensors are
rewritten quantized here (fp8 e4m3 in 128 x 128 blocks with ``weight_scale_inv``; mxfp4 ``*_blocks`` /
``*_scales``) and config.json gets the hub's ``quantization_config``. Imports in fp32 give the logits of
transformers' ``from_pretrained(..., quantization_config=FineGrainedFP8Config / Mxfp4Config(dequantize=True))``.

transformers 5.24's fp8 dequantizing loader derives the block from the scale grid (``rows / scale_rows``),
which is not 128 when a dimension over 128 is not a multiple of it (160 rows: blocks of 80; DeepSeek-V3's
576-row ``kv_a_proj_with_mqa`` it refuses). So the folder with partial edge blocks (160 x 96 weights) is
checked against a transformers model holding transformers' ``_dequantize_fp8_weight`` of each weight (fixed
128 x 128 blocks, edges partial: DeepSeek's ``weight_dequant``), and the loader comparison uses a folder whose
dimensions are at most 128 or multiples of it, where both agree."""
import json
import math
import shutil

import pytest
import torch

from tests.integration.test_hf_families import TOKENS, _convert, _hf_logits

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers.integrations.finegrained_fp8 import Fp8Dequantize, _dequantize_fp8_weight  # noqa: E402
from transformers.integrations.mxfp4 import FP4_VALUES, convert_moe_packed_tensors  # noqa: E402

FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
MXFP4_CONFIG = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn",
                                                                    "model.layers.*.mlp.router", "model.embed_tokens",
                                                                    "lm_head"]}
DEEPSEEK = dict(hidden_size=96, moe_intermediate_size=32, num_attention_heads=4, num_key_value_heads=4,
                num_hidden_layers=2, n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1,
                first_k_dense_replace=1, n_shared_experts=1, routed_scaling_factor=2.5, vocab_size=100,
                kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, q_lora_rank=32,
                max_position_embeddings=64, initializer_range=0.2, tie_word_embeddings=False)
GPT_OSS = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
               num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2, vocab_size=100, sliding_window=4,
               layer_types=["sliding_attention", "full_attention"], max_position_embeddings=64, initializer_range=0.2)
NOT_FP8 = ("layernorm.weight", "embed_tokens.weight", "lm_head.weight", "mlp.gate.weight")


def fp8_quantize(weight: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's storage: float8_e4m3fn values and fp32 ``scale_inv`` (amax / 448) per block, edges partial."""
    rows, cols = weight.shape
    grid = (math.ceil(rows / block), math.ceil(cols / block))
    padded = torch.zeros(grid[0] * block, grid[1] * block)
    padded[:rows, :cols] = weight.float()
    tiles = padded.reshape(grid[0], block, grid[1], block)
    scale_inv = tiles.abs().amax(dim=(1, 3)).clamp(min=1e-12) / torch.finfo(torch.float8_e4m3fn).max
    values = (tiles / scale_inv[:, None, :, None]).reshape(padded.shape)[:rows, :cols]
    return values.to(torch.float8_e4m3fn).contiguous(), scale_inv.float()


def mxfp4_quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """gpt-oss's storage of ``[E, a, b]`` (transformers' layout): blocks ``[E, b, a / 32, 16]`` of FP4 codes (low
    nibble first) and uint8 exponents ``[E, b, a / 32]`` (127 + e, e the least with amax / 2**e <= 6)."""
    rows = weight.transpose(1, 2).float()  # [E, b, a]
    groups = rows.reshape(*rows.shape[:-1], -1, 32)
    exponent = torch.ceil(torch.log2(groups.abs().amax(-1).clamp(min=1e-30) / 6.0)).clamp(-127, 127)
    scaled = groups / torch.exp2(exponent)[..., None]
    magnitudes = torch.tensor(FP4_VALUES[:8])
    codes = (scaled.abs()[..., None] - magnitudes).abs().argmin(-1) + 8 * (scaled < 0)
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    return packed.contiguous(), (exponent + 127).to(torch.uint8).contiguous()


def _seeded_model(config, seed):
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # routers and sinks drawn wide so that no two experts tie
        for name, param in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith(("gate.weight", "router.weight", "sinks")):
                param.normal_(0.0, 1.0)
            if name.endswith("e_score_correction_bias"):
                param.normal_(0.0, 0.1)
    return model


def _fp8_folder(directory, intermediate, seed):
    """A hub-like fp8 DeepSeek-V3 folder; returns the logits of transformers' model loaded from an unquantized
    folder of the weights dequantized by transformers' ``_dequantize_fp8_weight``."""
    model = _seeded_model(transformers.DeepseekV3Config(**DEEPSEEK, intermediate_size=intermediate), seed)
    model.save_pretrained(directory)
    plain = directory.parent / f"{directory.name}_dequantized"
    plain.mkdir()
    shutil.copy(directory / "config.json", plain / "config.json")
    stored, dequantized = {}, {}
    for name, tensor in load_file(directory / "model.safetensors").items():
        if tensor.dim() == 2 and not name.endswith(NOT_FP8):
            values, scale_inv = fp8_quantize(tensor)
            stored.update({name: values, name + "_scale_inv": scale_inv})
            tensor = _dequantize_fp8_weight(values, scale_inv, [128, 128], torch.float32)
        else:
            stored[name] = tensor
        dequantized[name] = tensor
    _rewrite(directory, stored, FP8_CONFIG)
    save_file(dequantized, plain / "model.safetensors", metadata={"format": "pt"})
    logits, info = _hf_logits(plain)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    return logits


def _mxfp4_folder(directory, seed):
    model = _seeded_model(transformers.GptOssConfig(**GPT_OSS, rope_parameters={"rope_type": "default",
                                                                                "rope_theta": 10000.0}), seed)
    model.save_pretrained(directory)
    stored = {}
    for name, tensor in load_file(directory / "model.safetensors").items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            stored[name + "_blocks"], stored[name + "_scales"] = mxfp4_quantize(tensor)
        else:
            stored[name] = tensor
    _rewrite(directory, stored, MXFP4_CONFIG)


def _rewrite(directory, tensors, quantization_config):
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "quantization_config": quantization_config}))


def _logits(model):
    with torch.no_grad():
        return model(TOKENS).logits


@pytest.fixture
def dequantizing(monkeypatch):
    """transformers' ``from_pretrained`` of a quantized folder dequantizes on this CPU (what ``--check`` runs):
    its fp8 and mxfp4 quantizers ask for accelerate, which dequantizing does not use, and mxfp4 dequantizes
    when the ``kernels`` package is absent."""
    import transformers.quantizers.quantizer_finegrained_fp8 as fp8_quantizer
    import transformers.quantizers.quantizer_mxfp4 as mxfp4_quantizer
    monkeypatch.setattr(fp8_quantizer, "is_accelerate_available", lambda: True)
    monkeypatch.setattr(mxfp4_quantizer, "is_accelerate_available", lambda: True)
    monkeypatch.setattr(mxfp4_quantizer, "is_kernels_available", lambda: False)


def _transformers_dequantized(directory, quantization_config):
    """transformers' own loader, dequantizing (fp32)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32,
                                                              quantization_config=quantization_config)
    return _logits(model.eval())


def _ours(directory):
    from megatron_core import initialize_model_parallel
    from megatron_core.inference import load_gpt_from_checkpoint, pipeline_forward
    state = initialize_model_parallel()
    with torch.no_grad():
        return pipeline_forward(load_gpt_from_checkpoint(str(directory), state)[0], state, TOKENS)


def _import(capsys, folder, save, *extra, check=True):
    """Our fp32 logits of ``folder`` imported; ``check``: ``--check`` (against transformers' dequantizing
    loader, random tokens) within 1e-5."""
    assert _convert(folder, save, "--params-dtype", "fp32", *(["--check"] if check else []), *extra) == 0
    if check:
        assert float(capsys.readouterr().out.split("= ")[-1]) <= 1e-5
    return _ours(save)


@pytest.fixture(scope="module")
def fp8_edge(tmp_path_factory):
    """(folder with partial edge blocks (160 x 96, 96 x 160 dense MLP), transformers' logits of its weights)."""
    directory = tmp_path_factory.mktemp("fp8_edge") / "hf"
    return directory, _fp8_folder(directory, 160, seed=1)


@pytest.fixture(scope="module")
def mxfp4(tmp_path_factory):
    directory = tmp_path_factory.mktemp("mxfp4") / "hf"
    _mxfp4_folder(directory, seed=5)
    return directory


def test_dequantization_is_transformers_own():
    from megatron_core.models.hf.dequantize import dequantize_fp8, dequantize_mxfp4
    torch.manual_seed(0)
    for shape in ((160, 96), (96, 160), (300, 257), (24, 96)):
        values, scale_inv = fp8_quantize(torch.randn(shape))
        expected = _dequantize_fp8_weight(values, scale_inv, [128, 128], torch.float32)
        assert torch.equal(dequantize_fp8(values, scale_inv, (128, 128), torch.float32), expected), shape
        assert dequantize_fp8(values, scale_inv, (128, 128), torch.bfloat16).dtype == torch.bfloat16
    values, scale_inv = fp8_quantize(torch.randn(160, 96))  # by hand: rows 128.. take the second scale row
    assert torch.equal(dequantize_fp8(values, scale_inv, (128, 128), torch.float32)[130],
                       values[130].float() * scale_inv[1, 0])
    assert torch.equal(dequantize_fp8(values, torch.tensor(0.5), None, torch.float32), values.float() * 0.5)
    values, exponents = fp8_quantize(torch.randn(256, 128))[0], torch.tensor([[120], [130]], dtype=torch.uint8)
    expected = Fp8Dequantize(None)._dequantize_one(values, exponents, torch.float32)  # UE8M0 bytes: 2 ** (s - 127)
    assert torch.equal(dequantize_fp8(values, exponents, (128, 128), torch.float32), expected)
    blocks, scales = mxfp4_quantize(torch.randn(3, 64, 96))
    for dtype in (torch.float32, torch.bfloat16):
        expected = convert_moe_packed_tensors(blocks, scales, dtype=dtype)
        assert torch.equal(dequantize_mxfp4(blocks, scales, dtype), expected)
        assert torch.equal(dequantize_mxfp4(blocks[1], scales[1], dtype), expected[1])  # one expert alone


def test_fp8_deepseek_import_matches_transformers_dequantizing_loader(tmp_path, capsys, dequantizing):
    directory = tmp_path / "hf"
    reference = _fp8_folder(directory, 256, seed=3)  # every dimension <= 128 or a multiple of 128
    loaded = _transformers_dequantized(directory, transformers.FineGrainedFP8Config(dequantize=True))
    torch.testing.assert_close(loaded, reference, rtol=0, atol=1e-5)
    # ours vs transformers' forward: YaRN's mscale folded into cos/sin once per layer (not per forward) rounds
    # differently in fp32; 1.3e-5 is the largest difference seen on these logits
    torch.testing.assert_close(_import(capsys, directory, tmp_path / "ours"), loaded, rtol=0, atol=3e-5)


def test_fp8_partial_edge_blocks_import_and_export_unquantized(fp8_edge, tmp_path, capsys):
    directory, reference = fp8_edge
    assert load_file(directory / "model.safetensors")["model.layers.0.mlp.gate_proj.weight_scale_inv"].shape == (2, 1)
    # no --check: transformers' loader dequantizes these 160-row weights in blocks of 80 (module docstring)
    ours = _import(capsys, directory, tmp_path / "ours", "--target-tensor-parallel-size", "2", check=False)
    torch.testing.assert_close(ours, reference, rtol=0, atol=1e-5)
    assert _convert(tmp_path / "ours", tmp_path / "back", loader="mcore", saver="hf") == 0
    written = load_file(tmp_path / "back" / "model.safetensors")
    assert not [n for n in written if "scale" in n] and {t.dtype for t in written.values()} == {torch.float32}
    assert "quantization_config" not in json.loads((tmp_path / "back" / "config.json").read_text())
    logits, info = _hf_logits(tmp_path / "back")
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    torch.testing.assert_close(logits, reference, rtol=0, atol=1e-5)


def test_dequantized_tensors_default_to_bf16_and_are_lazy(fp8_edge, mxfp4, monkeypatch):
    from megatron_core.inference.checkpoint_model import run_flags
    from megatron_core.models.hf import dequantize
    from megatron_core.models.hf.io import read_hf
    calls = []
    monkeypatch.setattr(dequantize, "dequantize_fp8", lambda *a, f=dequantize.dequantize_fp8: calls.append(1) or f(*a))
    stored = load_file(fp8_edge[0] / "model.safetensors")
    tensors = {t.name: t for t in read_hf(str(fp8_edge[0]), vars(run_flags({}))).tensors}
    down = tensors["decoder.layers.0.mlp.linear_fc2.weight"]
    assert down.dtype == torch.bfloat16 and tensors["embedding.word_embeddings.weight"].dtype == torch.float32
    name = "model.layers.0.mlp.down_proj.weight"
    expected = _dequantize_fp8_weight(stored[name], stored[name + "_scale_inv"], [128, 128], torch.float32)
    assert not calls  # nothing dequantized until the converter reads it, then that tensor alone
    assert torch.equal(down.load(), expected.to(torch.bfloat16)) and len(calls) == 1
    stored = load_file(mxfp4 / "model.safetensors")
    tensors = {t.name: t for t in read_hf(str(mxfp4), vars(run_flags({}))).tensors}
    fc2 = tensors["decoder.layers.1.mlp.experts.local_experts.2.linear_fc2.weight"]
    name = "model.layers.1.mlp.experts.down_proj"
    expected = convert_moe_packed_tensors(stored[name + "_blocks"], stored[name + "_scales"], dtype=torch.bfloat16)
    assert fc2.dtype == torch.bfloat16 and torch.equal(fc2.load(), expected[2].t())


def test_mxfp4_gpt_oss_import_matches_transformers_dequantizing_loader(mxfp4, tmp_path, capsys, dequantizing):
    loaded = _transformers_dequantized(mxfp4, transformers.Mxfp4Config(dequantize=True))
    ours = _import(capsys, mxfp4, tmp_path / "ours", "--target-expert-parallel-size", "2")
    torch.testing.assert_close(ours, loaded, rtol=0, atol=1e-5)
    assert torch.equal(ours.argmax(-1), loaded.argmax(-1))
    assert _convert(tmp_path / "ours", tmp_path / "back", loader="mcore", saver="hf") == 0
    assert not [n for n in load_file(tmp_path / "back" / "model.safetensors") if n.endswith(("_blocks", "_scales"))]
    logits, info = _hf_logits(tmp_path / "back")
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    torch.testing.assert_close(logits, loaded, rtol=0, atol=1e-5)


def _broken(source, target, *, drop=(), replace=None, quantization=None):
    shutil.copytree(source, target)
    tensors = {k: v for k, v in load_file(source / "model.safetensors").items() if k not in drop}
    save_file({**tensors, **(replace or {})}, target / "model.safetensors", metadata={"format": "pt"})
    if quantization is not None:
        config = json.loads((target / "config.json").read_text())
        if quantization == "none":
            config.pop("quantization_config")
        else:
            config["quantization_config"].update(quantization)
        (target / "config.json").write_text(json.dumps(config))
    return target


def _refused(capsys, folder, tmp_path):
    assert _convert(folder, tmp_path / "out") == 2 and not (tmp_path / "out").exists()
    return capsys.readouterr().err


def test_bad_quantized_folders_exit_2_naming_the_tensor(fp8_edge, mxfp4, tmp_path, capsys):
    fp8, gate = fp8_edge[0], "model.layers.0.mlp.gate_proj.weight"
    err = _refused(capsys, _broken(fp8, tmp_path / "a", drop=[gate + "_scale_inv"]), tmp_path)
    assert repr(gate) in err and "'model.layers.0.mlp.gate_proj.weight_scale_inv'" in err
    err = _refused(capsys, _broken(fp8, tmp_path / "b", replace={gate + "_scale_inv": torch.ones(1, 1)}), tmp_path)
    assert "weight_scale_inv'" in err and "[1, 1]" in err and "[2, 1]" in err
    err = _refused(capsys, _broken(fp8, tmp_path / "c", quantization={"quant_method": "awq"}), tmp_path)
    assert "quant_method='awq'" in err
    err = _refused(capsys, _broken(fp8, tmp_path / "d", quantization={"fmt": "e5m2"}), tmp_path)
    assert "fmt='e5m2'" in err
    err = _refused(capsys, _broken(fp8, tmp_path / "e", quantization="none"), tmp_path)
    assert "_scale_inv'" in err and "no quantization_config" in err
    blocks = "model.layers.1.mlp.experts.down_proj_blocks"
    err = _refused(capsys, _broken(mxfp4, tmp_path / "f", drop=[blocks.replace("_blocks", "_scales")]), tmp_path)
    assert repr(blocks) in err and "down_proj_scales" in err
    err = _refused(capsys, _broken(mxfp4, tmp_path / "g", replace={
        blocks.replace("_blocks", "_scales"): torch.zeros(4, 32, 1, dtype=torch.uint8)}), tmp_path)
    assert "down_proj_scales'" in err and "[4, 32, 1]" in err and "[4, 32, 2]" in err
