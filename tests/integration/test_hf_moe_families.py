"""Hugging Face mixture-of-experts families through tools/checkpoint_convert.py, against transformers itself:
mixtral (softmax, top-2, renormalized) and qwen3_moe (qk-norm, head_dim != hidden/heads, a dense layer from
``mlp_only_layers`` before the MoE one; ``norm_topk_prob`` false and true), 4 experts each, import at tp 1 x
ep 1, at pp 2 x ep 2, at ep 4 and at tp 2 x ep 2 (sequence parallel) with transformers' fp32 logits, the
fused layout of transformers 5 too; export back from pp 2 x ep 2 to the per-expert names ``save_pretrained``
writes (no missing or unexpected keys, the same logits and routing config); bad folders and layouts exit 2
naming the key, with nothing written."""
import json
import shutil

import pytest
import torch

from tests.data.conftest import load_tool
from tests.integration.test_hf_families import TOKENS, _convert, _edit_config, _hf_logits, _refused

transformers = pytest.importorskip("transformers")

SMALL = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=100, max_position_embeddings=64, initializer_range=0.2, num_experts_per_tok=2,
             tie_word_embeddings=False)
QWEN3_MOE = dict(num_experts=4, moe_intermediate_size=16, head_dim=16, mlp_only_layers=[0],
                 router_aux_loss_coef=0.01)
FAMILIES = {
    "mixtral": (transformers.MixtralConfig, dict(num_local_experts=4, sliding_window=None)),
    "qwen3_moe": (transformers.Qwen3MoeConfig, dict(QWEN3_MOE, norm_topk_prob=False)),
    "qwen3_moe_norm": (transformers.Qwen3MoeConfig, dict(QWEN3_MOE, norm_topk_prob=True)),
}
ROUTING_KEYS = ("num_experts_per_tok", "norm_topk_prob", "mlp_only_layers",
                "moe_intermediate_size", "intermediate_size", "router_aux_loss_coef")
TOOL = load_tool("checkpoint_convert")


def _model_type(family):
    return family.removesuffix("_norm")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """{family: (HF folder, transformers' logits)}; routers drawn wide so that no two experts nearly tie."""
    base = tmp_path_factory.mktemp("hf_moe_families")
    out = {}
    for i, (family, (config_class, extra)) in enumerate(FAMILIES.items()):
        torch.manual_seed(20 + i)
        model = transformers.AutoModelForCausalLM.from_config(config_class(**{**SMALL, **extra})).eval()
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("gate.weight"):
                    param.normal_(0.0, 1.0)
        directory = base / family
        model.save_pretrained(directory)
        model.save_pretrained(base / f"{family}_fused", save_original_format=False)  # transformers 5's layout
        with torch.no_grad():
            out[family] = (directory, model(TOKENS).logits)
    return out


@pytest.fixture(scope="module")
def imported(folders, tmp_path_factory):
    """{family: pp 2 x ep 2 checkpoint folder}."""
    base = tmp_path_factory.mktemp("moe_imported")
    for family, (directory, _) in folders.items():
        assert _convert(directory, base / family, "--target-pipeline-parallel-size", "2",
                        "--target-expert-parallel-size", "2") == 0
    return {family: base / family for family in folders}


def test_save_pretrained_writes_per_expert_names(folders):
    from megatron_core.models.hf.io import open_hf_weights
    names = set(open_hf_weights(str(folders["mixtral"][0]))[0])
    assert {"model.layers.0.block_sparse_moe.gate.weight", "model.layers.1.block_sparse_moe.experts.3.w3.weight"} \
        <= names
    names = set(open_hf_weights(str(folders["qwen3_moe"][0]))[0])
    assert "model.layers.1.mlp.experts.0.gate_proj.weight" in names and "model.layers.0.mlp.gate_proj.weight" in names


