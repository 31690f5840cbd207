"""Hostile folders and disk faults while saving: the real pretrain_gpt.py in a subprocess never loses the
previous checkpoint, never writes outside its folder, and ends a failed save with exit 1 and one paragraph
naming the folder and the errno (ENOSPC from a tmpfs and EROFS from a read-only bind mount, each in a private
mount namespace; EFBIG from RLIMIT_FSIZE)."""
import os
import resource
import shlex

import pytest

from tests.integration.hostile import (
    assert_named_failure,
    copy_checkpoint,
    digest,
    loadable,
    make_base_checkpoint,
    namespace_available,
    pointer,
    pretrain_command,
    run_in_namespace,
    run_pretrain,
)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return make_base_checkpoint(str(tmp_path_factory.mktemp("base") / "ckpt"))


def _resume(ckpt, *extra, iters=4):
    return run_pretrain(["--train-iters", str(iters), "--load", ckpt, "--save", ckpt, *extra])


def test_a_stale_incomplete_iteration_folder_is_moved_aside_not_trusted(base, tmp_path):
    ckpt = copy_checkpoint(base, str(tmp_path / "ckpt"))
    stale = os.path.join(ckpt, "iter_0000004")
    os.makedirs(stale)
    open(os.path.join(stale, "model_tp00_pp000.safetensors"), "wb").write(b"half a file")  # no metadata.json
    proc = _resume(ckpt)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "was an incomplete checkpoint" in proc.stdout and "moved it aside" in proc.stdout
    assert pointer(ckpt) == "4" and loadable(ckpt)["iteration"] == 4
    asides = [e for e in os.listdir(ckpt) if e.startswith("iter_0000004.stale-")]
    assert len(asides) == 1 and os.listdir(os.path.join(ckpt, asides[0])) == ["model_tp00_pp000.safetensors"]


def test_a_complete_checkpoint_of_the_same_iteration_is_replaced_by_the_new_save(base, tmp_path):
    """--finetune from iteration 2 saves iteration 2 again: the new weights win, atomically."""
    ckpt = copy_checkpoint(base, str(tmp_path / "ckpt"))
    before = digest(os.path.join(ckpt, "iter_0000002", "model_tp00_pp000.safetensors"))
    proc = run_pretrain(["--train-iters", "2", "--load", ckpt, "--save", ckpt, "--finetune", "--lr", "1e-2"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert digest(os.path.join(ckpt, "iter_0000002", "model_tp00_pp000.safetensors")) != before
    assert loadable(ckpt)["iteration"] == 2
    assert sorted(os.listdir(ckpt)) == ["iter_0000002", "latest_checkpointed_iteration.txt"]


@pytest.mark.parametrize("planted", ["latest_checkpointed_iteration.txt.tmp", "iter_0000004.partial",
                                     "iter_0000004"])
def test_links_planted_in_the_checkpoint_folder_are_never_written_through(base, tmp_path, planted):
    ckpt = copy_checkpoint(base, str(tmp_path / "ckpt"))
    canary = tmp_path / "outside"
    canary.mkdir()
    (canary / "precious.txt").write_text("do not overwrite")
    target = canary / "precious.txt" if planted.endswith(".tmp") else canary
    os.symlink(target, os.path.join(ckpt, planted))
    before = digest(str(canary))
    proc = _resume(ckpt)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert digest(str(canary)) == before
    assert pointer(ckpt) == "4" and loadable(ckpt)["iteration"] == 4


def test_efbig_from_the_file_size_limit_fails_the_save_and_keeps_the_previous_checkpoint(base, tmp_path):
    ckpt = copy_checkpoint(base, str(tmp_path / "ckpt"))
    before = digest(ckpt)

    def limit():  # the shard (~470 KB) exceeds it; the probe, the pointer and metadata.json do not
        resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, 200_000))

    proc = run_pretrain(["--train-iters", "4", "--load", ckpt, "--save", ckpt], preexec_fn=limit)
    assert_named_failure(proc, 1, "EFBIG", os.path.join(ckpt, "iter_0000004.partial"),
                         "the previous checkpoint and latest_checkpointed_iteration.txt are unchanged")
    assert digest(ckpt) == before  # no iter_0000004.partial left, the pointer still at 2


def _namespace_or_skip():
    reason = namespace_available()
    if reason:
        pytest.skip(reason)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_enospc_on_a_full_tmpfs_fails_the_save_and_keeps_the_previous_checkpoint(base, tmp_path, mode):
    """The tmpfs holds the first checkpoint (~0.5 MB) but not a second: the save of iteration 4 runs out of
    space (in the background writer with --async-save)."""
    _namespace_or_skip()
    mnt, after = tmp_path / "mnt", tmp_path / "after"
    mnt.mkdir()
    ckpt = f"{mnt}/ckpt"
    flags = ["--train-iters", "4", "--load", ckpt, "--save", ckpt] + (["--async-save"] if mode == "async" else [])
    script = (f"mount -t tmpfs -o size=800k tmpfs {mnt} && cp -r {shlex.quote(base)} {ckpt} && "
              f"({shlex.join(pretrain_command(flags))}; echo \"status=$?\" >&2); cp -a {ckpt} {after}")
    proc = run_in_namespace(script)
    proc.returncode = int(proc.stderr.rsplit("status=", 1)[1].split()[0])
    assert_named_failure(proc, 1, "ENOSPC", "iter_0000004", "the previous checkpoint and "
                         "latest_checkpointed_iteration.txt are unchanged")
    assert digest(str(after)) == digest(base)


def test_erofs_on_a_read_only_save_folder_fails_before_the_first_iteration(base, tmp_path):
    _namespace_or_skip()
    ckpt = copy_checkpoint(base, str(tmp_path / "ckpt"))
    before = digest(ckpt)
    flags = ["--train-iters", "4", "--load", ckpt, "--save", ckpt, "--log-interval", "1"]
    script = (f"mount --bind {ckpt} {ckpt} && mount -o remount,ro,bind {ckpt} && "
              f"({shlex.join(pretrain_command(flags))}; echo \"status=$?\" >&2)")
    proc = run_in_namespace(script)
    proc.returncode = int(proc.stderr.rsplit("status=", 1)[1].split()[0])
    assert_named_failure(proc, 1, "EROFS", f"could not write checkpoints to --save {ckpt}", "Nothing was trained")
    assert "consumed samples" not in proc.stdout  # no iteration ran
    assert digest(ckpt) == before


def test_a_save_folder_that_cannot_be_created_fails_before_training(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    proc = run_pretrain(["--train-iters", "2", "--save", str(blocker / "ckpt")])
    assert_named_failure(proc, 1, str(blocker / "ckpt"), "ENOTDIR")
