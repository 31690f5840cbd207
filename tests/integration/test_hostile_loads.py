"""Hostile checkpoints given to --load: the real pretrain_gpt.py in a subprocess refuses each with exit 2 and
one paragraph naming the file, key or flag (no traceback, no hang), reads nothing outside the folder, and
leaves the checkpoint byte-identical; a checkpoint of another model or tokenizer is refused unless
--finetune --ignore-mismatched-sizes asks to load what fits."""
import json
import os
import shutil

import pytest

from tests.integration.hostile import (
    assert_named_failure,
    copy_checkpoint,
    digest,
    make_base_checkpoint,
    rewrite_metadata,
    run_pretrain,
)

SHARD = "model_tp00_pp000.safetensors"


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return make_base_checkpoint(str(tmp_path_factory.mktemp("base") / "ckpt"))


@pytest.fixture
def ckpt(base, tmp_path):
    return copy_checkpoint(base, str(tmp_path / "ckpt"))


def _load(ckpt, *extra, iters=4):
    return run_pretrain(["--train-iters", str(iters), "--load", ckpt, *extra])


def _iter2(ckpt):
    return os.path.join(ckpt, "iter_0000002")


def _refused(ckpt, *fragments, extra=()):
    before = digest(ckpt)
    proc = _load(ckpt, *extra)
    assert_named_failure(proc, 2, *fragments)
    assert digest(ckpt) == before
    return proc


def _flip_a_byte(path):
    with open(path, "r+b") as handle:
        handle.seek(os.path.getsize(path) - 8)
        value = handle.read(1)
        handle.seek(-1, os.SEEK_CUR)
        handle.write(bytes([value[0] ^ 0xFF]))


def test_a_file_without_a_checksum_entry_is_refused_unless_allowed(ckpt):
    _flip_a_byte(os.path.join(_iter2(ckpt), SHARD))
    rewrite_metadata(_iter2(ckpt), lambda m: m["checksums"].pop(SHARD))
    _refused(ckpt, SHARD, "has no sha256 in metadata.json", "--allow-missing-checksums")
    proc = _load(ckpt, "--allow-missing-checksums")
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_a_checkpoint_with_more_layers_is_refused_naming_both_values(ckpt):
    _refused(ckpt, "--num-layers: 2 in the checkpoint, 1 in this run", "--finetune --ignore-mismatched-sizes",
             extra=["--num-layers", "1"])


def test_extra_tensors_are_listed_even_when_the_flags_were_not_recorded(ckpt):
    rewrite_metadata(_iter2(ckpt), lambda m: m["config"].pop("num_layers"))
    _refused(ckpt, "in it but not in the model", "decoder.layers.1.", extra=["--num-layers", "1"])


def test_missing_tensors_are_listed(ckpt):
    def drop_layer_1(metadata):
        metadata["config"].pop("num_layers")
        for name in [n for n in metadata["tensors"] if ".layers.1." in n]:
            del metadata["tensors"][name]
    rewrite_metadata(_iter2(ckpt), drop_layer_1)
    _refused(ckpt, "missing from it", "decoder.layers.1.")


def test_another_tokenizer_vocab_is_refused_and_loads_with_ignore_mismatched_sizes(ckpt, tmp_path):
    larger = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "300"]
    _refused(ckpt, "vocab size: 257 in the checkpoint, 301 with this run's tokenizer", "tokenizer type",
             extra=larger)
    finetuned = str(tmp_path / "finetuned")
    proc = _load(ckpt, *larger, "--finetune", "--ignore-mismatched-sizes", "--save", finetuned, "--lr", "0",
                 "--min-lr", "0", iters=1)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "--ignore-mismatched-sizes:" in proc.stdout and "embedding.word_embeddings.weight" in proc.stdout
    from safetensors.torch import load_file
    old = load_file(os.path.join(_iter2(ckpt), SHARD))["embedding.word_embeddings.weight"]
    new = load_file(os.path.join(finetuned, "iter_0000001", SHARD))["embedding.word_embeddings.weight"]
    assert (new[:257] == old[:257]).all()  # lr 0: the shared rows are the checkpoint's
    assert new[257:301].abs().sum() > 0  # the new ids keep their initialization, not zero rows
    smaller = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "99"]
    _refused(ckpt, "vocab size: 257 in the checkpoint, 100 with this run's tokenizer", extra=smaller)


