"""Tokenize jsonl or plain-text files into Megatron ``.bin``/``.idx`` datasets (the library behind
``tools/preprocess_data.py``).

Input formats, chosen by extension:

* ``.jsonl`` / ``.json``: one JSON object per line, one document per line; each ``json_keys`` entry
  is tokenized into its own dataset ``{output_prefix}_{key}_document``.
* anything else: plain UTF-8 text, one document per line (or per file with ``document_per_file``);
  written as key ``text``.

Worker processes parse and tokenize; the parent writes in input order, so the output does not
depend on the number of workers.

With ``split_sentences`` (Megatron's ``--split-sentences``) every sentence is its own sequence of the
document, in a dataset named ``{output_prefix}_{key}_sentence``; sentences end at ``.``, ``!`` or ``?``
followed by whitespace (nltk's punkt splitter when ``nltk`` and its data are installed, as in Megatron), and
``keep_newlines`` keeps the newlines between them instead of dropping them.
"""
import dataclasses
import json
import logging
import multiprocessing
import re
import time
from typing import Callable, Dict, Iterator, Optional, Sequence, Tuple

import numpy as np

from megatron_core.data.indexed_dataset import IndexedDatasetBuilder, optimal_dtype
from megatron_core.data.tokenizers import build_tokenizer

logger = logging.getLogger(__name__)

_OK, _BAD = 0, 1
_worker_state: dict = {}


@dataclasses.dataclass
class PreprocessStats:
    """Counters reported to the progress callback and returned at the end."""

    documents: int = 0
    tokens: int = 0
    bytes_read: int = 0
    skipped_bad_lines: int = 0
    empty_documents: int = 0
    seconds: float = 0.0


def output_prefix_for(output_prefix: str, key: str, *, split_sentences: bool = False) -> str:
    """Megatron's dataset name for one json key: ``{output_prefix}_{key}_document`` (``_sentence`` when
    sentences are split)."""
    return f"{output_prefix}_{key}_{'sentence' if split_sentences else 'document'}"


_SENTENCE_END = re.compile(r"(?<=[.!?])(\s+)")


def _punkt():
    try:
        import nltk
        return nltk.data.load("tokenizers/punkt/english.pickle")
    except Exception:  # noqa: BLE001 - nltk or its punkt data missing: the regex splitter
        return None


def split_into_sentences(text: str, *, keep_newlines: bool = False) -> list[str]:
    """The sentences of ``text``: punkt's when available, else split after ``.``, ``!``, ``?`` + whitespace.
    Without ``keep_newlines`` each sentence is stripped; with it the whitespace after a sentence (newlines
    included) stays at its end. Empty pieces are dropped."""
    punkt = _worker_state.get("punkt")
    if punkt is not None and not keep_newlines:
        pieces = [piece.strip() for piece in punkt.tokenize(text)]
    else:
        parts = _SENTENCE_END.split(text)  # [sentence, whitespace, sentence, whitespace, ..., sentence]
        sentences, gaps = parts[0::2], parts[1::2] + [""]
        pieces = ([s + gap for s, gap in zip(sentences, gaps)] if keep_newlines
                  else [s.strip() for s in sentences])
    return [piece for piece in pieces if piece.strip()]


def _is_json(path: str) -> bool:
    return path.endswith((".jsonl", ".json"))


def _iter_items(paths: Sequence[str], document_per_file: bool) -> Iterator[Tuple[str, int, bytes]]:
    """Yields (file, line number, raw bytes) per document, reading files in order."""
    for path in paths:
        with open(path, "rb") as f:
            if document_per_file and not _is_json(path):
                yield path, 1, f.read()
                continue
            for line_no, line in enumerate(f, 1):
                yield path, line_no, line


def _init_worker(tokenizer_args: dict, json_keys: Sequence[str], append_eod: bool, dtype: type,
                 document_per_file: bool, split_sentences: bool = False, keep_newlines: bool = False) -> None:
    _worker_state.update(tokenizer=build_tokenizer(**tokenizer_args), json_keys=list(json_keys),
                         append_eod=append_eod, dtype=dtype, document_per_file=document_per_file,
                         split_sentences=split_sentences, keep_newlines=keep_newlines,
                         punkt=_punkt() if split_sentences else None)


def _encode(item: Tuple[str, int, bytes]):
    """Worker: (path, line, raw) -> (path, line, status, {key: token bytes} or error text, byte count)."""
    path, line_no, raw = item
    state = _worker_state
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        return path, line_no, _BAD, f"invalid UTF-8 ({err.reason} at byte {err.start})", len(raw)
    if _is_json(path):
        if not text.strip():
            return path, line_no, _OK, {}, len(raw)
        try:
            record = json.loads(text)
        except json.JSONDecodeError as err:
            return path, line_no, _BAD, f"malformed JSON ({err.msg} at column {err.colno})", len(raw)
        if not isinstance(record, dict):
            return path, line_no, _BAD, f"expected a JSON object, got {type(record).__name__}", len(raw)
        missing = [k for k in state["json_keys"] if not isinstance(record.get(k), str)]
        if missing:
            return path, line_no, _BAD, (f"missing or non-string key(s) {missing}; the line has keys "
                                         f"{sorted(record)[:10]} (choose with --json-keys)"), len(raw)
        texts = {k: record[k] for k in state["json_keys"]}
    else:
        one_line = not state["document_per_file"] and text.endswith("\n")
        texts = {"text": text[:-1] if one_line else text}
    out = {}
    for key, value in texts.items():
        pieces = (split_into_sentences(value, keep_newlines=state["keep_newlines"]) if state["split_sentences"]
                  else [value])
        sentences = [ids for ids in (state["tokenizer"].encode(piece) for piece in pieces) if ids]
        if sentences and state["append_eod"]:
            sentences[-1].append(state["tokenizer"].eod)  # the document's end, after its last sentence
        out[key] = [np.asarray(ids, dtype=state["dtype"]).tobytes() for ids in sentences]
    return path, line_no, _OK, out, len(raw)


