"""Tokenizers: lossless round trips, Megatron's NullTokenizer conventions, the factory's errors."""
import json

import pytest

from megatron_core.data import ByteTokenizer, NullTokenizer, SentencePieceTokenizer, build_tokenizer
from tests.data.conftest import CORPUS, load_tool

HARD_TEXTS = [
    "Hello  world\n\n\tindented  \n",
    "unseen chars: ΩЖ ✓ 😀 \r\n trailing spaces   ",
    CORPUS[1],
    "",
]


@pytest.mark.parametrize("text", HARD_TEXTS)
def test_sentencepiece_round_trip_is_lossless(spm_model, text):
    tok = build_tokenizer("SentencePieceTokenizer", tokenizer_model=spm_model)
    assert isinstance(tok, SentencePieceTokenizer)
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text
    assert tok.detokenize(tok.tokenize(text)) == text


def test_sentencepiece_vocab_and_eod(spm_model):
    tok = SentencePieceTokenizer(spm_model)
    assert tok.vocab_size == 400
    assert tok.eod == 2  # </s>


def test_unigram_training_round_trip(tmp_path):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("\n".join(json.dumps({"text": t}) for t in CORPUS), encoding="utf-8")
    model = load_tool("train_tokenizer").train([str(corpus)], str(tmp_path / "uni"), vocab_size=350,
                                               model_type="unigram", num_threads=1)
    tok = SentencePieceTokenizer(model)
    for text in HARD_TEXTS:
        assert tok.decode(tok.encode(text)) == text


def test_train_tokenizer_rejects_tiny_vocab(tmp_path):
    corpus = tmp_path / "c.txt"
    corpus.write_text("abc\n")
    with pytest.raises(ValueError, match="--vocab-size 100 is too small"):
        load_tool("train_tokenizer").train([str(corpus)], str(tmp_path / "m"), vocab_size=100)


def test_null_tokenizer_matches_megatron():
    tok = build_tokenizer("NullTokenizer", vocab_size=100)
    assert isinstance(tok, NullTokenizer)
    assert tok.encode("1 2 3 99") == [1, 2, 3, 99]
    assert tok.decode([4, 5]) == "4 5"
    assert tok.eod == 100 and tok.vocab_size == 101
    with pytest.raises(ValueError, match="space-separated integers"):
        tok.encode("hello")


def test_byte_tokenizer_round_trip():
    tok = build_tokenizer("ByteTokenizer")
    assert isinstance(tok, ByteTokenizer) and tok.vocab_size == 257 and tok.eod == 256
    for text in HARD_TEXTS:
        assert tok.decode(tok.encode(text)) == text
    assert tok.decode(tok.encode("ab") + [tok.eod]) == "ab"


def test_gpt2_bpe_from_vocab_and_merges(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    hf = Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    hf.train_from_iterator(CORPUS, trainer)
    vocab_file, merge_file = hf.model.save(str(tmp_path))
    tok = build_tokenizer("GPT2BPETokenizer", vocab_file=vocab_file, merge_file=merge_file)
    assert tok.eod == json.load(open(vocab_file))["<|endoftext|>"]
    for text in HARD_TEXTS:
        assert tok.decode(tok.encode(text)) == text
    hf.decoder = decoders.ByteLevel()
    assert tok.encode(CORPUS[0]) == hf.encode(CORPUS[0]).ids


@pytest.mark.parametrize("kwargs, match", [
    (dict(tokenizer_type="Bogus"), "unknown tokenizer type 'Bogus'"),
    (dict(tokenizer_type="SentencePieceTokenizer", tokenizer_model="/nonexistent.model"), "does not exist"),
    (dict(tokenizer_type="GPT2BPETokenizer", vocab_file="/no/vocab.json", merge_file="/no/m.txt"), "vocab_file"),
    (dict(tokenizer_type="NullTokenizer"), "positive vocab_size"),
])
def test_build_tokenizer_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        build_tokenizer(**kwargs)


def _saved_hf_tokenizer(folder) -> str:
    """A tiny byte-level BPE saved with transformers' ``save_pretrained`` (what a model folder holds)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    hf = Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    PreTrainedTokenizerFast(tokenizer_object=hf, bos_token="<s>", eos_token="</s>").save_pretrained(str(folder))
    return str(folder)


def test_huggingface_tokenizer_from_a_local_folder(tmp_path):
    folder = _saved_hf_tokenizer(tmp_path / "hf")
    tok = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=folder)
    from transformers import AutoTokenizer
    reference = AutoTokenizer.from_pretrained(folder)
    assert tok.eod == reference.eos_token_id and tok.vocab_size == len(reference)
    assert tok.encode(CORPUS[0]) == reference(CORPUS[0]).input_ids
    with pytest.raises(ValueError, match="could not load '/no/such/tokenizer'"):
        build_tokenizer("HuggingFaceTokenizer", tokenizer_model="/no/such/tokenizer")


def test_megatron_sentencepiece_names(spm_model):
    gpt = build_tokenizer("GPTSentencePieceTokenizer", tokenizer_model=spm_model)
    llama = build_tokenizer("Llama2Tokenizer", tokenizer_model=spm_model)
    text = "Megatron users switch without edits"
    assert llama.encode(text) == [llama.bos, *gpt.encode(text)] and llama.eod == gpt.eod
    assert llama.decode(llama.encode(text)) == text
