"""tools/checkpoint_convert.py and tools/generate.py end to end: layout round trips keep every tensor and
logit, Hugging Face GPT-2 import (at tp 2 x pp 2) and export match transformers, generation with the KV
cache matches transformers' greedy generate, and bad checkpoints fail naming the file and tensor."""
import json
import os

import pytest
import torch

from tests.data.conftest import load_tool
from tests.recipe import RECIPE

BASE = [*RECIPE, "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
        "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "1e-3", "--min-lr", "1e-4",
        "--lr-warmup-iters", "1", "--eval-interval", "1000", "--log-interval", "1000", "--seed", "7"]
TOKENS = torch.tensor([[5, 17, 3, 99, 42, 8, 0, 64, 23, 11], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]])


def _train(argv):
    from megatron_core.training.arguments import parse_args
    from megatron_core.training.loop import pretrain
    return pretrain(parse_args(BASE + list(argv)))


def _convert(load, save, tp, pp, loader="mcore", saver="mcore", extra=()):
    argv = ["--model-type", "GPT", "--loader", loader, "--saver", saver, "--load-dir", str(load), "--save-dir",
            str(save), "--target-tensor-parallel-size", str(tp), "--target-pipeline-parallel-size", str(pp),
            "--no-progress", *extra]
    tool = load_tool("checkpoint_convert")
    args = tool.build_parser().parse_args(argv)
    folder = tool.convert(args)
    return folder, (tool.check(args, tool.read_source(args)) if "--check" in extra else None)


def _tensors(directory):
    from megatron_core.checkpointing.convert import read_mcore_checkpoint
    return {t.name: t.load() for t in read_mcore_checkpoint(str(directory)).tensors}


def _logits_at_layout(directory, tokens, max_new_tokens):
    """On tp x pp ranks: (logits on the last stage or None, greedy tokens, log-probs)."""
    from megatron_core import initialize_model_parallel
    from megatron_core.checkpointing import read_metadata
    from megatron_core.inference import generate, load_gpt_from_checkpoint, pipeline_forward
    _, metadata = read_metadata(directory)
    layout = metadata["layout"]
    state = initialize_model_parallel(layout["tp"], layout["pp"])
    with torch.no_grad():
        model, _ = load_gpt_from_checkpoint(directory, state)
        logits = pipeline_forward(model, state, tokens)
        result = generate(model, state, tokens[0, :4].tolist(), max_new_tokens=max_new_tokens, greedy=True)
    return logits, result


@pytest.fixture(scope="module")
def trained(tmp_path_factory, distributed):
    directory = tmp_path_factory.mktemp("trained")
    distributed(1, _train, ["--train-iters", "3", "--save", str(directory)])
    return directory


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(3)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=100, n_positions=64)
    model = transformers.GPT2LMHeadModel(config).eval()
    directory = tmp_path_factory.mktemp("hf")
    model.save_pretrained(directory)
    return model, directory


def test_round_trip_keeps_tensors_and_logits(distributed, trained, tmp_path):
    source, previous = trained, trained
    for i, (tp, pp) in enumerate([(2, 2), (4, 1), (1, 1)]):
        _, difference = _convert(previous, tmp_path / f"step{i}", tp, pp, extra=["--check"])
        assert difference == 0.0
        metadata = json.loads(open(_latest(tmp_path / f"step{i}")).read())
        assert metadata["layout"]["tp"] == tp and metadata["layout"]["pp"] == pp
        assert metadata["config"]["tensor_model_parallel_size"] == tp
        previous = tmp_path / f"step{i}"
    before, after = _tensors(source), _tensors(previous)
    assert before.keys() == after.keys()
    for name in before:
        assert torch.equal(before[name], after[name]), name
    reference = distributed(1, _logits_at_layout, str(source), TOKENS, 4)[0]
    sharded = distributed(4, _logits_at_layout, str(tmp_path / "step0"), TOKENS, 4)
    torch.testing.assert_close(sharded[-1][0], reference[0], rtol=0, atol=1e-5)
    assert sharded[0][1]["tokens"] == reference[1]["tokens"]


def _latest(directory):
    iteration = int(open(os.path.join(directory, "latest_checkpointed_iteration.txt")).read())
    return os.path.join(directory, f"iter_{iteration:07d}", "metadata.json")


def test_hf_import_at_tp2_pp2_matches_transformers(distributed, hf_model, tmp_path):
    model, directory = hf_model
    _convert(directory, tmp_path / "imported", 2, 2, loader="hf")
    with torch.no_grad():
        expected = model(TOKENS).logits
        greedy = model.generate(TOKENS[:1, :4], max_new_tokens=6, do_sample=False, pad_token_id=0)[0, 4:].tolist()
    results = distributed(4, _logits_at_layout, str(tmp_path / "imported"), TOKENS, 6)
    torch.testing.assert_close(results[-1][0], expected, rtol=0, atol=1e-5)
    assert results[0][1]["tokens"] == greedy
    logp = torch.log_softmax(expected[0].double(), -1)
    torch.testing.assert_close(torch.tensor(results[0][1]["prompt_logprobs"], dtype=torch.float64),
                               logp[:3].gather(1, TOKENS[0, 1:4, None]).squeeze(1), rtol=0, atol=1e-5)


