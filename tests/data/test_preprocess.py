"""tools/preprocess_data.py end to end: workers, formats, round trip, bad lines, atomic outputs."""
import json
import os

import numpy as np
import pytest

from megatron_core.data import IndexedDataset, SentencePieceTokenizer
from megatron_core.data.preprocess import preprocess
from tests.data.conftest import CORPUS, load_tool

preprocess_data = load_tool("preprocess_data")


def write_jsonl(path, texts, extra_lines=()):
    lines = [json.dumps({"text": t, "meta": i}) for i, t in enumerate(texts)]
    for index, line in extra_lines:
        lines.insert(index, line)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return str(path)


def run_cli(*args):
    return preprocess_data.main([str(a) for a in args])


def test_end_to_end_two_workers_matches_one(tmp_path, spm_model, capsys):
    data = write_jsonl(tmp_path / "in.jsonl", CORPUS)
    common = ["--input", data, "--json-keys", "text", "--tokenizer-type", "SentencePieceTokenizer",
              "--tokenizer-model", spm_model, "--append-eod", "--log-interval", "10"]
    assert run_cli(*common, "--output-prefix", tmp_path / "w2", "--workers", 2) == 0
    assert run_cli(*common, "--output-prefix", tmp_path / "w1", "--workers", 1) == 0
    captured = capsys.readouterr()
    assert "documents 80, tokens" in captured.out
    assert captured.err == ""  # the progress bar is drawn only on a terminal
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"w2_text_document{ext}").read_bytes() == (tmp_path / f"w1_text_document{ext}").read_bytes()
    ds, tok = IndexedDataset(str(tmp_path / "w2_text_document")), SentencePieceTokenizer(spm_model)
    assert len(ds) == len(CORPUS) and ds.dtype == np.uint16
    for i, text in enumerate(CORPUS):
        ids = ds[i].tolist()
        assert ids[-1] == tok.eod and tok.decode(ids[:-1]) == text


def test_multiple_keys_and_plain_text(tmp_path):
    data = tmp_path / "in.jsonl"
    data.write_text("\n".join(json.dumps({"a": f"{i} {i + 1}", "b": f"{i * 2}"}) for i in range(5)))
    prefixes = preprocess([str(data)], str(tmp_path / "k"), json_keys=["a", "b"],
                          tokenizer_args=dict(tokenizer_type="NullTokenizer", vocab_size=100))
    assert IndexedDataset(prefixes["a"])[3].tolist() == [3, 4]
    assert IndexedDataset(prefixes["b"])[3].tolist() == [6]
    text = tmp_path / "plain.txt"
    text.write_text("héllo\n\nworld\n", encoding="utf-8")
    prefixes = preprocess([str(text)], str(tmp_path / "p"), tokenizer_args=dict(tokenizer_type="ByteTokenizer"),
                          append_eod=True)
    ds = IndexedDataset(prefixes["text"])
    assert [bytes(ds[i][:-1].tolist()).decode() for i in range(len(ds))] == ["héllo", "world"]  # blank line skipped
    whole = preprocess([str(text)], str(tmp_path / "f"), tokenizer_args=dict(tokenizer_type="ByteTokenizer"),
                       document_per_file=True)
    assert bytes(IndexedDataset(whole["text"])[0].tolist()).decode() == "héllo\n\nworld\n"


@pytest.mark.parametrize("bad_line, message", [
    ('{"text": "unterminated', "malformed JSON"),
    ('{"body": "no text key"}', "missing or non-string key(s) ['text']; the line has keys ['body']"),
    ('["a", "list"]', "expected a JSON object"),
])
def test_bad_line_names_file_and_line(tmp_path, bad_line, message):
    data = write_jsonl(tmp_path / "bad.jsonl", CORPUS[:5], extra_lines=[(2, bad_line)])
    args = dict(tokenizer_args=dict(tokenizer_type="ByteTokenizer"), workers=2)
    with pytest.raises(ValueError) as info:
        preprocess([data], str(tmp_path / "out"), **args)
    assert f"bad.jsonl:3: {message}" in str(info.value) and "--skip-bad-lines" in str(info.value)
    assert not [f for f in os.listdir(tmp_path) if f.startswith(("out", ".out"))]  # atomic: nothing written


def test_skip_bad_lines_counts_them(tmp_path, capsys):
    data = write_jsonl(tmp_path / "bad.jsonl", CORPUS[:5], extra_lines=[(1, "{oops"), (4, b"\xff".decode("latin1"))])
    (tmp_path / "bad.jsonl").write_bytes((tmp_path / "bad.jsonl").read_bytes().replace("ÿ".encode(), b"\xff"))
    assert run_cli("--input", data, "--output-prefix", tmp_path / "o", "--tokenizer-type", "ByteTokenizer") == 2
    assert "bad.jsonl:2: malformed JSON" in capsys.readouterr().err
    assert run_cli("--input", data, "--output-prefix", tmp_path / "o", "--tokenizer-type", "ByteTokenizer",
                   "--skip-bad-lines") == 0
    assert "skipped bad lines 2" in capsys.readouterr().out
    assert len(IndexedDataset(str(tmp_path / "o_text_document"))) == 5


def test_int32_for_large_vocab(tmp_path):
    data = write_jsonl(tmp_path / "n.jsonl", ["70000 1 2", "3"])
    prefixes = preprocess([data], str(tmp_path / "n"), append_eod=True,
                          tokenizer_args=dict(tokenizer_type="NullTokenizer", vocab_size=100000))
    ds = IndexedDataset(prefixes["text"])
    assert ds.dtype == np.int32 and ds[0].tolist() == [70000, 1, 2, 100000]


def test_split_sentences_writes_one_sequence_per_sentence(tmp_path, spm_model):
    """Megatron's --split-sentences: a ``_sentence`` dataset whose documents hold one sequence per sentence,
    the eod after the last one; --keep-newlines keeps the newline between sentences."""
    texts = ["First one. Second one!\nThird?", "Only a single sentence"]
    data = write_jsonl(tmp_path / "in.jsonl", texts)
    common = ["--input", data, "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", spm_model,
              "--append-eod", "--no-progress", "--partitions", "2", "--keep-sequential-samples"]
    assert run_cli(*common, "--output-prefix", tmp_path / "s", "--split-sentences") == 0
    ds, tok = IndexedDataset(str(tmp_path / "s_text_sentence")), SentencePieceTokenizer(spm_model)
    assert list(ds.document_indices) == [0, 3, 4]  # 3 sentences, then 1
    assert [tok.decode(ds[i].tolist()[:-1] if i in (2, 3) else ds[i].tolist()) for i in range(4)] == [
        "First one.", "Second one!", "Third?", "Only a single sentence"]
    assert ds[2].tolist()[-1] == tok.eod and ds[3].tolist()[-1] == tok.eod and ds[0].tolist()[-1] != tok.eod
    assert run_cli(*common, "--output-prefix", tmp_path / "k", "--split-sentences", "--keep-newlines") == 0
    kept = IndexedDataset(str(tmp_path / "k_text_sentence"))
    assert len(kept) == 4 and kept[1].tolist() != ds[1].tolist()  # "Second one!\n" keeps its newline
    assert run_cli(*common[:-3], "--output-prefix", tmp_path / "x", "--keep-newlines") == 2
