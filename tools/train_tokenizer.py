"""Train a sentencepiece tokenizer (BPE or unigram) on text or jsonl files.

Example (lossless: identity normalization, byte fallback, whitespace and newlines kept)::

    python tools/train_tokenizer.py --input corpus.jsonl --json-keys text --model-prefix tok/spm \\
        --vocab-size 32000 --model-type bpe --lossless

writes ``tok/spm.model`` and ``tok/spm.vocab``; use the model with
``--tokenizer-type SentencePieceTokenizer --tokenizer-model tok/spm.model``. Ids 0/1/2 are
``<unk>``/``<s>``/``</s>``; ``</s>`` is the end-of-document (eod) token.
"""
import argparse
import json
import logging
import os
import shutil
import sys
import tempfile
from typing import Iterator, List, Optional, Sequence

from megatron_core.utils.errors import run_tool
from megatron_core.utils.progress import progress_bar

logger = logging.getLogger("train_tokenizer")
PROG = "train_tokenizer.py"


def iter_sentences(paths: Sequence[str], json_keys: Sequence[str]) -> Iterator[str]:
    """Lines of the inputs' documents (sentencepiece trains on lines); jsonl keys or plain text.

    Raises:
        ValueError: a malformed jsonl line, naming the file and line.
    """
    for path in paths:
        with open(path, encoding="utf-8") as f:
            for line_no, line in enumerate(f, 1):
                if not path.endswith((".jsonl", ".json")):
                    if line.strip():
                        yield line.rstrip("\n")
                    continue
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                    texts = [record[k] for k in json_keys]
                except (json.JSONDecodeError, KeyError, TypeError) as err:
                    raise ValueError(f"{path}:{line_no}: cannot read keys {list(json_keys)} ({err}); "
                                     "fix the line or choose keys with --json-keys") from err
                for text in texts:
                    yield from (s for s in str(text).split("\n") if s.strip())


def train(inputs: Sequence[str], model_prefix: str, *, vocab_size: int, model_type: str = "bpe",
          json_keys: Sequence[str] = ("text",), lossless: bool = True, character_coverage: float = 1.0,
          input_sentence_size: int = 2_000_000, num_threads: Optional[int] = None,
          progress: bool = True) -> str:
    """Trains and writes ``{model_prefix}.model`` / ``.vocab`` atomically; returns the .model path.

    Args:
        inputs: text or jsonl files.
        model_prefix: output path without extension.
        vocab_size: pieces in the vocabulary, including the 3 special ones (and 256 byte pieces when
            lossless).
        model_type: "bpe" or "unigram".
        json_keys: keys read from jsonl inputs.
        lossless: identity normalization, byte fallback, no whitespace folding, ``\\n`` and ``\\t`` as
            pieces, so that decode(encode(text)) == text for any text.
        character_coverage: share of characters covered by pieces (the rest falls back to bytes).
        input_sentence_size: lines sampled for training (0: all).
        num_threads: trainer threads (default: CPU count).
        progress: a tqdm bar of the lines read (on a terminal only).
    """
    import sentencepiece

    if model_type not in ("bpe", "unigram"):
        raise ValueError(f"--model-type must be bpe or unigram, got {model_type!r}")
    minimum = 3 + (256 + 2 if lossless else 0)
    if vocab_size <= minimum:
        raise ValueError(f"--vocab-size {vocab_size} is too small; it must exceed {minimum} (special pieces"
                         f"{' + 256 byte pieces + newline/tab' if lossless else ''})")
    options = dict(model_type=model_type, vocab_size=vocab_size, character_coverage=character_coverage,
                   input_sentence_size=input_sentence_size, shuffle_input_sentence=True,
                   num_threads=num_threads or os.cpu_count() or 1, unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
                   hard_vocab_limit=False, minloglevel=1)
    if lossless:
        options.update(normalization_rule_name="identity", byte_fallback=True, remove_extra_whitespaces=False,
                       add_dummy_prefix=False, allow_whitespace_only_pieces=True, split_digits=True,
                       user_defined_symbols=["\n", "\t"])
    folder = os.path.dirname(os.path.abspath(model_prefix))
    os.makedirs(folder, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        tmp_prefix = os.path.join(tmp, "spm")
        sentencepiece.SentencePieceTrainer.train(sentence_iterator=iter(progress_bar(
                                                     iter_sentences(inputs, json_keys), desc="reading lines",
                                                     unit=" lines", enabled=progress)),
                                                 model_prefix=tmp_prefix, **options)
        for ext in (".model", ".vocab"):
            shutil.move(tmp_prefix + ext, model_prefix + ext + ".tmp")
            os.replace(model_prefix + ext + ".tmp", model_prefix + ext)
    return model_prefix + ".model"


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", nargs="+", required=True, help="text or .jsonl files")
    parser.add_argument("--json-keys", nargs="+", default=["text"], help="keys to read from jsonl")
    parser.add_argument("--model-prefix", required=True, help="writes PREFIX.model and PREFIX.vocab")
    parser.add_argument("--vocab-size", type=int, required=True)
    parser.add_argument("--model-type", choices=["bpe", "unigram"], default="bpe")
    parser.add_argument("--lossless", action=argparse.BooleanOptionalAction, default=True,
                        help="identity normalization, byte fallback, whitespace and newlines kept (default on)")
    parser.add_argument("--character-coverage", type=float, default=1.0)
    parser.add_argument("--input-sentence-size", type=int, default=2_000_000,
                        help="lines sampled for training, 0 for all")
    parser.add_argument("--num-threads", type=int, default=None)
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--debug", action="store_true", help="show the traceback of a handled error")
    return parser.parse_args(argv)


def _run(argv: Optional[List[str]]) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    path = train(args.input, args.model_prefix, vocab_size=args.vocab_size, model_type=args.model_type,
                 json_keys=args.json_keys, lossless=args.lossless, character_coverage=args.character_coverage,
                 input_sentence_size=args.input_sentence_size, num_threads=args.num_threads,
                 progress=not args.no_progress)
    print(f"wrote {path}")
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    """Runs the tool; returns 0, or 2 for bad input / 1 for the environment after one ``train_tokenizer.py:
    error:`` paragraph on stderr (with the traceback under ``--debug``)."""
    return run_tool(PROG, _run, argv)


if __name__ == "__main__":
    sys.exit(main())
