"""Fixtures of the serving tests: a tiny Llama with a word-level Hugging Face tokenizer (and a chat template),
imported with tools/checkpoint_convert.py; a server process on a free loopback port."""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

from tests.data.conftest import REPO, load_tool

transformers = pytest.importorskip("transformers")

WORDS = 88  # w0 .. w87, then the roles, "</s>" (eos), "<s>", "<unk>", "<pad>": 96 ids
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}assistant{% endif %}")
SERVER = os.path.join(REPO, "tools", "run_text_generation_server.py")


def tiny_vocab() -> dict[str, int]:
    specials = ["system", "user", "assistant", "developer", "</s>", "<s>", "<unk>", "<pad>"]
    names = [f"w{i}" for i in range(WORDS)] + specials
    return {name: i for i, name in enumerate(names)}


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory) -> str:
    """A tp-1 checkpoint of a tiny transformers Llama (GQA, untied, vocab 96, 64 positions) whose run records
    its Hugging Face tokenizer folder (word-level, eos '</s>', a chat template)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    base = tmp_path_factory.mktemp("serving")
    torch.manual_seed(3)
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=96,
                                      max_position_embeddings=64, tie_word_embeddings=False, initializer_range=0.3)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(base / "hf")
    words = Tokenizer(models.WordLevel(tiny_vocab(), unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=words, unk_token="<unk>", eos_token="</s>",
                                                     bos_token="<s>")
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(base / "hf")
    status = load_tool("checkpoint_convert").main(["--model-type", "GPT", "--loader", "hf", "--saver", "mcore",
                                                   "--load-dir", str(base / "hf"), "--save-dir", str(base / "ckpt"),
                                                   "--no-progress"])
    assert status == 0
    return str(base / "ckpt")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A running server (a plain process, or torchrun with ``nproc`` ranks) on ``port``."""

    def __init__(self, checkpoint: str, *, nproc: int = 1, flags=(), log_path: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        launcher = [sys.executable] if nproc == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                        "--nproc-per-node", str(nproc)]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        env.pop("TRITON_INTERPRET", None)
        self.log_path = log_path
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen([*launcher, SERVER, "--load", checkpoint, "--port", str(self.port), *flags],
                                     stdout=self.log, stderr=subprocess.STDOUT, env=env, cwd=REPO)

    def wait_ready(self, timeout: float = 120.0) -> None:
        import httpx
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"the server exited with {self.proc.returncode}:\n{self.output()[-4000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
                    return
            time.sleep(0.2)
        raise AssertionError(f"the server did not answer /health within {timeout} s:\n{self.output()[-4000:]}")

    def output(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def terminate(self, pid: int | None = None, timeout: float = 60.0) -> int:
        """SIGTERM to ``pid`` (default the launched process); the launched process's exit status (killed and
        -9 past ``timeout``)."""
        if self.proc.poll() is None:
            os.kill(pid or self.proc.pid, signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.close()
            return -9

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)
        self.log.close()
