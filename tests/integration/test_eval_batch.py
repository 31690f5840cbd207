"""``--eval-global-batch-size`` (Megatron-LM's): one evaluation step of 2 x the training global batch reads the
same validation samples as two steps of the training batch, so the validation loss is the same; a size the
micro-batch x data-parallel size does not divide stops the run before its first step, naming the values. A
dense model accepts (and ignores) an expert tensor-parallel size, as Megatron does; `--position-embedding-type yarn`
is rope with YaRN."""
import json

import pytest

from tests.recipe import RECIPE

BASE = [*RECIPE, "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "2", "--eval-interval", "2",
        "--log-interval", "1000", "--seed", "7", "--mock-data", "--tokenizer-type", "NullTokenizer",
        "--vocab-size", "100"]


def _valid_loss(argv):
    from megatron_core.training.arguments import parse_args
    from megatron_core.training.loop import pretrain
    metrics = argv[argv.index("--metrics-file") + 1]
    pretrain(parse_args(BASE + list(argv)))
    with open(metrics) as handle:
        return [json.loads(line)["lm_loss"] for line in handle if '"valid"' in line]


def test_an_eval_batch_of_twice_the_global_batch_equals_two_eval_steps(distributed, tmp_path):
    one = distributed(2, _valid_loss, ["--eval-iters", "1", "--eval-global-batch-size", "8",
                                       "--metrics-file", str(tmp_path / "a.jsonl")])[0]
    two = distributed(2, _valid_loss, ["--eval-iters", "2", "--metrics-file", str(tmp_path / "b.jsonl")])[0]
    assert len(one) == len(two) == 1
    assert one[0] == pytest.approx(two[0], rel=1e-6)


def test_a_bad_eval_batch_names_the_values(distributed, tmp_path):
    with pytest.raises(ValueError, match="--eval-global-batch-size 5 is not divisible by --micro-batch-size 2"):
        distributed(1, _valid_loss, ["--eval-iters", "1", "--eval-global-batch-size", "5",
                                     "--metrics-file", str(tmp_path / "c.jsonl")])


def test_a_dense_model_ignores_the_expert_tensor_parallel_size():
    from megatron_core.training.arguments import parse_args
    assert parse_args(["--tensor-model-parallel-size", "2", "--expert-tensor-parallel-size", "4"]
                      ).expert_tensor_parallel_size == 1


def test_yarn_as_a_position_embedding_type_is_rope_with_yarn():
    from megatron_core.training.arguments import parse_args, transformer_config
    config = transformer_config(parse_args(["--position-embedding-type", "yarn", "--rotary-scaling-factor", "4"]))
    assert config.position_embedding_type == "rope" and config.yarn_rope_scaling.factor == 4.0
