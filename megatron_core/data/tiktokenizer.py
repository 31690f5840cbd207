"""Megatron's ``TikTokenizer``: a tiktoken BPE read from Megatron's JSON vocab, special tokens first.

The vocab file is a JSON list of ``{"rank": i, "token_bytes": base64, "token_str": ...}`` (ranks 0..255 are
the single bytes). The first ``num_special_tokens`` ids are special tokens (``<unk> <s> </s> <mask> <pad>
<cls> <sep>``, then ``<SPECIAL_7>``...), so BPE rank ``r`` is id ``r + num_special_tokens``; eod is ``</s>``
(id 2). Encoding and ids are those of megatron-core 0.16.1's ``TikTokenTokenizer`` (same patterns, special
tokens in text allowed). ``tiktoken`` is imported only when a TikTokenizer is built
(``pip install tiktoken``).
"""
from __future__ import annotations

import base64
import json
import os
from types import MappingProxyType
from typing import List, Optional, Sequence

from megatron_core.data.tokenizers import Tokenizer

PATTERNS = MappingProxyType({
    "v1": r"[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+",
    "v2": r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?"
          r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|"
          r"\s+(?!\S)|\s+",
})
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<mask>", "<pad>", "<cls>", "<sep>")
DEFAULT_VOCAB_SIZE = 2 ** 17


def read_mergeable_ranks(path: str, max_ranks: int, offset: int) -> dict[bytes, int]:
    """``{token bytes: id}`` of the first ``max_ranks`` entries of a Megatron tiktoken JSON vocab, ids
    shifted by ``offset``. Raises ValueError naming the file and entry for a malformed vocab."""
    try:
        with open(path, encoding="utf-8") as handle:
            vocab = json.load(handle)
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"TikTokenizer vocab {path} cannot be read as JSON: {error}") from error
    if not isinstance(vocab, list):
        raise ValueError(f"TikTokenizer vocab {path} must be a JSON list of {{rank, token_bytes, token_str}}")
    ranks = {}
    for i, entry in enumerate(vocab[:max_ranks]):
        if not isinstance(entry, dict) or entry.get("rank") != i or "token_bytes" not in entry:
            raise ValueError(f"TikTokenizer vocab {path}: entry {i} must be {{'rank': {i}, 'token_bytes': ...}}")
        token = base64.b64decode(entry["token_bytes"])
        if i < 256 and token != bytes([i]):
            raise ValueError(f"TikTokenizer vocab {path}: rank {i} must be the single byte {i}")
        ranks[token] = i + offset
    return ranks


class TikTokenizer(Tokenizer):
    """Megatron's ``TikTokenizer`` (``--tokenizer-type TikTokenizer --tokenizer-model vocab.json``).

    Args:
        vocab_file: the JSON vocab.
        pattern: ``"v1"`` or ``"v2"`` (``--tiktoken-pattern``; Megatron's default v2).
        vocab_size: total ids, specials included (``--vocab-size``; default 2**17, as in Megatron); the vocab
            file must hold at least ``vocab_size - num_special_tokens`` entries.
        num_special_tokens: ``--tiktoken-num-special-tokens`` (1000).
    """

    def __init__(self, vocab_file: Optional[str], *, pattern: Optional[str] = None, vocab_size: Optional[int] = None,
                 num_special_tokens: int = 1000) -> None:
        try:
            import tiktoken
        except ImportError as error:
            raise ValueError("--tokenizer-type TikTokenizer needs the tiktoken package: "
                             "pip install tiktoken") from error
        if not vocab_file or not os.path.isfile(vocab_file):
            raise ValueError(f"TikTokenizer vocab {vocab_file!r} does not exist; pass the JSON vocab as "
                             "--tokenizer-model")
        pattern = pattern or "v2"
        if pattern not in PATTERNS:
            raise ValueError(f"--tiktoken-pattern {pattern!r} must be v1 or v2")
        vocab_size = vocab_size or DEFAULT_VOCAB_SIZE
        if not len(SPECIAL_TOKENS) <= num_special_tokens < vocab_size:
            raise ValueError(f"--tiktoken-num-special-tokens {num_special_tokens} must be in [{len(SPECIAL_TOKENS)}, "
                             f"--vocab-size {vocab_size})")
        ranks = read_mergeable_ranks(vocab_file, vocab_size - num_special_tokens, num_special_tokens)
        if len(ranks) != vocab_size - num_special_tokens:
            raise ValueError(f"TikTokenizer vocab {vocab_file} has {len(ranks)} entries but --vocab-size {vocab_size} "
                             f"- {num_special_tokens} special tokens needs {vocab_size - num_special_tokens}; pass "
                             f"--vocab-size {len(ranks) + num_special_tokens}")
        specials = list(SPECIAL_TOKENS) + [f"<SPECIAL_{i}>" for i in range(len(SPECIAL_TOKENS), num_special_tokens)]
        self.vocab_file, self.pattern, self.num_special_tokens = vocab_file, pattern, num_special_tokens
        self.vocab_size = vocab_size
        self.eod = SPECIAL_TOKENS.index("</s>")
        self.bos = SPECIAL_TOKENS.index("<s>")
        self._encoding = tiktoken.Encoding(name=os.path.basename(os.path.dirname(os.path.abspath(vocab_file))),
                                           pat_str=PATTERNS[pattern], mergeable_ranks=ranks,
                                           special_tokens={t: i for i, t in enumerate(specials)})

    def encode(self, text: str) -> List[int]:
        return self._encoding.encode(text, allowed_special="all")

    def decode(self, ids: Sequence[int]) -> str:
        return self._encoding.decode([int(i) for i in ids])

    def describe(self) -> dict:
        return {**super().describe(), "vocab": os.path.abspath(self.vocab_file), "pattern": self.pattern,
                "num_special_tokens": self.num_special_tokens, "mtime_ns": os.stat(self.vocab_file).st_mtime_ns}
