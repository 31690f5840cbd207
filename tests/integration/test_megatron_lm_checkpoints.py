"""Megatron-LM checkpoints in and out, checked against NVIDIA megatron-core 0.16.1 on CPU.

megatron-core writes checkpoints of its own GPTModel (local layer spec) in Megatron-LM's ``torch`` and
``torch_dist`` formats at tp x pp layouts (``megatron_core_reference.py``, run in its own processes);
``tools/checkpoint_convert.py --loader core`` converts them and our model gives megatron-core's logits to 1e-5;
``--saver core`` writes checkpoints megatron-core loads (strict) and runs to the same logits.
"""
import argparse
import os
import pickle

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron_core import initialize_model_parallel  # noqa: E402
from megatron_core.checkpointing import megatron_lm_io, read_metadata  # noqa: E402
from megatron_core.inference import load_gpt_from_checkpoint  # noqa: E402
from tests.data.conftest import load_tool  # noqa: E402
from tests.fork_server import run_python  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
REFERENCE = os.path.join(HERE, "megatron_core_reference.py")
TOKENS = torch.arange(16).reshape(2, 8) * 5 % 100  # as in the reference script
TRUE_VOCAB = 100  # NullTokenizer(99) + eod

convert_tool = load_tool("checkpoint_convert")


def reference(mode: str, folder, *, fmt: str, arch: str, tp: int, pp: int) -> torch.Tensor:
    """Runs megatron-core (``save`` or ``load``) at tp x pp; returns its logits ``[2, 8, V]`` (true vocab)."""
    command = [REFERENCE, mode, str(folder), "--format", fmt, "--arch", arch, "--tp", str(tp), "--pp", str(pp)]
    result = run_python(command, timeout=240)  # its own process, forked from one that imported torch
    assert result.returncode == 0, result.stderr[-3000:]
    return torch.load(os.path.join(folder, "logits.pt"))[..., :TRUE_VOCAB]


def our_logits(folder) -> torch.Tensor:
    model, _ = load_gpt_from_checkpoint(str(folder), initialize_model_parallel(), parallel_output=False)
    with torch.no_grad():
        return model(TOKENS, torch.arange(8).expand(2, 8))


def convert(*argv) -> int:
    return convert_tool.main(["--model-type", "GPT", "--no-progress", *map(str, argv)])


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """Checkpoints megatron-core wrote: {(format, arch, tp, pp): (folder, logits)}."""
    out = {}
    for fmt, arch, tp, pp in (("torch", "gpt", 2, 2), ("torch_dist", "llama", 2, 1)):
        folder = tmp_path_factory.mktemp(f"megatron_{fmt}_{arch}")
        out[(fmt, arch, tp, pp)] = folder, reference("save", folder, fmt=fmt, arch=arch, tp=tp, pp=pp)
    return out


@pytest.mark.parametrize("key", [("torch", "gpt", 2, 2), ("torch_dist", "llama", 2, 1)])
def test_megatron_lm_checkpoint_converts_to_the_same_logits(written, tmp_path, key):
    """--loader core reads megatron-core's files (GPT-2-like tp 2 x pp 2 torch; Llama-like tp 2 torch_dist: rope,
    RMSNorm, SwiGLU, GQA, untied); the result keeps the source layout and gives its logits."""
    folder, theirs = written[key]
    assert convert("--loader", "core", "--saver", "mcore", "--load-dir", folder, "--save-dir", tmp_path / "ours") == 0
    _, metadata = read_metadata(str(tmp_path / "ours"))
    assert (metadata["layout"]["tp"], metadata["layout"]["pp"]) == key[2:]  # target sizes default to the source's
    assert metadata["iteration"] == 7 and metadata["consumed_samples"] == 70 and metadata["true_vocab_size"] == 100
    torch.testing.assert_close(our_logits(tmp_path / "ours"), theirs, atol=1e-5, rtol=0)


