"""--async-save: the files are written by a background thread while training continues, and the checkpoints
are bit-identical to those of a synchronous save (every shard, RNG file and metadata.json but the --save path
it records); the pointer file names the last one; every file is fsynced before the folder is published."""
import json
import os

from tests.recipe import RECIPE

KEEP = [*RECIPE, "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
        "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "6", "--lr", "1e-3",
        "--min-lr", "1e-4", "--lr-warmup-iters", "1", "--eval-interval", "100000", "--log-interval", "100000",
        "--seed", "3", "--save-interval", "2", "--zero-stage", "1"]


def _train(argv):
    from megatron_core.training.arguments import parse_args
    from megatron_core.training.loop import pretrain
    return pretrain(parse_args(list(argv)))


def _files(directory):
    found = {}
    for root, _, files in os.walk(directory):
        for name in files:
            path = os.path.join(root, name)
            data = open(path, "rb").read()
            if name == "metadata.json":
                metadata = json.loads(data)
                metadata["config"].pop("save")
                data = json.dumps(metadata, sort_keys=True).encode()
            found[os.path.relpath(path, directory)] = data
    return found


def test_async_save_writes_the_same_files_as_sync_save(distributed, tmp_path):
    sync, asynchronous = tmp_path / "sync", tmp_path / "async"
    distributed(2, _train, [*KEEP, "--save", str(sync)])
    distributed(2, _train, [*KEEP, "--save", str(asynchronous), "--async-save"])
    want, got = _files(sync), _files(asynchronous)
    assert sorted(got) == sorted(want)
    assert {name for name in got if name.startswith("iter_")} == {
        f"iter_000000{i}/{f}" for i in (2, 4, 6) for f in ("metadata.json", "model_tp00_pp000.safetensors",
                                                          "rng_rank00000.safetensors", "rng_rank00001.safetensors")}
    assert got["latest_checkpointed_iteration.txt"] == b"6"
    for name in want:
        assert got[name] == want[name], name


def test_every_file_and_folder_is_fsynced_before_the_pointer_moves(tmp_path, monkeypatch):
    """The order of fsyncs, renames and writes of one save (single process)."""
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def plain(path):  # temporary files have random names: ".NAME.<random>.tmp" -> "NAME.tmp"
        name = os.path.basename(path)
        return name[1:].rsplit(".", 2)[0] + ".tmp" if name.startswith(".") and name.endswith(".tmp") else name

    def fsync(fd):
        events.append(("fsync", plain(os.readlink(f"/proc/self/fd/{fd}"))))
        real_fsync(fd)

    def replace(src, dst):
        events.append(("rename", plain(src), plain(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    from megatron_core import destroy_model_parallel
    from megatron_core.training.arguments import parse_args
    from megatron_core.training.loop import build_run, save
    os.environ.update(MASTER_PORT=str(_free_port()))
    run = build_run(parse_args([*KEEP, "--save", str(tmp_path), "--train-iters", "1"]))
    try:
        events.clear()
        save(run, 1)
    finally:
        destroy_model_parallel(run.state)
        import torch.distributed as dist
        dist.destroy_process_group()
    names = [e[1] for e in events]
    published = events.index(("rename", "iter_0000001.partial", "iter_0000001"))
    for shard in ("model_tp00_pp000.safetensors", "rng_rank00000.safetensors", "metadata.json.tmp",
                  "iter_0000001.partial"):
        assert names.index(shard) < published, (shard, events)
    pointer = events.index(("rename", "latest_checkpointed_iteration.txt.tmp", "latest_checkpointed_iteration.txt"))
    assert published < names.index(os.path.basename(str(tmp_path)), published) < pointer, events  # parent fsync


def _free_port():
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
