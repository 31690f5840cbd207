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
_BATCH = 256  # documents per task sent to a worker process


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


def split_into_sentences(text: str, *, keep_newlines: bool = False, punkt=None) -> list[str]:
    """The sentences of ``text``: ``punkt``'s (nltk's splitter) when given, else split after ``.``, ``!``, ``?``
    + whitespace. Without ``keep_newlines`` each sentence is stripped; with it the whitespace after a sentence
    (newlines included) stays at its end. Empty pieces are dropped."""
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


class _Encoder:
    """Parses and tokenizes one document: ``(path, line, raw bytes) -> (path, line, status, {key: token bytes}
    or error text, byte count)``. Built once in each worker process (it holds the tokenizer)."""

    def __init__(self, tokenizer_args: dict, json_keys: Sequence[str], append_eod: bool, dtype: type,
                 document_per_file: bool, split_sentences: bool = False, keep_newlines: bool = False) -> None:
        self.tokenizer, self.json_keys, self.append_eod = build_tokenizer(**tokenizer_args), list(json_keys), append_eod
        self.dtype, self.document_per_file = dtype, document_per_file
        self.split_sentences, self.keep_newlines = split_sentences, keep_newlines
        self.punkt = _punkt() if split_sentences else None

    def __call__(self, item: Tuple[str, int, bytes]):
        path, line_no, raw = item
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
            missing = [k for k in self.json_keys if not isinstance(record.get(k), str)]
            if missing:
                return path, line_no, _BAD, (f"missing or non-string key(s) {missing}; the line has keys "
                                             f"{sorted(record)[:10]} (choose with --json-keys)"), len(raw)
            texts = {k: record[k] for k in self.json_keys}
        else:
            one_line = not self.document_per_file and text.endswith("\n")
            texts = {"text": text[:-1] if one_line else text}
        out = {}
        for key, value in texts.items():
            pieces = (split_into_sentences(value, keep_newlines=self.keep_newlines, punkt=self.punkt)
                      if self.split_sentences else [value])
            sentences = [ids for ids in (self.tokenizer.encode(piece) for piece in pieces) if ids]
            if sentences and self.append_eod:
                sentences[-1].append(self.tokenizer.eod)  # the document's end, after its last sentence
            out[key] = [np.asarray(ids, dtype=self.dtype).tobytes() for ids in sentences]
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


def _batches(items: Iterator, size: int) -> Iterator[list]:
    batch = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def _encode_worker(options: tuple, tasks, results) -> None:
    """A worker process: builds its ``_Encoder`` and answers ``(index, batch)`` tasks with ``(index, encoded)``
    until it receives None; an exception is sent back as ``(index, None, traceback text)``."""
    import traceback
    try:
        encoder = _Encoder(*options)
    except Exception:  # noqa: BLE001 - reported to the parent, which raises it
        results.put((-1, None, traceback.format_exc()))
        return
    for index, batch in iter(tasks.get, None):
        try:
            results.put((index, [encoder(item) for item in batch], None))
        except Exception:  # noqa: BLE001
            results.put((index, None, traceback.format_exc()))


def _results(inputs, options: tuple, workers: int):
    """Encoded documents in input order. ``options``: the arguments of ``_Encoder``. With several workers, batches
    of documents go to worker processes (at most two in flight per worker) and come back reordered."""
    items = _iter_items(inputs, options[4])
    if workers == 1:
        yield from map(_Encoder(*options), items)
        return
    _Encoder(*options)  # bad tokenizer arguments raise here, in the parent, as they do with one worker
    context = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn")
    tasks, results = context.Queue(), context.Queue()
    processes = [context.Process(target=_encode_worker, args=(options, tasks, results), daemon=True)
                 for _ in range(workers)]
    for process in processes:
        process.start()
    try:
        pending, sent, next_index = {}, 0, 0
        for batch in _batches(items, _BATCH):
            tasks.put((sent, batch))
            sent += 1
            while sent - next_index >= 2 * workers:
                next_index = yield from _drain(results, pending, next_index, processes)
        while next_index < sent:
            next_index = yield from _drain(results, pending, next_index, processes)
    finally:
        for _ in processes:
            tasks.put(None)
        for process in processes:
            process.join(timeout=5)
            if process.is_alive():
                process.terminate()


def _drain(results, pending: dict, next_index: int, processes) -> Iterator:
    """Waits for one worker answer, then yields every document that is next in order; returns the next index."""
    import queue
    while True:
        try:
            index, encoded, error = results.get(timeout=5)
            break
        except queue.Empty:
            dead = [p.pid for p in processes if not p.is_alive()]
            if dead:
                raise RuntimeError(f"preprocessing worker processes {dead} died (out of memory?); "
                                   "rerun with fewer --workers") from None
    if error is not None:
        raise RuntimeError(f"a preprocessing worker failed:\n{error}")
    pending[index] = encoded
    while next_index in pending:
        yield from pending.pop(next_index)
        next_index += 1
    return next_index


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
