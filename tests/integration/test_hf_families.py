"""Hugging Face dense families through tools/checkpoint_convert.py, against transformers itself: llama (GQA,
untied, llama3 rope scaling; saved sharded with an index), llama tied (linear rope scaling), mistral, qwen2
(qkv bias), qwen3 (qk-norm, head_dim != hidden/heads) import at tp 1 and at tp 2 x pp 2 with transformers'
fp32 logits, export back (sharded too) to a folder transformers loads with no missing or unexpected keys and
the same logits; bad folders exit 2 naming the problem, with nothing written."""
import json
import shutil

import pytest
import torch

from tests.data.conftest import load_tool

transformers = pytest.importorskip("transformers")

TOKENS = torch.tensor([[5, 17, 3, 99, 42, 8, 0, 64, 23, 11, 7, 2], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]])
SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=100, max_position_embeddings=64, initializer_range=0.2)
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8, "rope_theta": 10000.0}
FAMILIES = {
    "llama": (transformers.LlamaConfig, dict(rope_parameters=LLAMA3, tie_word_embeddings=False)),
    "llama_tied": (transformers.LlamaConfig, dict(rope_parameters={"rope_type": "linear", "factor": 2.0,
                                                                   "rope_theta": 500000.0}, tie_word_embeddings=True)),
    "mistral": (transformers.MistralConfig, dict(sliding_window=None)),
    "qwen2": (transformers.Qwen2Config, dict(tie_word_embeddings=False)),
    "qwen3": (transformers.Qwen3Config, dict(head_dim=16, tie_word_embeddings=False)),
}
TOOL = load_tool("checkpoint_convert")


def _convert(load, save, *extra, loader="hf", saver="mcore"):
    return TOOL.main(["--model-type", "GPT", "--loader", loader, "--saver", saver, "--load-dir", str(load),
                      "--save-dir", str(save), "--no-progress", *extra])


def _hf_logits(directory):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32,
                                                                     output_loading_info=True)
    with torch.no_grad():
        return model.eval()(TOKENS).logits, info


def _logits_of_each(directories, tokens):
    """On 4 ranks (tp 2 x pp 2): the last stage's logits of each imported checkpoint, None elsewhere."""
    from megatron_core import initialize_model_parallel
    from megatron_core.inference import load_gpt_from_checkpoint, pipeline_forward
    state = initialize_model_parallel(2, 2)
    out = []
    with torch.no_grad():
        for directory in directories:
            model, _ = load_gpt_from_checkpoint(directory, state)
            out.append(pipeline_forward(model, state, tokens))
    return out


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """{family: (HF folder, transformers' logits)}; the llama folder is sharded with an index."""
    base = tmp_path_factory.mktemp("hf_families")
    out = {}
    for i, (family, (config_class, extra)) in enumerate(FAMILIES.items()):
        torch.manual_seed(10 + i)
        model = transformers.AutoModelForCausalLM.from_config(config_class(**SMALL, **extra)).eval()
        directory = base / family
        model.save_pretrained(directory, **({"max_shard_size": "40KB"} if family == "llama" else {}))
        with torch.no_grad():
            out[family] = (directory, model(TOKENS).logits)
    assert (base / "llama" / "model.safetensors.index.json").exists()
    return out


@pytest.fixture(scope="module")
def imported(folders, tmp_path_factory):
    """{family: tp 2 x pp 2 checkpoint folder}."""
    base = tmp_path_factory.mktemp("imported")
    for family, (directory, _) in folders.items():
        assert _convert(directory, base / family, "--target-tensor-parallel-size", "2",
                        "--target-pipeline-parallel-size", "2") == 0
    return {family: base / family for family in folders}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_import_at_tp1_matches_transformers(folders, family, tmp_path, capsys):
    directory, _ = folders[family]
    assert _convert(directory, tmp_path / "tp1", "--target-tensor-parallel-size", "1",
                    "--target-pipeline-parallel-size", "1", "--check") == 0
    difference = float(capsys.readouterr().out.split("= ")[-1])
    assert difference <= 1e-5, (family, difference)
    metadata = json.loads(next((tmp_path / "tp1").glob("iter_*/metadata.json")).read_text())
    assert metadata["config"]["hf_model_type"] == family.split("_")[0]


def test_import_at_tp2_pp2_matches_transformers(distributed, folders, imported):
    results = distributed(4, _logits_of_each, [str(imported[f]) for f in FAMILIES], TOKENS)
    for family, logits in zip(FAMILIES, results[-1]):
        torch.testing.assert_close(logits, folders[family][1], rtol=0, atol=1e-5, msg=family)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_export_from_tp2_pp2_loads_in_transformers(folders, imported, family, tmp_path):
    sharded = family == "qwen3"
    extra = ["--max-shard-size", "30KB"] if sharded else []
    assert _convert(imported[family], tmp_path / "hf", *extra, loader="mcore", saver="hf") == 0
    assert (tmp_path / "hf" / "model.safetensors.index.json").exists() == sharded
    logits, info = _hf_logits(tmp_path / "hf")
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["model_type"] == family.split("_")[0]
    torch.testing.assert_close(logits, folders[family][1], rtol=0, atol=1e-5)


