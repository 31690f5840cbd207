"""Generation from an imported Hugging Face model: ``torchrun --nproc-per-node 2 tools/generate.py --load
<imported at tp 2> --greedy`` with no layout flags runs the checkpoint at its own layout and gives
transformers' greedy tokens; a launch whose process count fits neither the checkpoint nor one process is
refused naming both."""
import json
import os
import subprocess
import sys

import pytest
import torch

from tests.data.conftest import REPO, load_tool

transformers = pytest.importorskip("transformers")

PROMPT = [5, 17, 3, 42]
NEW = 6


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """(tp 2 checkpoint of a tiny transformers Llama, transformers' greedy continuation of PROMPT)."""
    base = tmp_path_factory.mktemp("generate_hf")
    torch.manual_seed(3)
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=96,
                                      max_position_embeddings=64, tie_word_embeddings=False, initializer_range=0.3)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(base / "hf")
    with torch.no_grad():
        greedy = model.generate(torch.tensor([PROMPT]), max_new_tokens=NEW, do_sample=False,
                                pad_token_id=0)[0, len(PROMPT):].tolist()
    status = load_tool("checkpoint_convert").main(["--model-type", "GPT", "--loader", "hf", "--saver", "mcore",
                                                   "--load-dir", str(base / "hf"), "--save-dir", str(base / "ckpt"),
                                                   "--target-tensor-parallel-size", "2", "--no-progress"])
    assert status == 0
    return str(base / "ckpt"), greedy


def _torchrun(nproc, argv, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("TRITON_INTERPRET", None)
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                           str(nproc), os.path.join(REPO, "tools", "generate.py"), *argv], capture_output=True,
                          text=True, timeout=180, cwd=tmp_path, env=env)


def test_greedy_generation_at_the_checkpoints_own_layout_matches_transformers(imported, tmp_path):
    ckpt, greedy = imported
    out = tmp_path / "out.json"
    proc = _torchrun(2, ["--load", ckpt, "--prompt-ids", ",".join(map(str, PROMPT)), "--greedy",
                         "--max-new-tokens", str(NEW), "--output-json", str(out)], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    payload = json.loads(out.read_text())
    assert payload["layout"] == {"tp": 2, "pp": 1, "ep": 1, "etp": 1}  # the checkpoint's own (no layout flag)
    tokens = payload["tokens"]
    assert len(tokens) == NEW and tokens[:len(greedy)] == greedy, (tokens, greedy)  # (transformers stops at eos)


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    """(a tiny transformers Mixtral folder, transformers' greedy continuation of PROMPT); routers drawn wide
    so that no two experts nearly tie."""
    base = tmp_path_factory.mktemp("generate_mixtral")
    torch.manual_seed(3)
    config = transformers.MixtralConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=96,
                                        max_position_embeddings=64, num_local_experts=4, num_experts_per_tok=2,
                                        tie_word_embeddings=False, initializer_range=0.3, sliding_window=None)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("gate.weight"):
                param.normal_(0.0, 1.0)
        greedy = model.generate(torch.tensor([PROMPT]), max_new_tokens=NEW, do_sample=False,
                                pad_token_id=0)[0, len(PROMPT):].tolist()
    model.save_pretrained(base / "hf")
    return base / "hf", greedy


@pytest.mark.parametrize("layout,flags", [
    ({"tp": 2, "pp": 1, "ep": 2, "etp": 1}, ["--target-expert-parallel-size", "2"]),
    ({"tp": 2, "pp": 1, "ep": 1, "etp": 2}, ["--target-expert-tensor-parallel-size", "2"]),
])
def test_moe_greedy_generation_at_its_own_expert_layout_matches_transformers(mixtral, layout, flags, tmp_path):
    """A Mixtral imported at tp 2 x ep 2 (experts spread over the 2 ranks) and at tp 2 x etp 2 (each expert split
    over them) decodes at that layout (every tp rank routes the whole sequence: one new token cannot be split)."""
    folder, greedy = mixtral
    status = load_tool("checkpoint_convert").main(["--model-type", "GPT", "--loader", "hf", "--saver", "mcore",
                                                   "--load-dir", str(folder), "--save-dir", str(tmp_path / "ckpt"),
                                                   "--target-tensor-parallel-size", "2", "--no-progress", *flags])
    assert status == 0
    out = tmp_path / "out.json"
    proc = _torchrun(2, ["--load", str(tmp_path / "ckpt"), "--prompt-ids", ",".join(map(str, PROMPT)), "--greedy",
                         "--max-new-tokens", str(NEW), "--output-json", str(out)], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    payload = json.loads(out.read_text())
    assert payload["layout"] == layout
    assert payload["tokens"][:len(greedy)] == greedy, (payload["tokens"], greedy)


def test_a_process_count_that_fits_no_layout_is_refused(imported, tmp_path):
    ckpt, _ = imported
    proc = _torchrun(3, ["--load", ckpt, "--prompt-ids", "1,2", "--max-new-tokens", "2"], tmp_path)
    assert proc.returncode != 0
    assert "3 processes cannot run" in proc.stderr and "(tp 2 x pp 1)" in proc.stderr, proc.stderr[-3000:]
    assert "generate.py: error:" in proc.stderr
