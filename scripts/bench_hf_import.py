"""Import of a 1B-parameter-class Hugging Face folder: ``tools/checkpoint_convert.py --loader hf`` against
transformers' ``from_pretrained`` followed by our save of the same weights, side by side in one run.

    python scripts/bench_hf_import.py                     # Llama 1.2B (hidden 2048, 16 layers), bf16, 5 rounds
    python scripts/bench_hf_import.py --layers 2 --rounds 3   # a quick look

The folder is made once with transformers from a config (random weights, sharded like the hub, cached under
``--work``). Each round runs both, alternating which goes first, each in a fresh process, and records its wall
time and peak RSS (``wait4``'s ``ru_maxrss``; this process imports nothing heavy, since a child's maximum
counts the parent's pages it was forked with). Printed: every round, the medians with their range, the ratio of
the wall times (ours / peer) and our peak RSS against the target ``1.3 x largest tensor + 300 MB``, with the
RSS of a process that only imports torch, transformers and megatron_core for scale.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PEER = """
import sys, torch, transformers
sys.path.insert(0, {repo!r})
from megatron_core.checkpointing.durable import save_file_durably
model = transformers.AutoModelForCausalLM.from_pretrained({folder!r}, dtype=torch.bfloat16)
save_file_durably({{k: v.contiguous() for k, v in model.state_dict().items()}}, {out!r} + "/model.safetensors")
"""
IMPORTS_ONLY = """
import sys, torch, transformers
sys.path.insert(0, {repo!r})
import megatron_core.models.hf, megatron_core.checkpointing
"""


def make_folder(args: argparse.Namespace) -> str:
    """The cached transformers Llama folder of this shape (made once)."""
    import torch
    import transformers
    name = f"llama_h{args.hidden}_l{args.layers}_f{args.ffn}_v{args.vocab}"
    folder = os.path.join(args.work, name)
    if os.path.exists(os.path.join(folder, "config.json")):
        return folder
    config = transformers.LlamaConfig(hidden_size=args.hidden, intermediate_size=args.ffn,
                                      num_hidden_layers=args.layers, num_attention_heads=args.heads,
                                      num_key_value_heads=args.kv_heads, vocab_size=args.vocab,
                                      max_position_embeddings=4096, tie_word_embeddings=False)
    start = time.perf_counter()
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model = model.to_empty(device="cpu")
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.02, generator=generator)
    model.save_pretrained(folder + ".partial", max_shard_size=args.shard_size)
    os.replace(folder + ".partial", folder)
    params = sum(p.numel() for p in model.parameters())
    print(f"made {folder}: {params / 1e9:.2f}B parameters in {time.perf_counter() - start:.0f} s", flush=True)
    return folder


def largest_tensor_bytes(folder: str) -> int:
    """From the safetensors headers (8-byte length, then JSON with each tensor's byte range)."""
    best = 0
    for file in sorted(f for f in os.listdir(folder) if f.endswith(".safetensors")):
        with open(os.path.join(folder, file), "rb") as handle:
            header = json.loads(handle.read(int.from_bytes(handle.read(8), "little")))
        best = max([best] + [end - start for key, entry in header.items() if key != "__metadata__"
                             for start, end in [entry["data_offsets"]]])
    return best


def timed(command: list[str]) -> tuple[float, int]:
    """(wall seconds, peak RSS bytes) of one child process."""
    start = time.perf_counter()
    process = subprocess.Popen(command, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "2"},
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(process.pid, 0)
    wall = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{command[:4]} failed: {process.stderr.read().decode()[-2000:]}")
    return wall, usage.ru_maxrss * 1024


def run_ours(folder: str, out: str) -> tuple[float, int]:
    return timed([sys.executable, os.path.join(REPO, "tools", "checkpoint_convert.py"), "--model-type", "GPT",
                  "--loader", "hf", "--saver", "mcore", "--load-dir", folder, "--save-dir", out, "--no-progress"])


def run_peer(folder: str, out: str) -> tuple[float, int]:
    os.makedirs(out, exist_ok=True)
    return timed([sys.executable, "-c", PEER.format(repo=REPO, folder=folder, out=out)])


def summary(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} [{min(values):.2f}, {max(values):.2f}]"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--ffn", type=int, default=8192)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--shard-size", default="1GB")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--work", default="/tmp/bench_hf_import")
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument("--make-only", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    os.makedirs(args.work, exist_ok=True)
    if args.make_only:
        print(make_folder(args))
        return
    made = subprocess.run([sys.executable, *sys.argv, "--make-only"], check=True, capture_output=True, text=True)
    folder = made.stdout.strip().splitlines()[-1]
    largest = largest_tensor_bytes(folder)
    _, baseline_rss = timed([sys.executable, "-c", IMPORTS_ONLY.format(repo=REPO)])
    rows = {"ours": [], "peer": []}
    for round_ in range(args.rounds):
        order = ("ours", "peer") if round_ % 2 == 0 else ("peer", "ours")
        for who in order:
            out = os.path.join(args.work, f"out_{who}")
            shutil.rmtree(out, ignore_errors=True)
            wall, rss = (run_ours if who == "ours" else run_peer)(folder, out)
            shutil.rmtree(out, ignore_errors=True)
            rows[who].append((wall, rss))
            print(f"round {round_ + 1} {who:4s}: {wall:7.2f} s, peak RSS {rss / 2**20:7.0f} MiB", flush=True)
    ratios = [o[0] / p_[0] for o, p_ in zip(rows["ours"], rows["peer"])]
    target = 1.3 * largest + 300 * 2**20
    ours_rss = max(r for _, r in rows["ours"])
    result = {
        "folder": folder, "largest_tensor_MiB": largest / 2**20, "imports_only_rss_MiB": baseline_rss / 2**20,
        "ours_wall_s": summary([w for w, _ in rows["ours"]]), "peer_wall_s": summary([w for w, _ in rows["peer"]]),
        "wall_ratio_ours_over_peer": summary(ratios),
        "ours_peak_rss_MiB": ours_rss / 2**20, "peer_peak_rss_MiB": max(r for _, r in rows["peer"]) / 2**20,
        "rss_target_MiB": target / 2**20, "rss_within_target": ours_rss <= target,
    }
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(result, handle, indent=1)


if __name__ == "__main__":
    main()