def test_ignore_mismatched_sizes_needs_finetune(ckpt):
    proc = _load(ckpt, "--ignore-mismatched-sizes")
    assert_named_failure(proc, 2, "--ignore-mismatched-sizes", "needs --finetune")


@pytest.mark.parametrize("case,edit,fragment", [
    ("shards a list", lambda m: m["tensors"]["embedding.word_embeddings.weight"].update(shards=[]),
     "tensors['embedding.word_embeddings.weight']['shards'] must be an object, got list"),
    ("consumed_samples missing", lambda m: m.pop("consumed_samples"), "the key 'consumed_samples' is missing"),
    ("negative iteration", lambda m: m.update(iteration=-3), "'iteration' must be an integer >= 0"),
    ("checksum not hex", lambda m: m["checksums"].update({SHARD: "x"}), f"'checksums'['{SHARD}'] must be a sha256"),
    ("a list at the top", None, "is not a megatron_core checkpoint"),
])
def test_metadata_of_the_wrong_structure_is_named_by_key(ckpt, case, edit, fragment):
    if edit is None:
        with open(os.path.join(_iter2(ckpt), "metadata.json"), "w") as handle:
            json.dump([1, 2], handle)
    else:
        rewrite_metadata(_iter2(ckpt), edit)
    _refused(ckpt, "metadata.json", fragment)


@pytest.mark.parametrize("content", ["\u00b2", "iteration two", "\x00\xff"])
def test_a_pointer_file_without_digits_is_named(ckpt, content):
    with open(os.path.join(ckpt, "latest_checkpointed_iteration.txt"), "w", encoding="utf-8") as handle:
        handle.write(content)
    _refused(ckpt, "latest_checkpointed_iteration.txt does not hold an iteration number", "iter_0000002")


def test_a_fifo_pointer_file_is_refused_without_hanging(ckpt):
    os.remove(os.path.join(ckpt, "latest_checkpointed_iteration.txt"))
    os.mkfifo(os.path.join(ckpt, "latest_checkpointed_iteration.txt"))
    _refused(ckpt, "latest_checkpointed_iteration.txt is not a regular file (a FIFO)")


def test_a_shard_linked_to_dev_zero_is_refused_without_hanging(ckpt):
    os.remove(os.path.join(_iter2(ckpt), SHARD))
    os.symlink("/dev/zero", os.path.join(_iter2(ckpt), SHARD))
    _refused(ckpt, SHARD, "outside the checkpoint folder")


def test_a_shard_linked_outside_the_folder_is_refused_even_with_the_right_checksum(ckpt, tmp_path):
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    shutil.move(os.path.join(_iter2(ckpt), SHARD), outside / SHARD)
    os.symlink(outside / SHARD, os.path.join(_iter2(ckpt), SHARD))
    _refused(ckpt, SHARD, "is a symlink to", "outside the checkpoint folder")


def test_an_iteration_folder_linked_outside_the_load_folder_is_refused(ckpt, tmp_path):
    outside = tmp_path / "elsewhere"
    shutil.move(_iter2(ckpt), outside)
    os.symlink(outside, _iter2(ckpt))
    _refused(ckpt, "iter_0000002 is a symlink to", "outside")


def test_a_shard_of_another_length_than_recorded_is_named(ckpt):
    with open(os.path.join(_iter2(ckpt), SHARD), "ab") as handle:
        handle.write(b"\0" * 16)
    _refused(ckpt, SHARD, "is corrupt: it is", "bytes long, not the", "that metadata.json records")


def test_a_damaged_safetensors_header_with_a_matching_checksum_is_named(ckpt):
    from megatron_core.checkpointing.shard_reader import file_digests
    path = os.path.join(_iter2(ckpt), SHARD)
    with open(path, "r+b") as handle:
        handle.seek(8)
        handle.write(b"{broken json")
    digests = {k: {f: v for f, v in values.items() if f != "metadata.json"}
               for k, values in file_digests(_iter2(ckpt)).items()}
    rewrite_metadata(_iter2(ckpt), lambda m: m.update({k: {**m[k], **v} for k, v in digests.items()}))
    _refused(ckpt, SHARD, "is not a readable safetensors file")


def test_debug_shows_the_traceback_of_a_handled_error(ckpt):
    proc = _load(ckpt, "--num-layers", "1", "--debug")
    assert proc.returncode == 2 and "Traceback" in proc.stderr and "pretrain_gpt.py: error:" in proc.stderr
