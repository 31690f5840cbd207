"""Megatron-LM's flexible pipeline layout (--pipeline-model-parallel-layout), --num-virtual-stages-per-pipeline-rank
and --microbatch-group-size-per-virtual-pipeline-stage: Megatron CI layout strings parse to the right per-chunk
counts, bad ones exit 2 naming the string; pretrain_gpt's loop (fp32, 8 iterations) at an uneven pp 2 layout, an
interleaved pp 2 x vpp 2 layout, one with an embedding-only and an empty chunk, N virtual stages, a micro-batch
group of 4, and an MTP layout equals the single-process run (losses to 1e-5 relative); a checkpoint saved at a
layout resumes at pp 1 and at another layout with the same losses, its layers filed on the layout's stages."""
import contextlib
import io
import json

import pytest
import torch

from tests.recipe import RECIPE

BASE = [*RECIPE, "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "8", "--lr", "2e-3",
        "--min-lr", "1e-4", "--lr-warmup-iters", "2", "--eval-interval", "1000", "--log-interval", "1000",
        "--seed", "7"]
PP2 = ["--pipeline-model-parallel-size", "2"]
MTP = ["--num-layers", "2", "--mtp-num-layers", "1"]


def _train(argv):
    from megatron_core.training.arguments import parse_args
    from megatron_core.training.loop import pretrain
    return pretrain(parse_args(BASE + list(argv)))


def _error(argv) -> str:
    from megatron_core.training.arguments import parse_args
    err = io.StringIO()
    with pytest.raises(SystemExit) as exit_, contextlib.redirect_stderr(err):
        parse_args(BASE + list(argv))
    assert exit_.value.code == 2
    return err.getvalue()


def _config(argv):
    from megatron_core.training.arguments import parse_args, transformer_config
    return transformer_config(parse_args(BASE + list(argv)))


def _layout(text, pp, layers, mtp=None):
    argv = ["--pipeline-model-parallel-size", str(pp), "--num-layers", str(layers),
            "--pipeline-model-parallel-layout", text]
    return _config(argv + (["--mtp-num-layers", str(mtp)] if mtp else []))


