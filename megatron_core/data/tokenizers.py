"""Tokenizers with Megatron's type names, built by ``build_tokenizer``.

Every tokenizer has ``vocab_size``, ``eod`` (the end-of-document id that ``--append-eod`` adds),
``encode(text) -> list[int]`` and ``decode(ids) -> str``. ``tokenize``/``detokenize`` are Megatron's
names for the same two methods, kept so code ported from Megatron-LM runs unchanged.

==========================  =======================================================================
type name                   what it needs
==========================  =======================================================================
``SentencePieceTokenizer``  ``tokenizer_model``: a sentencepiece ``.model`` (``tools/train_tokenizer.py``)
``GPT2BPETokenizer``        ``vocab_file`` (vocab.json) and ``merge_file`` (merges.txt), via HF ``tokenizers``
``NullTokenizer``           ``vocab_size``; text is space-separated integers, eod = vocab_size
``ByteTokenizer``           nothing: UTF-8 bytes are ids 0..255, eod = 256, vocab 257
``GPTSentencePieceTokenizer`` ``tokenizer_model``: sentencepiece ``.model``; Megatron's name, no extra tokens
``Llama2Tokenizer``         ``tokenizer_model``: Llama-2's sentencepiece ``.model``; bos before each text
``HuggingFaceTokenizer``    ``tokenizer_model``: a local folder (or hub name already cached) for
                            ``transformers.AutoTokenizer``; special tokens added as the tokenizer does
==========================  =======================================================================
"""
import json
import logging
import os
from typing import List, Optional, Sequence

logger = logging.getLogger(__name__)

TOKENIZER_TYPES = ("SentencePieceTokenizer", "GPT2BPETokenizer", "NullTokenizer", "ByteTokenizer",
                   "GPTSentencePieceTokenizer", "Llama2Tokenizer", "HuggingFaceTokenizer", "TikTokenizer")