def test_hf_pytorch_model_bin_imports(hf_model, tmp_path):
    model, _ = hf_model
    (tmp_path / "bin").mkdir()  # what transformers < 5 wrote with safe_serialization=False
    model.config.save_pretrained(tmp_path / "bin")
    torch.save(model.state_dict(), tmp_path / "bin" / "pytorch_model.bin")
    _, difference = _convert(tmp_path / "bin", tmp_path / "imported", 1, 1, loader="hf", extra=["--check"])
    assert difference < 1e-5


def test_export_of_trained_model_loads_in_transformers(trained, tmp_path):
    transformers = pytest.importorskip("transformers")
    _, difference = _convert(trained, tmp_path / "hf", 1, 1, saver="hf", extra=["--check"])
    assert difference < 1e-5
    model = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    assert model.config.activation_function == "gelu" and model.config.vocab_size == 257


def test_hf_round_trip_keeps_tensors(hf_model, tmp_path):
    from safetensors.torch import load_file
    _, directory = hf_model
    _convert(directory, tmp_path / "mcore", 2, 1, loader="hf")
    _convert(tmp_path / "mcore", tmp_path / "back", 1, 1, saver="hf")
    before, after = load_file(directory / "model.safetensors"), load_file(tmp_path / "back" / "model.safetensors")
    for name, tensor in before.items():
        key = name if name in after else f"transformer.{name}"
        assert torch.equal(tensor, after[key]), name


def test_bad_inputs_name_the_file_and_tensor(trained, hf_model, tmp_path):
    with pytest.raises(ValueError, match="num_attention_heads 4 is not divisible by tensor_model_parallel_size 3"):
        _convert(trained, tmp_path / "a", 3, 1)
    with pytest.raises(ValueError,
                       match="num_layers 2 is not divisible by pipeline_model_parallel_size 3|num_layers 2 <"):
        _convert(trained, tmp_path / "a", 1, 3)
    with pytest.raises(ValueError, match="--target-data-parallel-size must be >= 1"):
        _convert(trained, tmp_path / "a", 1, 1, extra=["--target-data-parallel-size", "0"])
    _convert(trained, tmp_path / "b", 2, 1)
    metadata_path = _latest(tmp_path / "b")
    original = open(metadata_path).read()
    metadata = json.loads(original)
    entry = metadata["tensors"]["decoder.layers.0.mlp.linear_fc1.weight"]
    del entry["shards"]["1"]
    open(metadata_path, "w").write(json.dumps(metadata))
    with pytest.raises(ValueError,
                       match=r"'decoder.layers.0.mlp.linear_fc1.weight' has no shard for tp rank\(s\) \[1\]"):
        _convert(tmp_path / "b", tmp_path / "c", 1, 1)
    open(metadata_path, "w").write(original)
    os.remove(os.path.join(os.path.dirname(metadata_path), "model_tp01_pp000.safetensors"))
    with pytest.raises(ValueError, match=r"model_tp01_pp000.safetensors \(shard of tensor 'embedding"):
        _convert(tmp_path / "b", tmp_path / "c", 1, 1)
    (tmp_path / "qwen2_moe").mkdir()
    (tmp_path / "qwen2_moe" / "config.json").write_text(json.dumps({"model_type": "qwen2_moe"}))
    with pytest.raises(ValueError, match="model_type 'qwen2_moe' is not supported yet.*supported: gpt2, llama"):
        _convert(tmp_path / "qwen2_moe", tmp_path / "d", 1, 1, loader="hf")


def test_generate_cli_writes_json(trained, tmp_path):
    tool = load_tool("generate")
    out = tmp_path / "out.json"
    assert tool.main(["--load", str(trained), "--prompt", "def f(", "--max-new-tokens", "5", "--greedy",
                      "--output-json", str(out)]) == 0
    assert tool.main(["--load", str(trained), "--prompt-ids", "1,2,3", "--max-new-tokens", "4",
                      "--temperature", "0.8", "--top-k", "5", "--top-p", "0.9", "--seed", "1"]) == 0
    payload = json.loads(out.read_text())
    assert len(payload["tokens"]) == 5 and len(payload["generated_logprobs"]) == 5
    assert len(payload["prompt_logprobs"]) == len(payload["prompt_ids"]) - 1
    assert all(lp <= 0 for lp in payload["generated_logprobs"] + payload["prompt_logprobs"])


