"""pretrain_gpt's loop with --mtp-num-layers (fp32, 8 iterations) equals the single-process run (losses and the
logged per-depth MTP losses to 1e-5 relative) at: tp 2 with sequence parallelism, pp 2 tied and untied (the
last stage's embedding copy), cp 2 (the shift crosses cp ranks), dp 2 with ZeRO-3, and two depths at
tp 2 x sp x pp 2 untied; the log line names each depth's loss; a checkpoint saved at pp 2 resumes at pp 1,
and converted back to pp 2 by tools/checkpoint_convert.py resumes there."""
import contextlib
import io
import json

import pytest
import torch

from tests.recipe import RECIPE

BASE = [*RECIPE, "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "8", "--lr", "2e-3",
        "--min-lr", "1e-4", "--lr-warmup-iters", "2", "--eval-interval", "1000", "--log-interval", "1000",
        "--seed", "7", "--mtp-loss-scaling-factor", "0.3"]
UNTIED = ["--untie-embeddings-and-output-weights"]


def _mtp(depths):
    return ["--mtp-num-layers", str(depths)]


def _train(argv):
    from megatron_core.training.arguments import parse_args
    from megatron_core.training.loop import pretrain
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        losses = pretrain(parse_args(BASE + list(argv)))
    return losses, out.getvalue()


def _records(path):
    with open(path) as handle:
        return [json.loads(line) for line in handle if '"split"' not in line]


def _run(distributed, world, argv, metrics):
    """``(losses, metrics records, rank 0's stdout)`` of one run writing its metrics to ``metrics``."""
    losses, log = distributed(world, _train, [*argv, "--metrics-file", str(metrics)])[0]
    return losses, _records(metrics), log


@pytest.fixture(scope="module")
def references(tmp_path_factory, distributed):
    """Single-process runs by model ``(depths, untied)``: one depth tied and untied, two depths untied."""
    folder = tmp_path_factory.mktemp("mtp_ref")
    return {(depths, untied): _run(distributed, 1, [*_mtp(depths), *(UNTIED if untied else []), "--log-interval", "4"],
                                   folder / f"{depths}{untied}.jsonl")
            for depths, untied in ((1, False), (1, True), (2, True))}


TP2_SP = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
PP2 = ["--pipeline-model-parallel-size", "2"]
LAYOUTS = {  # name: (world, depths, untied, flags)
    "tp2-sp": (2, 1, False, TP2_SP),
    "pp2-untied": (2, 1, True, PP2),
    "pp2-tied": (2, 1, False, PP2),
    "cp2": (2, 1, False, ["--context-parallel-size", "2"]),
    "dp2-zero3": (2, 1, False, ["--zero-stage", "3"]),
    "tp2-sp-pp2-untied-2-depths": (4, 2, True, [*TP2_SP, *PP2]),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_mtp_losses_match_single_process(distributed, references, tmp_path, name):
    world, depths, untied, argv = LAYOUTS[name]
    losses, records, _ = _run(distributed, world, [*_mtp(depths), *(UNTIED if untied else []), *argv],
                              tmp_path / "metrics.jsonl")
    ref_losses, ref_records, _ = references[(depths, untied)]
    assert len(losses) == 8 and losses[-1] < losses[0]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    for key in [f"mtp_{k}_loss" for k in range(1, depths + 1)] + ["grad_norm"]:
        values = torch.tensor([r[key] for r in records])
        assert (values > 0).all(), key
        torch.testing.assert_close(values, torch.tensor([r[key] for r in ref_records[:8]]), rtol=1e-5, atol=0)


def test_mtp_changes_training_and_is_logged(distributed, references, tmp_path):
    """The MTP loss trains the shared weights (the lm losses differ from a run without it after the first
    step), a run without it logs no MTP loss, and the log line names each depth's loss."""
    plain, plain_records, _ = _run(distributed, 1, UNTIED, tmp_path / "plain.jsonl")
    ref_losses, _, log = references[(2, True)]
    assert plain[0] == pytest.approx(ref_losses[0], rel=1e-6) and abs(plain[-1] - ref_losses[-1]) > 1e-4
    assert "mtp_1_loss" not in plain_records[0]
    line = next(line for line in log.splitlines() if "iteration        4/" in line)
    assert " lm loss: " in line and " mtp_1 loss: " in line and " mtp_2 loss: " in line


def _convert(load, save, tp, pp):
    from tests.data.conftest import load_tool
    tool = load_tool("checkpoint_convert")
    tool.convert(tool.build_parser().parse_args([
        "--model-type", "GPT", "--loader", "mcore", "--saver", "mcore", "--load-dir", str(load), "--save-dir",
        str(save), "--target-tensor-parallel-size", str(tp), "--target-pipeline-parallel-size", str(pp),
        "--no-progress"]))


def test_checkpoint_saved_at_pp2_resumes_at_pp1_and_converts_back_to_pp2(distributed, references, tmp_path):
    """3 iterations at pp 2, 2 resumed at pp 1, converted to pp 2 by tools/checkpoint_convert.py (mtp.* in the
    last stage's file), 3 more at pp 2: the uninterrupted single-process run's losses."""
    argv, saved, converted = [*_mtp(2), *UNTIED], tmp_path / "saved", tmp_path / "converted"
    first, _ = distributed(2, _train, [*argv, *PP2, "--save", str(saved), "--exit-interval", "3"])[0]
    second, _ = distributed(1, _train, [*argv, "--load", str(saved), "--save", str(saved), "--exit-interval", "5"])[0]
    _convert(saved, converted, 1, 2)
    third, _ = distributed(2, _train, [*argv, *PP2, "--load", str(converted), "--no-load-rng"])[0]
    torch.testing.assert_close(torch.tensor(first + second + third), torch.tensor(references[(2, True)][0]),
                               rtol=1e-5, atol=0)
    records = json.loads(next(converted.glob("iter_*/metadata.json")).read_text())["tensors"]
    for name, stage in (("mtp.layers.1.eh_proj.weight", 1), ("mtp.layers.0.transformer_layer.mlp.linear_fc1.weight", 1),
                        ("output_layer.weight", 1), ("embedding.word_embeddings.weight", 0)):
        assert records[name]["shards"]["0"]["file"] == f"model_tp00_pp{stage:03d}.safetensors", name