@pytest.mark.parametrize("family", list(FAMILIES))
def test_import_at_tp1_ep1_matches_transformers(folders, family, tmp_path, capsys):
    directory, _ = folders[family]
    assert _convert(directory, tmp_path / "ep1", "--target-tensor-parallel-size", "1",
                    "--target-pipeline-parallel-size", "1", "--check") == 0
    difference = float(capsys.readouterr().out.split("= ")[-1])
    assert difference <= 1e-5, (family, difference)
    config = json.loads(next((tmp_path / "ep1").glob("iter_*/metadata.json")).read_text())["config"]
    assert config["hf_model_type"] == _model_type(family) and config["num_experts"] == 4
    assert config["moe_router_topk"] == 2 and config["moe_expert_capacity_factor"] is None
    if family.startswith("qwen3_moe"):
        assert config["moe_layer_freq"] == [0, 1] and config["moe_ffn_hidden_size"] == 16
        assert config["moe_router_pre_softmax"] == (family == "qwen3_moe") and config["moe_aux_loss_coeff"] == 0.01
    else:
        assert config["moe_layer_freq"] == 1 and not config["moe_router_pre_softmax"]


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_import_of_the_fused_expert_layout_matches_transformers(folders, family, tmp_path, capsys):
    """``save_pretrained(save_original_format=False)`` keeps experts stacked (``mlp.experts.gate_up_proj``
    ``[E, 2f, h]``, ``down_proj`` ``[E, h, f]``): each expert reads its slice."""
    from megatron_core.models.hf.io import open_hf_weights
    fused = folders[family][0].parent / f"{family}_fused"
    names = set(open_hf_weights(str(fused))[0])
    assert "model.layers.1.mlp.experts.gate_up_proj" in names and "model.layers.1.mlp.gate.weight" in names
    assert _convert(fused, tmp_path / "ep1", "--target-expert-parallel-size", "2", "--check") == 0
    assert float(capsys.readouterr().out.split("= ")[-1]) <= 1e-5
    assert _convert(tmp_path / "ep1", tmp_path / "hf", loader="mcore", saver="hf") == 0
    assert set(open_hf_weights(str(tmp_path / "hf"))[0]) == set(open_hf_weights(str(folders[family][0]))[0])


def _logits_at_expert_layouts(directories, tokens):
    """On 4 ranks: each checkpoint's logits at pp 2 x ep 2 (last stage, else None) and at ep 4."""
    from megatron_core import initialize_model_parallel
    from megatron_core.inference import load_gpt_from_checkpoint, pipeline_forward
    out = []
    with torch.no_grad():
        for state in (initialize_model_parallel(1, 2, expert_model_parallel_size=2),
                      initialize_model_parallel(1, 1, expert_model_parallel_size=4)):
            for directory in directories:
                model, _ = load_gpt_from_checkpoint(directory, state)
                out.append(pipeline_forward(model, state, tokens))
    return out


def test_import_at_pp2_ep2_and_ep4_matches_transformers(distributed, folders, imported):
    metadata = json.loads(next(imported["mixtral"].glob("iter_*/metadata.json")).read_text())
    assert metadata["layout"]["ep"] == 2
    assert metadata["tensors"]["decoder.layers.1.mlp.experts.local_experts.3.linear_fc2.weight"]["shards"]["0"][
        "file"] == "experts_ep001_pp001.safetensors"
    results = distributed(4, _logits_at_expert_layouts, [str(imported[f]) for f in FAMILIES], TOKENS)
    count = len(FAMILIES)
    for family, at_pp2, at_ep4 in zip(FAMILIES, results[-1][:count], results[0][count:]):
        torch.testing.assert_close(at_pp2, folders[family][1], rtol=0, atol=1e-5, msg=f"{family} pp2 x ep2")
        torch.testing.assert_close(at_ep4, folders[family][1], rtol=0, atol=1e-5, msg=f"{family} ep4")


def _logits_at_tp2_ep2(directories, tokens):
    """On 2 ranks: each checkpoint's logits at tp 2 x ep 2 with sequence parallelism (MoE at tp > 1 routes each
    tp rank's chunk of the sequence)."""
    from megatron_core import initialize_model_parallel
    from megatron_core.inference import load_gpt_from_checkpoint, pipeline_forward
    state = initialize_model_parallel(2, 1, expert_model_parallel_size=2)
    with torch.no_grad():
        return [pipeline_forward(load_gpt_from_checkpoint(d, state, sequence_parallel=True)[0], state, tokens)
                for d in directories]


def test_import_at_tp2_ep2_matches_transformers(distributed, folders, tmp_path):
    for family, (directory, _) in folders.items():
        assert _convert(directory, tmp_path / family, "--target-tensor-parallel-size", "2",
                        "--target-expert-parallel-size", "2") == 0
    results = distributed(2, _logits_at_tp2_ep2, [str(tmp_path / f) for f in FAMILIES], TOKENS)
    for family, logits in zip(FAMILIES, results[0]):
        torch.testing.assert_close(logits, folders[family][1], rtol=0, atol=1e-5, msg=f"{family} tp2 x ep2")


def _logits_at_tp2_etp2(directory, tokens):
    """On 2 ranks: the logits at tp 2 x etp 2 with sequence parallelism and without it (forward-only: each tp
    rank routes the whole sequence), and the error of a training-mode forward without it."""
    from megatron_core import initialize_model_parallel
    from megatron_core.inference import load_gpt_from_checkpoint, pipeline_forward
    state = initialize_model_parallel(2, 1, expert_tensor_parallel_size=2)
    with torch.no_grad():
        logits = [pipeline_forward(load_gpt_from_checkpoint(directory, state, sequence_parallel=sp)[0], state, tokens)
                  for sp in (True, False)]
    model = load_gpt_from_checkpoint(directory, state)[0].train()
    try:
        pipeline_forward(model, state, tokens)
    except ValueError as error:
        return logits, str(error)
    return logits, None