@pytest.mark.parametrize("text, pp, layers, mtp, counts, vpp", [
    ("Et*3|(tt|)*6tmL", 4, 16, 1, [3, 2, 2, 2, 2, 2, 2, 1], 2),
    ("Et*7|t*7mL", 2, 14, 1, [7, 7], None),
    ("Et|(tt|)*6mL", 2, 13, 1, [1, 2, 2, 2, 2, 2, 2, 0], 4),
    ("E|t*4|tL", 3, 5, None, [0, 4, 1], None),
    ("Et*2|(tt|)*5t|tmL", 4, 14, 1, [2, 2, 2, 2, 2, 2, 1, 1], 2),
    ("E,t|(t|(t)*2|)*2L", 3, 7, None, [1, 1, 2, 1, 2, 0], 2),  # commas, nested groups, a loss-only chunk
])
def test_megatron_layout_strings_parse(text, pp, layers, mtp, counts, vpp):
    config = _layout(text, pp, layers, mtp)
    assert (config.pipeline_model_parallel_layout, config.virtual_pipeline_model_parallel_size) == (counts, vpp)
    ranges = [config.pipeline_layer_range(i % pp, i // pp if vpp else None) for i in range(len(counts))]
    assert ranges == [(sum(counts[:i]), n) for i, n in enumerate(counts)]  # global order = chunk order


@pytest.mark.parametrize("argv, message", [
    (["--pipeline-model-parallel-layout", "Et|tttL", "--num-layers", "5"],
     "'Et|tttL' (2 chunks: Et|tttL) has 4 transformer layers (t) but --num-layers is 5"),
    (["--pipeline-model-parallel-layout", "Et|tLtt"], "'Et|tLtt' (2 chunks: Et|tLtt) must hold one L"),
    (["--pipeline-model-parallel-layout", "tE|tttL"], "'tE|tttL' (2 chunks: tE|tttL) must hold one E"),
    (["--pipeline-model-parallel-layout", "Et|tttmL"], "has 1 m layers but --mtp-num-layers is None"),
    (["--pipeline-model-parallel-layout", "Etm|tmL", *MTP], "the m layers (multi-token prediction) must sit in the "
                                                           "last chunk"),
    (["--pipeline-model-parallel-layout", "Et|t|tttL"], "(3 chunks: Et|t|tttL) is not a multiple of "
                                                        "--pipeline-model-parallel-size 2"),
    (["--pipeline-model-parallel-layout", "Et*|tttL"], "'Et*|tttL' has a '*' without a count"),
    (["--pipeline-model-parallel-layout", "E(t|tttL"], "'E(t|tttL' has an unclosed '('"),
    (["--pipeline-model-parallel-layout", "Ex|tttL"], "'Ex|tttL' has 'x', which is no layer"),
    (["--pipeline-model-parallel-layout", "Et|tttL", "--decoder-first-pipeline-num-layers", "1"],
     "--pipeline-model-parallel-layout Et|tttL gives every stage's layers; drop --decoder-first-pipeline-num-layers"),
    (["--pipeline-model-parallel-layout", "Et|t|t|tL", "--num-layers-per-virtual-pipeline-stage", "1"],
     "--pipeline-model-parallel-layout Et|t|t|tL and --num-layers-per-virtual-pipeline-stage 1 both set"),
    (["--num-virtual-stages-per-pipeline-rank", "3"], "--num-layers 4 is not divisible by "
                                                      "--pipeline-model-parallel-size 2 x --num-virtual-stages-per"),
    (["--num-virtual-stages-per-pipeline-rank", "2", "--microbatch-group-size-per-virtual-pipeline-stage", "1"],
     "--microbatch-group-size-per-virtual-pipeline-stage 1 must be at least --pipeline-model-parallel-size 2"),
])
def test_bad_layouts_exit_naming_them(argv, message):
    err = _error([*PP2, *argv])
    assert message in err and "pretrain_gpt.py: error:" in err, err


def test_config_validates_the_layout_and_the_converter_follows_it():
    from megatron_core.checkpointing.convert import pipeline_stage_of
    from megatron_core.config import TransformerConfig
    common = dict(num_layers=5, hidden_size=32, num_attention_heads=4, max_position_embeddings=16)
    config = TransformerConfig(**common, pipeline_model_parallel_size=3, pipeline_model_parallel_layout=[0, 4, 1])
    assert [pipeline_stage_of(f"decoder.layers.{n}.mlp.linear_fc1.weight", config) for n in range(5)] == [1] * 4 + [2]
    assert pipeline_stage_of("embedding.word_embeddings.weight", config) == 0
    for kwargs, message in (
            (dict(pipeline_model_parallel_layout=[1, 3]), "holds 4 layers, not num_layers"),
            (dict(pipeline_model_parallel_layout=[1, 4]), "has 2 chunks, not pipeline_model_parallel_size x virtual"),
            (dict(pipeline_model_parallel_layout=[2, -1, 4]), "a transformer-layer count >= 0 per chunk"),
            (dict(pipeline_model_parallel_layout=[1, 2, 2], first_pipeline_num_layers=1), "two ways to split")):
        with pytest.raises(ValueError, match=message.replace("(", r"\(")):
            TransformerConfig(**common, pipeline_model_parallel_size=3, **kwargs)


def test_uneven_splits_with_virtual_stages():
    """Megatron's uneven stages with virtual stages: the embedding/loss as a layer of the first/last chunk, and
    first/last stage counts spread over each rank's chunks."""
    vp2 = ["--num-virtual-stages-per-pipeline-rank", "2"]
    config = _config(["--pipeline-model-parallel-size", "4", "--num-layers", "14", *vp2,
                      "--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split"])
    assert config.pipeline_model_parallel_layout == [1, 2, 2, 2, 2, 2, 2, 1]
    config = _config([*PP2, "--num-layers", "8", *vp2, "--decoder-first-pipeline-num-layers", "2"])
    assert config.pipeline_model_parallel_layout == [1, 3, 1, 3]


def test_microbatch_groups_follow_megatrons_schedule_table():
    """Megatron's example (pp 2, vpp 2, groups of 3, 5 micro-batches): rank 0 runs forwards of micro-batches
    0 1 2 0 1 2 3 4 3 4 on chunks 0 0 0 1 1 1 0 0 1 1; every valid group size runs deadlock-free."""
    from megatron_core.pipeline_parallel.schedule_plan import check_microbatch_group, interleaved_ops, simulate
    forwards = [op for op in interleaved_ops(0, 2, 2, 5, group_size=3) if op.kind == "F"]
    assert [(op.microbatch, op.chunk) for op in forwards] == [
        (0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1), (3, 0), (4, 0), (3, 1), (4, 1)]
    for pp, vpp, m, group in ((2, 2, 5, 3), (2, 3, 8, 4), (4, 2, 9, 5), (3, 2, 6, 6)):
        check_microbatch_group(m, pp, group)
        simulate([interleaved_ops(r, pp, vpp, m, group_size=group) for r in range(pp)], vpp)
    with pytest.raises(ValueError, match="microbatch_group_size_per_vp_stage 3 does not fit num_microbatches 4"):
        check_microbatch_group(4, 2, 3)  # a last group of 1 < pp
    assert _config([*PP2, "--num-virtual-stages-per-pipeline-rank", "2",
                    "--microbatch-group-size-per-virtual-pipeline-stage", "4"]).microbatch_group_size_per_vp_stage == 4


@pytest.fixture(scope="module")
def references(distributed):
    """The single-process runs: dense with 4 layers, and 2 layers with one MTP depth."""
    return {"dense": distributed(1, _train, [])[0], "mtp": distributed(1, _train, MTP)[0]}


LAYOUTS = {
    "uneven": ("dense", [*PP2, "--pipeline-model-parallel-layout", "Et|tttL"]),
    "interleaved": ("dense", [*PP2, "--pipeline-model-parallel-layout", "Et|t|t|tL"]),
    "embedding-only-and-empty-chunk": ("dense", [*PP2, "--pipeline-model-parallel-layout", "E|tt||ttL"]),
    "virtual-stages": ("dense", [*PP2, "--num-virtual-stages-per-pipeline-rank", "2"]),
    "microbatch-group-4": ("dense", [*PP2, "--num-virtual-stages-per-pipeline-rank", "2",
                                     "--microbatch-group-size-per-virtual-pipeline-stage", "4"]),
    "mtp": ("mtp", [*PP2, *MTP, "--pipeline-model-parallel-layout", "Et|tmL"]),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_losses_match_single_process(distributed, references, name):
    reference, argv = LAYOUTS[name]
    losses = distributed(2, _train, argv)[0]
    assert len(losses) == 8 and losses[-1] < losses[0]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(references[reference]), rtol=1e-5, atol=0)


def test_checkpoint_saved_at_a_layout_resumes_at_pp1_and_at_another_layout(distributed, references, tmp_path):
    """3 iterations at 'Et|tttL' (layer 0 on stage 0, layers 1-3 on stage 1), 2 resumed at pp 1, 3 at the
    interleaved 'Et|t|t|tL': the uninterrupted single-process run's losses."""
    saved = tmp_path / "saved"
    first = distributed(2, _train, [*PP2, "--pipeline-model-parallel-layout", "Et|tttL", "--save", str(saved),
                                    "--exit-interval", "3"])[0]
    records = json.loads(next(saved.glob("iter_*/metadata.json")).read_text())["tensors"]
    stages = [records[f"decoder.layers.{n}.mlp.linear_fc1.weight"]["shards"]["0"]["file"] for n in range(4)]
    assert stages == ["model_tp00_pp000.safetensors"] + ["model_tp00_pp001.safetensors"] * 3
    second = distributed(1, _train, ["--load", str(saved), "--save", str(saved), "--exit-interval", "5"])[0]
    third = distributed(2, _train, [*PP2, "--pipeline-model-parallel-layout", "Et|t|t|tL", "--load", str(saved)])[0]
    torch.testing.assert_close(torch.tensor(first + second + third), torch.tensor(references["dense"]),
                               rtol=1e-5, atol=0)
