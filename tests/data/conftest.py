"""Fixtures for the data tests: a tiny text corpus, a sentencepiece model trained on it, tool loaders."""
import importlib.util
import os

import numpy as np
import pytest

from megatron_core.data import IndexedDatasetBuilder

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CORPUS = [
    "The quick brown fox jumps over the lazy dog.\nIt was the best of times, it was the worst of times.",
    "def add(a, b):\n    return a + b\n\n\tprint(add(1, 2))  # tabs, spaces   and newlines\n",
    "Données: naïve café — 日本語のテキスト, emoji 🙂 and numbers 12345.",
    "Megatron splits the model across tensor, pipeline and data parallel ranks.",
] * 20


def load_tool(name: str):
    """Imports ``tools/{name}.py`` as a module (tools/ is not a package)."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(REPO, "tools", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def spm_model(tmp_path_factory) -> str:
    """A lossless BPE sentencepiece model (vocab 400) trained on CORPUS."""
    folder = tmp_path_factory.mktemp("spm")
    corpus = folder / "corpus.txt"
    corpus.write_text("\n".join(CORPUS), encoding="utf-8")
    return load_tool("train_tokenizer").train([str(corpus)], str(folder / "spm"), vocab_size=400, num_threads=1)


def write_dataset(prefix: str, documents, dtype=np.uint16) -> str:
    """Writes ``documents`` (lists of ids) as a Megatron dataset at ``prefix``; returns the prefix."""
    with IndexedDatasetBuilder(prefix, dtype) as builder:
        for doc in documents:
            builder.add_document(doc)
    return prefix


def random_documents(num_documents: int, seed: int = 0, vocab: int = 1000, max_len: int = 40):
    """Documents of random lengths whose tokens are globally unique while below ``vocab`` wraps."""
    rng = np.random.RandomState(seed)
    docs, next_id = [], 0
    for _ in range(num_documents):
        n = int(rng.randint(1, max_len))
        docs.append([(next_id + j) % vocab for j in range(n)])
        next_id += n
    return docs
