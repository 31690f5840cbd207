"""Fine-tune from an imported Hugging Face model with Megatron's flags: ``pretrain_gpt.py --load <imported>
--use-checkpoint-args --finetune --tokenizer-type HuggingFaceTokenizer --tokenizer-model <the HF folder>`` takes
the architecture from the checkpoint and trains at another layout, and the result exports back to a folder
transformers loads, with the tokenizer files copied; a command-line flag contradicting the checkpoint's
architecture exits 2 naming both values."""
import json
import math

import pytest
import torch

from tests.data.conftest import load_tool
from tests.integration.test_reliability import run_main
from tests.recipe import RECIPE

transformers = pytest.importorskip("transformers")

RUN = [*RECIPE, "--mock-data", "--train-iters", "2", "--micro-batch-size", "2", "--global-batch-size", "4",
       "--seq-length", "16", "--lr", "1e-4", "--min-lr", "1e-5", "--lr-warmup-iters", "0",
       "--eval-interval", "100000", "--log-interval", "1"]


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """(the folder of a tiny Llama (GQA, untied) and its word-level tokenizer saved by transformers, its import
    at tp 1)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    base = tmp_path_factory.mktemp("finetune_hf")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=96,
                                      max_position_embeddings=64, tie_word_embeddings=False)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(base / "hf")
    words = Tokenizer(models.WordLevel({**{f"w{i}": i for i in range(95)}, "<unk>": 95}, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=words, unk_token="<unk>",
                                         eos_token="w0").save_pretrained(base / "hf")
    status = load_tool("checkpoint_convert").main(["--model-type", "GPT", "--loader", "hf", "--saver", "mcore",
                                                   "--load-dir", str(base / "hf"), "--save-dir",
                                                   str(base / "ckpt"), "--no-progress"])
    assert status == 0
    return str(base / "hf"), str(base / "ckpt")


def _train(argv):
    import contextlib
    import io
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status, err = run_main(argv)
    return status, err, out.getvalue()


def test_finetune_with_checkpoint_args_at_tp2_and_export_back(distributed, imported, tmp_path, capsys):
    hf, ckpt = imported
    argv = [*RUN, "--load", ckpt, "--use-checkpoint-args", "--finetune", "--tensor-model-parallel-size", "2",
            "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", hf, "--save", str(tmp_path / "finetuned")]
    (status, err, out), _ = distributed(2, _train, argv)
    assert status == 0, err
    assert "tp 2 x cp 1 x pp 1" in out and f"loaded checkpoint {ckpt}" in out
    losses = [float(line.split("lm loss: ")[1].split()[0]) for line in out.splitlines() if "lm loss: " in line]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)
    assert abs(losses[0] - math.log(96)) < 1.0  # a random model of vocab 96: loss near ln 96
    recorded = json.loads(next((tmp_path / "finetuned").glob("iter_*/metadata.json")).read_text())["config"]
    assert (recorded["tokenizer_type"], recorded["tokenizer_model"]) == ("HuggingFaceTokenizer", hf)
    export = tmp_path / "exported"
    assert load_tool("checkpoint_convert").main(["--model-type", "GPT", "--loader", "mcore", "--saver", "hf",
                                                 "--load-dir", str(tmp_path / "finetuned"), "--save-dir",
                                                 str(export), "--check", "--no-progress"]) == 0
    assert float(capsys.readouterr().out.split("= ")[-1]) <= 1e-5  # transformers runs the fine-tuned weights
    assert {"tokenizer.json", "tokenizer_config.json"} <= {p.name for p in export.iterdir()}
    tokenizer = transformers.AutoTokenizer.from_pretrained(export)
    assert tokenizer("w3 w17 w94")["input_ids"] == transformers.AutoTokenizer.from_pretrained(hf)(
        "w3 w17 w94")["input_ids"] == [3, 17, 94]


def test_a_flag_contradicting_the_checkpoint_is_named(distributed, imported):
    status, err = distributed(1, run_main, [*RUN, "--load", imported[1], "--use-checkpoint-args", "--finetune",
                                            "--num-layers", "3"])[0]
    assert status == 2 and "--num-layers 3 (the checkpoint has 2)" in err, err


def test_use_checkpoint_args_needs_a_checkpoint(distributed, tmp_path):
    status, err = distributed(1, run_main, [*RUN, "--load", str(tmp_path), "--use-checkpoint-args"])[0]
    assert status == 2 and "--use-checkpoint-args needs --load with a checkpoint" in err, err