def test_import_at_tp2_etp2_splits_each_expert_and_exports_back(distributed, folders, tmp_path, capsys):
    """--target-expert-tensor-parallel-size 2: each expert's fc1 rows (gate and up halves) and fc2 columns in
    experts_ep000_tp0{0,1}_pp000; transformers' logits at tp 2 x etp 2; the split checkpoint exports back."""
    directory, reference = folders["qwen3_moe"]
    assert _convert(directory, tmp_path / "etp2", "--target-tensor-parallel-size", "2",
                    "--target-expert-tensor-parallel-size", "2") == 0
    metadata = json.loads(next((tmp_path / "etp2").glob("iter_*/metadata.json")).read_text())
    fc1 = metadata["tensors"]["decoder.layers.1.mlp.experts.local_experts.2.linear_fc1.weight"]
    assert (fc1["partition_dim"], fc1["stride"], fc1["shards"]["1"]["shape"]) == (0, 2, [16, 32])
    assert fc1["shards"]["1"]["file"] == "experts_ep000_tp01_pp000.safetensors"
    assert metadata["config"]["expert_tensor_parallel_size"] == 2
    (with_sp, without_sp), error = distributed(2, _logits_at_tp2_etp2, str(tmp_path / "etp2"), TOKENS)[0]
    torch.testing.assert_close(with_sp, reference, rtol=0, atol=1e-5)
    torch.testing.assert_close(without_sp, reference, rtol=0, atol=1e-5)
    assert error is not None and "need sequence_parallel=True to train" in error, error
    assert _convert(tmp_path / "etp2", tmp_path / "hf", loader="mcore", saver="hf") == 0
    logits, info = _hf_logits(tmp_path / "hf")
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    torch.testing.assert_close(logits, reference, rtol=0, atol=1e-5)
    err = _refused(capsys, directory, tmp_path / "out", "--target-tensor-parallel-size", "2",
                   "--target-expert-tensor-parallel-size", "3")
    assert "expert hidden size 16 cannot be split over expert_tensor_parallel_size 3" in err, err


def _logits_at_tp1_etp2(directory, tokens):
    from megatron_core import initialize_model_parallel
    from megatron_core.inference import load_gpt_from_checkpoint, pipeline_forward
    state = initialize_model_parallel(1, 1, expert_tensor_parallel_size=2)  # the etp group spans the 2 dp ranks
    with torch.no_grad():
        return pipeline_forward(load_gpt_from_checkpoint(directory, state)[0], state, tokens)


def test_import_at_tp1_etp2_splits_experts_over_dp_ranks(distributed, folders, tmp_path):
    """etp need not be 1 or tp: imported at tp 1 with --target-expert-tensor-parallel-size 2, each expert is
    split into experts_ep000_tp0{0,1}_pp000 and the logits on 2 ranks (tp 1 x dp 2, etp 2) are transformers'."""
    directory, reference = folders["qwen3_moe"]
    assert _convert(directory, tmp_path / "etp2", "--target-expert-tensor-parallel-size", "2") == 0
    metadata = json.loads(next((tmp_path / "etp2").glob("iter_*/metadata.json")).read_text())
    assert (metadata["layout"]["tp"], metadata["config"]["expert_tensor_parallel_size"]) == (1, 2)
    fc2 = metadata["tensors"]["decoder.layers.1.mlp.experts.local_experts.2.linear_fc2.weight"]
    assert fc2["partition_dim"] == 1 and fc2["shards"]["1"]["file"] == "experts_ep000_tp01_pp000.safetensors"
    for logits in distributed(2, _logits_at_tp1_etp2, str(tmp_path / "etp2"), TOKENS):
        torch.testing.assert_close(logits, reference, rtol=0, atol=1e-5)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_export_from_pp2_ep2_loads_in_transformers(folders, imported, family, tmp_path):
    assert _convert(imported[family], tmp_path / "hf", loader="mcore", saver="hf") == 0
    logits, info = _hf_logits(tmp_path / "hf")
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    torch.testing.assert_close(logits, folders[family][1], rtol=0, atol=1e-5)
    exported = json.loads((tmp_path / "hf" / "config.json").read_text())
    original = json.loads((folders[family][0] / "config.json").read_text())
    assert exported["model_type"] == original["model_type"] == _model_type(family)
    assert {k: exported.get(k) for k in ROUTING_KEYS} == {k: original.get(k) for k in ROUTING_KEYS}
    experts = [config.get("num_experts", config.get("num_local_experts")) for config in (exported, original)]
    assert experts == [4, 4]  # transformers 5 writes qwen3_moe's num_experts as its alias num_local_experts
    from megatron_core.models.hf.io import open_hf_weights
    assert set(open_hf_weights(str(tmp_path / "hf"))[0]) == set(open_hf_weights(str(folders[family][0]))[0])