def preprocess(inputs: Sequence[str], output_prefix: str, *, tokenizer_args: dict,
               json_keys: Sequence[str] = ("text",), append_eod: bool = False, workers: int = 1,
               skip_bad_lines: bool = False, document_per_file: bool = False, log_interval: int = 1000,
               progress: Optional[Callable[[PreprocessStats], None]] = None, split_sentences: bool = False,
               keep_newlines: bool = False) -> Dict[str, str]:
    """Tokenizes ``inputs`` and writes one Megatron dataset per key.

    Args:
        inputs: input files, read in order.
        output_prefix: datasets go to ``{output_prefix}_{key}_document.bin/.idx``.
        tokenizer_args: keyword arguments of ``build_tokenizer`` (rebuilt in each worker).
        json_keys: keys to tokenize in jsonl inputs (plain text always uses ``text``).
        append_eod: end every non-empty document with the tokenizer's eod.
        workers: tokenizing processes (1: in this process).
        skip_bad_lines: skip and count malformed lines instead of raising.
        document_per_file: plain-text files are one document each instead of one per line.
        log_interval: call ``progress`` every this many documents (and once at the end).
        progress: callback receiving the running ``PreprocessStats``.
        split_sentences: one sequence per sentence (datasets ``..._{key}_sentence``).
        keep_newlines: with split_sentences, keep the newlines between sentences.

    Returns:
        ``{key: dataset prefix}`` of the datasets written.

    Raises:
        ValueError: a malformed line (naming file and line) unless ``skip_bad_lines``.
    """
    if workers < 1:
        raise ValueError(f"--workers must be >= 1, got {workers}")
    if not inputs:
        raise ValueError("no input files; pass --input FILE [FILE ...]")
    tokenizer = build_tokenizer(**tokenizer_args)
    dtype = optimal_dtype(tokenizer.vocab_size)
    keys = list(json_keys) if any(_is_json(p) for p in inputs) else ["text"]
    if any(_is_json(p) for p in inputs) and not all(_is_json(p) for p in inputs):
        raise ValueError(f"mix of jsonl and plain-text inputs {list(inputs)}; preprocess them in separate runs")
    prefixes = {key: output_prefix_for(output_prefix, key, split_sentences=split_sentences) for key in keys}
    builders = {key: IndexedDatasetBuilder(prefix, dtype) for key, prefix in prefixes.items()}
    stats, start = PreprocessStats(), time.perf_counter()
    try:
        options = (tokenizer_args, keys, append_eod, dtype, document_per_file, split_sentences, keep_newlines)
        for result in _results(inputs, options, workers):
            _consume(result, builders, dtype, stats, skip_bad_lines)
            stats.seconds = time.perf_counter() - start
            if progress is not None and log_interval > 0 and stats.documents % log_interval == 0 and result[2] == _OK:
                progress(stats)
    except BaseException:
        for builder in builders.values():
            builder.abort()
        raise
    for builder in builders.values():
        builder.finalize()
    stats.seconds = time.perf_counter() - start
    if progress is not None:
        progress(stats)
    if stats.skipped_bad_lines:
        logger.warning("skipped %d malformed lines", stats.skipped_bad_lines)
    logger.info("wrote %d documents, %d tokens to %s", stats.documents, stats.tokens, list(prefixes.values()))
    return prefixes


def _results(inputs, options: tuple, workers: int):
    """``options``: the arguments of ``_init_worker``."""
    items = _iter_items(inputs, options[4])
    if workers == 1:
        _init_worker(*options)
        yield from map(_encode, items)
        return
    with multiprocessing.Pool(workers, _init_worker, options) as pool:
        yield from pool.imap(_encode, items, chunksize=64)


def _consume(result, builders: Dict[str, IndexedDatasetBuilder], dtype, stats: PreprocessStats,
             skip_bad_lines: bool) -> None:
    path, line_no, status, payload, nbytes = result
    stats.bytes_read += nbytes
    if status == _BAD:
        if not skip_bad_lines:
            raise ValueError(f"{path}:{line_no}: {payload}; fix the line or pass --skip-bad-lines to skip it")
        stats.skipped_bad_lines += 1
        return
    if not payload:
        return  # a blank jsonl line
    arrays = {key: [np.frombuffer(data, dtype=dtype) for data in pieces] for key, pieces in payload.items()}
    if any(not pieces for pieces in arrays.values()):
        stats.empty_documents += 1  # Megatron writes no sequence for an empty document either
        return
    for key, pieces in arrays.items():
        builders[key].add_sentences(pieces)
    stats.documents += 1
    stats.tokens += sum(len(a) for pieces in arrays.values() for a in pieces)