class Tokenizer:
    """Base class: subclasses set ``vocab_size`` and ``eod`` and implement ``encode``/``decode``."""

    vocab_size: int
    eod: int

    def encode(self, text: str) -> List[int]:
        """Token ids of ``text``."""
        raise NotImplementedError

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``."""
        raise NotImplementedError

    def tokenize(self, text: str) -> List[int]:
        """Megatron's name for ``encode``."""
        return self.encode(text)

    def detokenize(self, ids: Sequence[int]) -> str:
        """Megatron's name for ``decode``."""
        return self.decode(ids)

    def describe(self) -> dict:
        """JSON-able identity of the tokenizer, used in cache keys."""
        return {"type": type(self).__name__, "vocab_size": self.vocab_size, "eod": self.eod}


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as ids 0..255 and eod = 256 (vocab 257): lossless and needs no file."""

    vocab_size = 257
    eod = 256

    def encode(self, text: str) -> List[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


class NullTokenizer(Tokenizer):
    """Megatron's null tokenizer for tests: text is space-separated integer ids.

    Args:
        vocab_size: ids below this are ordinary tokens; ``eod`` is ``vocab_size`` itself, so the
            reported ``vocab_size`` is ``vocab_size + 1`` (as in Megatron-LM).
    """

    def __init__(self, vocab_size: int) -> None:
        if vocab_size is None or int(vocab_size) <= 0:
            raise ValueError(f"NullTokenizer needs a positive vocab_size, got {vocab_size}; pass --vocab-size")
        self._vocab_size_without_eod = int(vocab_size)
        self.eod = self._vocab_size_without_eod
        self.vocab_size = self._vocab_size_without_eod + 1

    def encode(self, text: str) -> List[int]:
        try:
            return [int(x) for x in text.split()]
        except ValueError as err:
            raise ValueError(f"NullTokenizer reads space-separated integers, got {text[:50]!r}") from err

    def decode(self, ids: Sequence[int]) -> str:
        return " ".join(str(int(i)) for i in ids)


class SentencePieceTokenizer(Tokenizer):
    """A sentencepiece model; ``eod`` is the model's ``</s>`` (eos) id, as in Megatron's GPT tokenizer.

    Args:
        model_file: path of the ``.model`` file.
    """

    def __init__(self, model_file: str) -> None:
        import sentencepiece

        if not model_file or not os.path.isfile(model_file):
            raise ValueError(f"sentencepiece model file {model_file!r} does not exist; train one with "
                             "tools/train_tokenizer.py and pass it as --tokenizer-model")
        self.model_file = model_file
        self._sp = sentencepiece.SentencePieceProcessor(model_file=model_file)
        self.vocab_size = int(self._sp.vocab_size())
        eos = int(self._sp.eos_id())
        if eos < 0:
            raise ValueError(f"{model_file} has no eos piece to use as eod; train it with eos_id >= 0")
        self.eod = eos

    def encode(self, text: str) -> List[int]:
        return list(self._sp.encode(text))

    def decode(self, ids: Sequence[int]) -> str:
        return self._sp.decode([int(i) for i in ids])

    def describe(self) -> dict:
        return {**super().describe(), "model": os.path.abspath(self.model_file),
                "mtime_ns": os.stat(self.model_file).st_mtime_ns}


class Llama2Tokenizer(SentencePieceTokenizer):
    """Megatron's ``Llama2Tokenizer``: a sentencepiece model whose encoding starts with bos (as Llama-2 was
    trained); eod is eos."""

    def __init__(self, model_file: str) -> None:
        super().__init__(model_file)
        self.bos = int(self._sp.bos_id())
        if self.bos < 0:
            raise ValueError(f"{model_file} has no bos piece, which Llama2Tokenizer puts before each text; use "
                             "GPTSentencePieceTokenizer")

    def encode(self, text: str) -> List[int]:
        return [self.bos, *self._sp.encode(text)]

    def decode(self, ids: Sequence[int]) -> str:
        return self._sp.decode([int(i) for i in ids if int(i) != self.bos])


class HuggingFaceTokenizer(Tokenizer):
    """Megatron's ``HuggingFaceTokenizer``: ``transformers.AutoTokenizer.from_pretrained(tokenizer_model)``
    from a local folder (nothing is downloaded: ``local_files_only``). Encoding adds the tokenizer's own
    special tokens (e.g. a bos), as Megatron's does; eod is the eos token; the vocabulary is ``len(tokenizer)``.

    Args:
        path: a folder with ``tokenizer.json`` / ``tokenizer_config.json`` (``save_pretrained``), or the name of
            a model in the local Hugging Face cache.
    """

    def __init__(self, path: str) -> None:
        try:
            from transformers import AutoTokenizer
        except ImportError as err:
            raise ValueError("HuggingFaceTokenizer needs the transformers package: pip install transformers") from err
        if not path:
            raise ValueError("HuggingFaceTokenizer needs --tokenizer-model FOLDER (a saved Hugging Face tokenizer)")
        try:
            self._tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError) as err:
            raise ValueError(f"HuggingFaceTokenizer could not load {path!r} from local files ({err}); pass a "
                             "folder written by save_pretrained, or download the tokenizer first") from err
        self.path = path
        if self._tok.eos_token_id is None:
            raise ValueError(f"the Hugging Face tokenizer {path!r} has no eos token to use as eod")
        self.eod = int(self._tok.eos_token_id)
        self.vocab_size = len(self._tok)

    def encode(self, text: str) -> List[int]:
        return list(self._tok(text).input_ids)

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids])

    def describe(self) -> dict:
        return {**super().describe(), "path": os.path.abspath(self.path) if os.path.isdir(self.path) else self.path}


class GPT2BPETokenizer(Tokenizer):
    """GPT-2 byte-level BPE from ``vocab.json`` + ``merges.txt``, run by Hugging Face ``tokenizers``.

    The pre-tokenizer is GPT-2's regex with byte-level mapping and no prefix space, so ids match the
    original GPT-2 encoder. ``eod`` is the id of ``<|endoftext|>``.

    Args:
        vocab_file: path of vocab.json.
        merge_file: path of merges.txt.
    """

    def __init__(self, vocab_file: str, merge_file: str) -> None:
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers import decoders, models, pre_tokenizers

        for name, path in (("vocab_file", vocab_file), ("merge_file", merge_file)):
            if not path or not os.path.isfile(path):
                raise ValueError(f"GPT2BPETokenizer {name} {path!r} does not exist; pass --vocab-file "
                                 "vocab.json and --merge-file merges.txt")
        self.vocab_file, self.merge_file = vocab_file, merge_file
        self._tok = HFTokenizer(models.BPE.from_file(vocab_file, merge_file))
        self._tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        self._tok.decoder = decoders.ByteLevel()
        with open(vocab_file, encoding="utf-8") as f:
            vocab = json.load(f)
        if "<|endoftext|>" not in vocab:
            raise ValueError(f"{vocab_file} has no '<|endoftext|>' token to use as eod")
        self.eod = int(vocab["<|endoftext|>"])
        self.vocab_size = int(self._tok.get_vocab_size())

    def encode(self, text: str) -> List[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def describe(self) -> dict:
        return {**super().describe(), "vocab": os.path.abspath(self.vocab_file),
                "merges": os.path.abspath(self.merge_file)}


def build_tokenizer(tokenizer_type: str, tokenizer_model: Optional[str] = None,
                    vocab_file: Optional[str] = None, merge_file: Optional[str] = None,
                    vocab_size: Optional[int] = None, *, tiktoken_pattern: Optional[str] = None,
                    tiktoken_num_special_tokens: int = 1000) -> Tokenizer:
    """Builds a tokenizer from Megatron's ``--tokenizer-type`` name and its files.

    Args:
        tokenizer_type: one of ``TOKENIZER_TYPES``.
        tokenizer_model: sentencepiece ``.model`` (SentencePieceTokenizer, GPTSentencePieceTokenizer,
            Llama2Tokenizer), a tokenizer folder (HuggingFaceTokenizer) or a tiktoken JSON vocab (TikTokenizer).
        vocab_file: vocab.json (GPT2BPETokenizer).
        merge_file: merges.txt (GPT2BPETokenizer).
        vocab_size: ids before eod (NullTokenizer); all ids, specials included (TikTokenizer, default 2**17).
        tiktoken_pattern: TikTokenizer's split pattern, v1 or v2 (default v2).
        tiktoken_num_special_tokens: TikTokenizer's special-token ids before the BPE ranks.

    Raises:
        ValueError: unknown type, or a file the type needs is missing.
    """
    if tokenizer_type in ("SentencePieceTokenizer", "GPTSentencePieceTokenizer"):
        return SentencePieceTokenizer(tokenizer_model)
    if tokenizer_type == "Llama2Tokenizer":
        return Llama2Tokenizer(tokenizer_model)
    if tokenizer_type == "HuggingFaceTokenizer":
        return HuggingFaceTokenizer(tokenizer_model)
    if tokenizer_type == "GPT2BPETokenizer":
        return GPT2BPETokenizer(vocab_file, merge_file)
    if tokenizer_type == "NullTokenizer":
        return NullTokenizer(vocab_size)
    if tokenizer_type == "TikTokenizer":
        from megatron_core.data.tiktokenizer import TikTokenizer
        return TikTokenizer(tokenizer_model, pattern=tiktoken_pattern, vocab_size=vocab_size,
                            num_special_tokens=tiktoken_num_special_tokens)
    if tokenizer_type == "ByteTokenizer":
        return ByteTokenizer()
    raise ValueError(f"unknown tokenizer type {tokenizer_type!r}; use one of {', '.join(TOKENIZER_TYPES)}")
