"""Tokenize jsonl or text into Megatron's ``.bin``/``.idx`` format (same flags as Megatron-LM's tool).

Examples::

    python tools/preprocess_data.py --input corpus.jsonl --json-keys text --output-prefix data/corpus \\
        --tokenizer-type SentencePieceTokenizer --tokenizer-model tok/spm.model --append-eod --workers 2
    # -> data/corpus_text_document.bin / .idx ; train with --data-path data/corpus_text_document

    python tools/preprocess_data.py --input a.jsonl --output-prefix data/a --tokenizer-type GPT2BPETokenizer \\
        --vocab-file vocab.json --merge-file merges.txt --append-eod

Plain-text inputs (any extension but .json/.jsonl) give one document per line, or one per file with
``--document-per-file``. A malformed jsonl line stops the run with its file and line number unless
``--skip-bad-lines`` is given. Outputs are written atomically.
"""
import argparse
import logging
import sys
from typing import List, Optional

from megatron_core.data.preprocess import PreprocessStats, preprocess
from megatron_core.data.tokenizers import TOKENIZER_TYPES
from megatron_core.utils.errors import run_tool
from megatron_core.utils.progress import progress_bar

PROG = "preprocess_data.py"


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    group = parser.add_argument_group("input data")
    group.add_argument("--input", nargs="+", required=True, help="jsonl (one document per line) or text files")
    group.add_argument("--json-keys", nargs="+", default=["text"], help="keys to extract from jsonl")
    group.add_argument("--document-per-file", action="store_true", help="each plain-text file is one document")
    group.add_argument("--skip-bad-lines", action="store_true", help="skip and count malformed lines")
    group.add_argument("--split-sentences", action="store_true",
                       help="one sequence per sentence; writes PREFIX_{key}_sentence (nltk punkt when installed)")
    group.add_argument("--keep-newlines", action="store_true",
                       help="with --split-sentences, keep the newlines between sentences")
    group = parser.add_argument_group("tokenizer")
    group.add_argument("--tokenizer-type", required=True, choices=TOKENIZER_TYPES)
    group.add_argument("--tokenizer-model", default=None, help="sentencepiece .model")
    group.add_argument("--vocab-file", default=None, help="GPT-2 vocab.json")
    group.add_argument("--merge-file", default=None, help="GPT-2 merges.txt")
    group.add_argument("--vocab-size", type=int, default=None,
                       help="NullTokenizer: ids before eod; TikTokenizer: all ids (default 2**17)")
    group.add_argument("--tiktoken-pattern", default=None, help="TikTokenizer: v1 or v2 (default v2)")
    group.add_argument("--tiktoken-num-special-tokens", type=int, default=1000)
    group.add_argument("--append-eod", action="store_true", help="end each document with the eod token")
    group = parser.add_argument_group("output data")
    group.add_argument("--output-prefix", required=True, help="writes PREFIX_{key}_document.bin/.idx")
    group = parser.add_argument_group("runtime")
    group.add_argument("--workers", type=int, default=1, help="tokenizing processes")
    group.add_argument("--log-interval", type=int, default=10000, help="documents between progress updates")
    group.add_argument("--partitions", type=int, default=1,
                       help="Megatron's input partitions (merged at the end there); here --workers tokenize in "
                            "parallel and the output is the one merged dataset either way")
    group.add_argument("--keep-sequential-samples", action="store_true",
                       help="documents keep their input order (always the case here)")
    group.add_argument("--no-progress", action="store_true", help="no progress bar")
    group.add_argument("--debug", action="store_true", help="show the traceback of a handled error")
    return parser.parse_args(argv)


def _progress_printer(bar):
    """A callback that advances ``bar`` (documents, tokens, MB/s)."""
    def advance(stats: PreprocessStats) -> None:
        bar.update(stats.documents - bar.n)
        bar.set_postfix(tokens=stats.tokens, MBps=f"{stats.bytes_read / max(stats.seconds, 1e-9) / 1e6:.1f}",
                        refresh=False)
    return advance


def _run(argv: Optional[List[str]]) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    if args.partitions < 1:
        raise ValueError(f"--partitions must be >= 1, got {args.partitions}")
    if args.keep_newlines and not args.split_sentences:
        raise ValueError("--keep-newlines only applies with --split-sentences")
    tokenizer_args = dict(tokenizer_type=args.tokenizer_type, tokenizer_model=args.tokenizer_model,
                          vocab_file=args.vocab_file, merge_file=args.merge_file, vocab_size=args.vocab_size,
                          tiktoken_pattern=args.tiktoken_pattern,
                          tiktoken_num_special_tokens=args.tiktoken_num_special_tokens)
    stats = PreprocessStats()
    # a tqdm bar on stderr, drawn only on a terminal and without --no-progress; closed before an error is printed
    bar = progress_bar(desc="preprocessing", unit=" docs", enabled=not args.no_progress)
    show = _progress_printer(bar)

    def progress(s: PreprocessStats) -> None:
        stats.__dict__.update(s.__dict__)
        show(s)

    with bar:
        prefixes = preprocess(args.input, args.output_prefix, tokenizer_args=tokenizer_args,
                              json_keys=args.json_keys, append_eod=args.append_eod, workers=args.workers,
                              skip_bad_lines=args.skip_bad_lines, document_per_file=args.document_per_file,
                              log_interval=args.log_interval, progress=progress,
                              split_sentences=args.split_sentences, keep_newlines=args.keep_newlines)
    for key, prefix in prefixes.items():
        print(f"{key}: {prefix}.bin / .idx")
    print(f"documents {stats.documents}, tokens {stats.tokens}, skipped bad lines {stats.skipped_bad_lines}, "
          f"empty documents {stats.empty_documents}, {stats.seconds:.1f} s")
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    """Runs the tool; returns 0, or 2 for bad input / 1 for the environment after one ``preprocess_data.py:
    error:`` paragraph on stderr (with the traceback under ``--debug``)."""
    return run_tool(PROG, _run, argv)


if __name__ == "__main__":
    sys.exit(main())
