"""Hostile foreign checkpoints given to the real tools (run as subprocesses): a Megatron-LM ``torch_dist``
``.metadata`` whose storage entries leave the folder or name a FIFO, a device or bytes past a file's end, a
shard symlinked to ``/dev/zero``, a ``.pt`` / ``pytorch_model.bin`` whose pickle would run ``os.system``, a
damaged safetensors header, a config.json of the wrong structure. Each is refused before anything is read:
exit 2, one ``<tool>: error:`` paragraph naming the file (and the entry), no traceback (unless ``--debug``),
nothing read outside the checkpoint, no code run, no hang."""
import dataclasses
import json
import os
import pickle
import shutil
import subprocess

import pytest
import torch
from safetensors.torch import save_file

from megatron_core.checkpointing import megatron_lm_io
from tests.data.conftest import load_tool
from tests.fork_server import run_python

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ITER = "iter_0000000"
PROG = "checkpoint_convert.py: error:"


class _System:
    """Unpickling this runs ``os.system(command)``: the code a hostile checkpoint would run."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


def _hf_gpt2(folder, *, layers=1, hidden=8, heads=2, vocab=16, positions=8) -> None:
    """A tiny Hugging Face GPT-2 folder (config.json + model.safetensors), random weights."""
    os.makedirs(folder)
    shapes = {"transformer.wte.weight": (vocab, hidden), "transformer.wpe.weight": (positions, hidden),
              "transformer.ln_f.weight": (hidden,), "transformer.ln_f.bias": (hidden,)}
    for i in range(layers):
        for name, shape in (("ln_1.weight", (hidden,)), ("ln_1.bias", (hidden,)),
                            ("attn.c_attn.weight", (hidden, 3 * hidden)), ("attn.c_attn.bias", (3 * hidden,)),
                            ("attn.c_proj.weight", (hidden, hidden)), ("attn.c_proj.bias", (hidden,)),
                            ("ln_2.weight", (hidden,)), ("ln_2.bias", (hidden,)),
                            ("mlp.c_fc.weight", (hidden, 4 * hidden)), ("mlp.c_fc.bias", (4 * hidden,)),
                            ("mlp.c_proj.weight", (4 * hidden, hidden)), ("mlp.c_proj.bias", (hidden,))):
            shapes[f"transformer.h.{i}.{name}"] = shape
    generator = torch.Generator().manual_seed(0)
    save_file({name: torch.randn(shape, generator=generator) for name, shape in shapes.items()},
              os.path.join(folder, "model.safetensors"))
    config = {"model_type": "gpt2", "n_layer": layers, "n_embd": hidden, "n_head": heads, "vocab_size": vocab,
              "n_positions": positions}
    with open(os.path.join(folder, "config.json"), "w", encoding="utf-8") as handle:
        json.dump(config, handle)


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """Sound checkpoints the tests copy and damage: {"hf", "torch_dist", "torch"} -> folder."""
    base = tmp_path_factory.mktemp("sources")
    _hf_gpt2(str(base / "hf"))
    tool = load_tool("checkpoint_convert")
    for fmt in ("torch_dist", "torch"):
        assert tool.main(["--model-type", "GPT", "--loader", "hf", "--saver", "core", "--ckpt-format", fmt,
                          "--load-dir", str(base / "hf"), "--save-dir", str(base / fmt), "--no-progress"]) == 0
    return {name: base / name for name in ("hf", "torch_dist", "torch")}


def _copy(sources, name: str, tmp_path):
    target = tmp_path / name
    shutil.copytree(sources[name], target)
    return target


def convert(loader: str, load_dir, save_dir, *extra: str, timeout: int = 60) -> subprocess.CompletedProcess:
    """tools/checkpoint_convert.py --saver mcore in its own process (cwd: the repository root; forked from a
    server that imported torch: ``tests.fork_server``)."""
    command = ["tools/checkpoint_convert.py", "--model-type", "GPT", "--loader", loader, "--saver", "mcore",
               "--load-dir", str(load_dir), "--save-dir", str(save_dir), "--no-progress", *extra]
    return run_python(command, cwd=ROOT, timeout=timeout)


def assert_refused(result: subprocess.CompletedProcess, *named: str) -> None:
    """Exit 2, one ``checkpoint_convert.py: error:`` paragraph naming each of ``named``, no traceback."""
    err = result.stderr
    assert result.returncode == 2, (result.returncode, err[-3000:])
    assert "Traceback" not in err and PROG in err, err[-3000:]
    message = err[err.index(PROG):]
    assert len(message.strip().splitlines()) == 1, message
    for name in named:
        assert str(name) in message, (name, message)


def _rewrite_storage(folder, relative_path: str, **fields) -> None:
    """Points every storage entry of ``folder/.metadata`` at ``relative_path`` (and sets ``fields``)."""
    metadata = megatron_lm_io.read_dcp_metadata(str(folder))
    metadata.storage_data = {index: dataclasses.replace(info, relative_path=relative_path, **fields)
                             for index, info in metadata.storage_data.items()}
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))


def test_storage_entries_leaving_the_folder_are_refused(sources, tmp_path):
    """``../../canary/__0_0.distcp``: the real file, moved outside the checkpoint, must not be converted."""
    checkpoint = _copy(sources, "torch_dist", tmp_path)
    folder = checkpoint / ITER
    canary = tmp_path / "canary"
    canary.mkdir()
    _rewrite_storage(folder, "../../canary/__0_0.distcp")
    shutil.move(folder / "__0_0.distcp", canary / "__0_0.distcp")
    result = convert("core", checkpoint, tmp_path / "out")
    assert_refused(result, folder, "../../canary/__0_0.distcp", "outside")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("case", ["symlink out", "fifo", "past the end", "zeroed", "huge tensor"])
def test_storage_entries_of_no_plain_file_are_refused(sources, tmp_path, case):
    """An entry's file symlinked outside the folder, a FIFO (no hang), ``offset + length`` past its end, bytes
    torch cannot load, or a tensor larger than the bytes its entries hold (no huge allocation)."""
    checkpoint = _copy(sources, "torch_dist", tmp_path)
    folder = checkpoint / ITER
    shard = folder / "__0_0.distcp"
    named = [folder, "__0_0.distcp"]
    if case == "symlink out":
        outside = tmp_path / "elsewhere.distcp"
        shutil.move(shard, outside)
        os.symlink(outside, shard)
        expected = "outside"
    elif case == "fifo":
        shard.unlink()
        os.mkfifo(shard)
        expected = "FIFO"
    elif case == "past the end":
        size = shard.stat().st_size
        with open(shard, "r+b") as handle:
            handle.truncate(size // 2)
        expected = f"{size // 2} bytes"
    elif case == "zeroed":
        shard.write_bytes(bytes(shard.stat().st_size))
        named, expected = [folder], "cannot be read from its files"
    else:
        metadata = megatron_lm_io.read_dcp_metadata(str(folder))
        key = "decoder.final_layernorm.weight"
        metadata.state_dict_metadata[key] = dataclasses.replace(metadata.state_dict_metadata[key],
                                                                size=torch.Size([10**12]))
        (folder / ".metadata").write_bytes(pickle.dumps(metadata))
        named, expected = [folder, key], "4000000000000 bytes"
    result = convert("core", checkpoint, tmp_path / "out")
    assert_refused(result, *named, expected)


def test_a_shard_symlinked_to_dev_zero_is_refused_quickly(sources, tmp_path):
    checkpoint = _copy(sources, "torch", tmp_path)
    shard = checkpoint / ITER / "mp_rank_00" / "model_optim_rng.pt"
    shard.unlink()
    os.symlink("/dev/zero", shard)
    result = convert("core", checkpoint, tmp_path / "out", timeout=60)
    assert_refused(result, shard, "character device")


def test_a_pt_whose_pickle_runs_code_is_refused(sources, tmp_path):
    checkpoint = _copy(sources, "torch", tmp_path)
    shard = checkpoint / ITER / "mp_rank_00" / "model_optim_rng.pt"
    marker = tmp_path / "pwned"
    torch.save({"args": _System(f"touch {marker}"), "model": {}}, shard)
    result = convert("core", checkpoint, tmp_path / "out")
    assert_refused(result, shard, "is not a loadable PyTorch checkpoint", "weights_only=True")
    assert not marker.exists()


def test_an_hf_pytorch_model_bin_whose_pickle_runs_code_is_refused(sources, tmp_path):
    folder = _copy(sources, "hf", tmp_path)
    os.remove(folder / "model.safetensors")
    marker = tmp_path / "pwned"
    torch.save({"transformer.wte.weight": torch.zeros(16, 8), "x": _System(f"touch {marker}")},
               folder / "pytorch_model.bin")
    result = convert("hf", folder, tmp_path / "out")
    assert_refused(result, folder / "pytorch_model.bin", "is not a loadable PyTorch checkpoint")
    assert not marker.exists()


def _damage_safetensors_header(path) -> None:
    data = bytearray(path.read_bytes())
    data[8:24] = b"\xff" * 16  # the JSON header's first bytes
    path.write_bytes(bytes(data))


def test_a_damaged_safetensors_header_is_refused(sources, tmp_path):
    folder = _copy(sources, "hf", tmp_path)
    _damage_safetensors_header(folder / "model.safetensors")
    assert_refused(convert("hf", folder, tmp_path / "out"), folder / "model.safetensors")


@pytest.mark.parametrize("config,named", [([1, 2], "not a JSON object"), ({"model_type": "gpt2"}, "n_layer"),
                                          ("{not json", "not valid JSON")])
def test_an_hf_config_of_the_wrong_structure_is_refused(sources, tmp_path, config, named):
    folder = _copy(sources, "hf", tmp_path)
    (folder / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    assert_refused(convert("hf", folder, tmp_path / "out"), folder / "config.json", named)


def test_debug_shows_the_traceback_of_a_handled_error(sources, tmp_path):
    folder = _copy(sources, "hf", tmp_path)
    _damage_safetensors_header(folder / "model.safetensors")
    result = convert("hf", folder, tmp_path / "out", "--debug")
    assert result.returncode == 2 and "Traceback" in result.stderr, result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1].startswith(PROG)


def test_every_tool_has_debug_and_one_error_path(tmp_path, capsys):
    """The other tools, in this process: bad input (a directory given as an input file, a folder holding no
    checkpoint, sizes that do not divide) is one ``<tool>: error:`` paragraph and status 2; ``--debug`` adds the
    traceback."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    cases = {"preprocess_data": ["--input", str(corpus), "--output-prefix", str(tmp_path / "out"),
                                 "--tokenizer-type", "ByteTokenizer", "--no-progress"],
             "train_tokenizer": ["--input", str(corpus), "--model-prefix", str(tmp_path / "spm"), "--vocab-size",
                                 "300", "--no-progress"],
             "generate": ["--load", str(corpus), "--prompt-ids", "1", "--max-new-tokens", "1"],
             "plan_parallelism": ["--num-devices", "3", "--num-layers", "2", "--hidden-size", "30",
                                  "--num-attention-heads", "4"]}
    for name, argv in cases.items():
        tool = load_tool(name)
        assert tool.main(argv) == 2, name
        err = capsys.readouterr().err
        assert f"{name}.py: error:" in err and "Traceback" not in err, (name, err)
        assert tool.main([*argv, "--debug"]) == 2, name
        err = capsys.readouterr().err
        assert "Traceback" in err and f"{name}.py: error:" in err, (name, err)
