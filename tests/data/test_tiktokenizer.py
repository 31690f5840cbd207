"""TikTokenizer: the ids of megatron-core 0.16.1's TikTokenTokenizer for the same JSON vocab (tiktoken optional:
the tests skip without it)."""
import base64
import json
import warnings

import pytest

from megatron_core.data import build_tokenizer

tiktoken = pytest.importorskip("tiktoken")

TEXT = "Hello world, hello WORLD! 12345 naïve café\n\n  tabs\tand </s> specials"


@pytest.fixture(scope="module")
def vocab_file(tmp_path_factory):
    """Bytes 0..255 plus a few merges, in Megatron's JSON vocab format."""
    tokens = [bytes([i]) for i in range(256)] + [b"he", b"ll", b"llo", b"hello", b"wo", b"rld", b" w", b" wo"]
    entries = [{"rank": i, "token_bytes": base64.b64encode(t).decode(), "token_str": t.decode("utf-8", "replace")}
               for i, t in enumerate(tokens)]
    path = tmp_path_factory.mktemp("tiktoken") / "vocab.json"
    path.write_text(json.dumps(entries))
    return str(path), len(tokens)


@pytest.mark.parametrize("pattern", ["v1", "v2"])
def test_ids_match_megatron_core(vocab_file, pattern):
    path, ranks = vocab_file
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.tokenizers.text.libraries.tiktoken_tokenizer import TikTokenTokenizer
    theirs = TikTokenTokenizer(path, num_special_tokens=16, pattern=pattern, vocab_size=ranks + 16)
    ours = build_tokenizer("TikTokenizer", tokenizer_model=path, vocab_size=ranks + 16, tiktoken_pattern=pattern,
                           tiktoken_num_special_tokens=16)
    ids = ours.encode(TEXT)
    assert ids == theirs.text_to_ids(TEXT)
    assert ours.eod == theirs.eod == 2 and ours.vocab_size == theirs.vocab_size == ranks + 16
    assert ours.decode(ids) == TEXT and min(i for i in ids if i != 2) >= 16


def test_bad_tiktoken_settings_name_the_value(vocab_file):
    path, ranks = vocab_file
    with pytest.raises(ValueError, match="--vocab-size 131072 .* pass --vocab-size 1264"):
        build_tokenizer("TikTokenizer", tokenizer_model=path)  # default 2**17 ids, 1000 specials
    with pytest.raises(ValueError, match="--tiktoken-pattern 'v3' must be v1 or v2"):
        build_tokenizer("TikTokenizer", tokenizer_model=path, vocab_size=ranks + 1000, tiktoken_pattern="v3")
    with pytest.raises(ValueError, match="does not exist"):
        build_tokenizer("TikTokenizer", tokenizer_model=path + ".missing")