def test_converted_optimizer_states_resume_with_the_same_losses(distributed, trained, tmp_path):
    metadata = json.loads(open(_latest(trained)).read())
    if not any(name.startswith("optim/") for name in metadata["tensors"]):
        pytest.skip("checkpoints do not store layout-independent optim/ tensors yet (optimizer-state resharding)")
    _convert(trained, tmp_path / "tp2pp2", 2, 2)
    resume = ["--train-iters", "5", "--no-load-rng"]
    same = distributed(1, _train, ["--load", str(trained), *resume])[0]
    moved = distributed(4, _train, ["--load", str(tmp_path / "tp2pp2"), "--tensor-model-parallel-size", "2",
                                    "--pipeline-model-parallel-size", "2", *resume])[0]
    torch.testing.assert_close(torch.tensor(moved), torch.tensor(same), rtol=1e-5, atol=0)


MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "1e-2",
       "--moe-token-dispatcher-type", "alltoall"]


def _moe_logits_at_layout(directory, tokens, ep=None):
    """Logits (last stage, else None) of the checkpoint loaded at its recorded tp x pp (x ep, unless given; x etp)."""
    from megatron_core import initialize_model_parallel
    from megatron_core.checkpointing import read_metadata
    from megatron_core.inference import load_gpt_from_checkpoint, pipeline_forward
    _, metadata = read_metadata(directory)
    layout = metadata["layout"]
    state = initialize_model_parallel(layout["tp"], layout["pp"], expert_model_parallel_size=ep or layout.get("ep", 1),
                                      expert_tensor_parallel_size=metadata["config"].get("expert_tensor_parallel_size")
                                      or 1)
    with torch.no_grad():
        model, _ = load_gpt_from_checkpoint(directory, state)
        return pipeline_forward(model, state, tokens)


def test_moe_conversion_between_tp_pp_ep_keeps_expert_ids_and_logits(distributed, tmp_path):
    """An MoE checkpoint saved at ep 2 converts to tp 2 x pp 2 x ep 2 (experts in their ep rank's file under
    global ids) and back to tp 1 x pp 1 x ep 1: every tensor and the logits are unchanged; logits at
    pp 2 x ep 2 equal those of the source at ep 1."""
    source = tmp_path / "source"
    distributed(2, _train, [*MOE, "--expert-model-parallel-size", "2", "--train-iters", "2", "--save", str(source)])
    _convert(source, tmp_path / "tp2pp2ep2", 2, 2, extra=["--target-expert-parallel-size", "2"])
    metadata = json.loads(open(_latest(tmp_path / "tp2pp2ep2")).read())
    assert metadata["layout"]["ep"] == 2 and metadata["config"]["expert_model_parallel_size"] == 2
    for layer, stage in ((0, 0), (1, 1)):
        for expert in range(4):
            name = f"decoder.layers.{layer}.mlp.experts.local_experts.{expert}.linear_fc1.weight"
            assert metadata["tensors"][name]["shards"] == {"0": {
                "file": f"experts_ep{expert // 2:03d}_pp{stage:03d}.safetensors",
                "shape": metadata["tensors"][name]["global_shape"]}}
    _, difference = _convert(tmp_path / "tp2pp2ep2", tmp_path / "back", 1, 1,
                             extra=["--target-expert-parallel-size", "1", "--check"])
    assert difference == 0.0
    before, after = _tensors(source), _tensors(tmp_path / "back")
    assert before.keys() == after.keys()
    for name in before:
        assert torch.equal(before[name], after[name]), name
    assert metadata["config"]["sequence_parallel"]  # MoE at tp > 1 needs it
    # logits at pp 2 x ep 2 (4 ranks: dp 2; inference runs without sequence parallelism, so tp 1)
    _convert(source, tmp_path / "pp2ep2", 1, 2, extra=["--target-expert-parallel-size", "2"])
    reference = distributed(1, _moe_logits_at_layout, str(source), TOKENS, 1)[0]
    sharded = distributed(4, _moe_logits_at_layout, str(tmp_path / "pp2ep2"), TOKENS)
    torch.testing.assert_close(sharded[-1], reference, rtol=0, atol=1e-5)
    # etp need not be 1 or tp: at tp 1 x etp 2 each expert is split over 2 dp ranks (experts_ep000_tp0{0,1})
    _convert(source, tmp_path / "etp2", 1, 1, extra=["--target-expert-parallel-size", "1",
                                                      "--target-expert-tensor-parallel-size", "2"])
    metadata = json.loads(open(_latest(tmp_path / "etp2")).read())
    fc1 = metadata["tensors"]["decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight"]
    assert fc1["partition_dim"] == 0 and fc1["shards"]["1"]["file"] == "experts_ep000_tp01_pp000.safetensors"
    for logits in distributed(2, _moe_logits_at_layout, str(tmp_path / "etp2"), TOKENS):
        torch.testing.assert_close(logits, reference, rtol=0, atol=1e-5)
    _convert(tmp_path / "etp2", tmp_path / "etp1", 1, 1, extra=["--target-expert-tensor-parallel-size", "1"])
    merged = _tensors(tmp_path / "etp1")
    for name in before:
        assert torch.equal(before[name], merged[name]), name