def _refused(capsys, load, save, *extra):
    assert _convert(load, save, *extra) == 2
    assert not save.exists()
    return capsys.readouterr().err


def _edit_config(folder, **changes):
    path = folder / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def test_bad_folders_exit_2_naming_the_problem(folders, tmp_path, capsys):
    def copy(family):
        target = tmp_path / f"{family}_{len(list(tmp_path.iterdir()))}"
        shutil.copytree(folders[family][0], target)
        return target
    out = tmp_path / "out"
    folder = copy("mistral")
    _edit_config(folder, model_type="qwen2_moe")
    err = _refused(capsys, folder, out)
    assert "model_type 'qwen2_moe' is not supported yet (gated shared experts)" in err
    assert "supported: gpt2, llama, mistral, qwen2, qwen3, mixtral, qwen3_moe, deepseek_v3, gpt_oss" in err
    folder = copy("mistral")
    _edit_config(folder, sliding_window=0)
    assert "sliding_window=0" in _refused(capsys, folder, out)
    folder = copy("llama")
    _edit_config(folder, rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0})
    assert "rope_parameters.rope_type='yarn'" in _refused(capsys, folder, out)
    folder = copy("llama")
    shard = sorted(folder.glob("model-*.safetensors"))[1]
    shard.unlink()
    err = _refused(capsys, folder, out)
    assert shard.name in err and "missing" in err
    folder = copy("qwen2")
    _edit_config(folder, intermediate_size=48)
    err = _refused(capsys, folder, out)
    assert "model.layers.0.mlp.gate_proj.weight" in err and "[64, 32]" in err and "[48, 32]" in err
    err = _refused(capsys, folders["qwen3"][0], out, "--target-tensor-parallel-size", "3")
    assert "num_attention_heads 4 is not divisible by tensor_model_parallel_size 3" in err


LLAMA_RUN = ["--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope", "--disable-bias-linear",
             "--group-query-attention", "--num-query-groups", "2", "--untie-embeddings-and-output-weights",
             "--use-rope-scaling", "--rope-scaling-factor", "4", "--rope-scaling-original-max-position-embeddings", "8"]


@pytest.mark.parametrize("family,flags", [("llama", []), ("qwen2", ["--add-qkv-bias"]), ("qwen3", ["--qk-layernorm"])])
def test_export_of_a_run_trained_here_picks_the_family(distributed, family, flags, tmp_path, capsys):
    """A checkpoint of pretrain_gpt.py (no recorded hf_model_type) exports as the family its architecture is,
    Llama-3 rope scaling included, with transformers' logits equal to ours (--check)."""
    from tests.integration.test_checkpoint_tools import _train
    distributed(1, _train, [*LLAMA_RUN, *flags, "--train-iters", "2", "--save", str(tmp_path / "run")])
    assert _convert(tmp_path / "run", tmp_path / "hf", "--check", loader="mcore", saver="hf") == 0
    assert float(capsys.readouterr().out.split("= ")[-1]) <= 1e-5
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["model_type"] == family and config["rope_parameters"]["rope_type"] == "llama3"
    _, info = _hf_logits(tmp_path / "hf")
    assert not info["missing_keys"] and not info["unexpected_keys"], info


def test_llama3_rope_frequencies_are_transformers_and_bad_values_are_refused():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from megatron_core.config import TransformerConfig
    from megatron_core.transformer.rope import Llama3RopeScaling, RotaryEmbedding
    config = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, rope_parameters={**LLAMA3, "factor": 4.0})
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    ours = RotaryEmbedding(16, rope_scaling=Llama3RopeScaling(4.0, 1.0, 4.0, 8)).inv_freq
    assert torch.equal(ours, expected)
    common = dict(num_layers=1, hidden_size=32, num_attention_heads=4, rope_scaling=True)
    with pytest.raises(ValueError, match="rope_scaling=True needs position_embedding_type='rope'"):
        TransformerConfig(**common, max_position_embeddings=8)
    with pytest.raises(ValueError, match="low_freq_factor < high_freq_factor"):
        TransformerConfig(**common, position_embedding_type="rope", rope_scaling_low_freq_factor=4.0)
    with pytest.raises(ValueError, match="disagree"):
        TransformerConfig(**common, position_embedding_type="rope", rotary_seq_len_interpolation_factor=2.0)