@pytest.mark.parametrize("fmt,arch,tp,pp", [("torch_dist", "gpt", 1, 2), ("torch", "llama", 2, 1)])
def test_saver_core_writes_what_megatron_core_loads(written, tmp_path, fmt, arch, tp, pp):
    """ours -> --saver core at another layout -> megatron-core loads it (strict) and gives the same logits."""
    source = {"gpt": ("torch", "gpt", 2, 2), "llama": ("torch_dist", "llama", 2, 1)}[arch]
    folder, theirs = written[source]
    assert convert("--loader", "core", "--saver", "mcore", "--load-dir", folder, "--save-dir", tmp_path / "ours",
                   "--target-tensor-parallel-size", 1, "--target-pipeline-parallel-size", 1) == 0
    assert convert("--loader", "mcore", "--saver", "core", "--ckpt-format", fmt, "--load-dir", tmp_path / "ours",
                   "--save-dir", tmp_path / "back", "--target-tensor-parallel-size", tp,
                   "--target-pipeline-parallel-size", pp) == 0
    again = reference("load", tmp_path / "back", fmt=fmt, arch=arch, tp=tp, pp=pp)
    torch.testing.assert_close(again, theirs, atol=1e-5, rtol=0)


class _Payload:
    """Unpickling this runs ``open(path, "w")``: a stand-in for code a hostile checkpoint would run."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_loading_never_runs_code_from_the_files(tmp_path):
    marker = tmp_path / "pwned"
    folder = tmp_path / "ckpt" / "iter_0000001" / "mp_rank_00"
    folder.mkdir(parents=True)
    (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").write_text("1")
    torch.save({"args": _Payload(str(marker)), "model": {}}, folder / "model_optim_rng.pt")
    loaded = megatron_lm_io.load_pt(str(folder / "model_optim_rng.pt"))
    assert isinstance(loaded["args"], megatron_lm_io.Opaque) and not marker.exists()
    assert convert("--loader", "core", "--load-dir", tmp_path / "ckpt", "--save-dir", tmp_path / "out") == 2
    assert not marker.exists()
    dist_folder = tmp_path / "dist"
    dist_folder.mkdir()
    (dist_folder / ".metadata").write_bytes(pickle.dumps(_Payload(str(marker))))
    with pytest.raises(ValueError, match="refusing to load it"):
        megatron_lm_io.read_dcp_metadata(str(dist_folder))
    assert not marker.exists()


def test_foreign_folder_is_named_as_such(written, tmp_path, capsys):
    folder, _ = written[("torch", "gpt", 2, 2)]
    assert convert("--loader", "mcore", "--load-dir", folder, "--save-dir", tmp_path / "x") == 2
    error = capsys.readouterr().err
    assert "is a Megatron-LM checkpoint (torch format)" in error and "--loader core" in error
    assert "incomplete" not in error


def test_unsupported_megatron_checkpoints_are_refused_clearly(tmp_path, capsys):
    folder = tmp_path / "moe" / "iter_0000003" / "mp_rank_00_000_001"
    folder.mkdir(parents=True)
    (tmp_path / "moe" / "latest_checkpointed_iteration.txt").write_text("3")
    torch.save({}, folder / "model_optim_rng.pt")
    assert convert("--loader", "core", "--load-dir", tmp_path / "moe", "--save-dir", tmp_path / "x") == 2
    assert "expert-parallel" in capsys.readouterr().err
    legacy = tmp_path / "legacy" / "iter_0000003" / "mp_rank_00"
    legacy.mkdir(parents=True)
    (tmp_path / "legacy" / "latest_checkpointed_iteration.txt").write_text("3")
    torch.save({"args": argparse.Namespace(num_layers=2), "model": {"language_model": {}}},
               legacy / "model_optim_rng.pt")
    assert convert("--loader", "megatron", "--load-dir", tmp_path / "legacy", "--save-dir", tmp_path / "y") == 2
    assert "legacy GPT model" in capsys.readouterr().err