def test_bad_moe_folders_and_layouts_exit_2_naming_the_problem(folders, tmp_path, capsys):
    def copy(family):
        target = tmp_path / f"{family}_{len(list(tmp_path.iterdir()))}"
        shutil.copytree(folders[family][0], target)
        return target
    out = tmp_path / "out"
    err = _refused(capsys, folders["mixtral"][0], out, "--target-expert-parallel-size", "3")
    assert "expert_model_parallel_size 3" in err and "4" in err, err
    folder = copy("mixtral")
    _edit_config(folder, sliding_window=-3)
    assert "sliding_window=-3" in _refused(capsys, folder, out)
    folder = copy("mixtral")
    _edit_config(folder, router_jitter_noise=0.1)
    assert "router_jitter_noise=0.1" in _refused(capsys, folder, out)
    folder = copy("qwen3_moe")
    _edit_config(folder, shared_expert_intermediate_size=8)
    assert "shared_expert_intermediate_size=8" in _refused(capsys, folder, out)
    folder = copy("qwen3_moe")
    _edit_config(folder, mlp_only_layers=[0, 1])
    assert "mlp_only_layers=[0, 1]" in _refused(capsys, folder, out)
    folder = copy("qwen3_moe")
    _edit_config(folder, moe_intermediate_size=24)
    err = _refused(capsys, folder, out)
    assert "model.layers.1.mlp.experts.0.gate_proj.weight" in err and "[16, 32]" in err and "[24, 32]" in err
    folder = copy("mixtral")
    from safetensors.torch import load_file, save_file
    weights = load_file(folder / "model.safetensors")
    del weights["model.layers.1.block_sparse_moe.experts.3.w2.weight"]
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    err = _refused(capsys, folder, out)
    assert "no tensor 'model.layers.1.block_sparse_moe.experts.3.w2.weight'" in err, err
    folder = copy("qwen3_moe")
    _edit_config(folder, model_type="qwen2_moe")
    assert "model_type 'qwen2_moe' is not supported yet (gated shared experts)" in _refused(capsys, folder, out)


def test_export_of_an_moe_run_picks_the_family_by_architecture():
    from megatron_core.models.hf import adapter_for_flags
    moe = {"normalization": "RMSNorm", "swiglu": True, "position_embedding_type": "rope", "num_experts": 4}
    assert adapter_for_flags(moe, "run").model_type == "mixtral"
    assert adapter_for_flags({**moe, "qk_layernorm": True}, "run").model_type == "qwen3_moe"
    with pytest.raises(ValueError, match="mixture-of-experts model with normalization='LayerNorm'"):
        adapter_for_flags({"num_experts": 4}, "run")
    mixed = {**moe, "num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "disable_bias_linear": True,
             "moe_layer_freq": [1, 0]}
    with pytest.raises(ValueError, match="moe_layer_freq=\\[1, 0\\] cannot be exported as Hugging Face 'mixtral'"):
        adapter_for_flags(mixed, "run").hf_config_from_flags(mixed, 100)


MOE_RUN = ["--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope", "--disable-bias-linear",
           "--group-query-attention", "--num-query-groups", "2", "--untie-embeddings-and-output-weights",
           "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32", "--moe-aux-loss-coeff",
           "1e-2", "--train-iters", "2"]


@pytest.mark.parametrize("family,flags", [("mixtral", []), ("qwen3_moe", ["--qk-layernorm", "--moe-layer-freq",
                                                                            "[0,1]", "--moe-router-pre-softmax"])])
def test_export_of_an_moe_run_trained_here(distributed, family, flags, tmp_path, capsys):
    """A checkpoint of pretrain_gpt.py with experts (no recorded hf_model_type) exports as mixtral, or as
    qwen3_moe with qk-norm (a dense first layer, unnormalized top-k), with transformers' logits equal to ours."""
    from tests.integration.test_checkpoint_tools import _train
    distributed(1, _train, [*MOE_RUN, *flags, "--save", str(tmp_path / "run")])
    assert _convert(tmp_path / "run", tmp_path / "hf", "--check", loader="mcore", saver="hf") == 0
    assert float(capsys.readouterr().out.split("= ")[-1]) <= 1e-5
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["model_type"] == family and config["num_experts_per_tok"] == 2
    if family == "qwen3_moe":
        assert config["mlp_only_layers"] == [0] and config["norm_topk_prob"] is False
    _, info = _hf_logits(tmp_path / "hf")
    assert not info["missing_keys"] and not info["unexpected_keys"], info
