"""Megatron's .bin/.idx format: byte-exact writing, reading Megatron-written files, corrupt-file errors."""
import os
import struct

import numpy as np
import pytest

from megatron_core.data import IndexedDataset, IndexedDatasetBuilder, dtype_code, optimal_dtype
from tests.data.conftest import write_dataset

DOCS = [[1, 2, 3], [4], [5, 6]]


def reference_idx(code: int, lengths, pointers, doc_indices, modes=None) -> bytes:
    """The .idx bytes as Megatron-LM's _IndexWriter lays them out, built field by field with struct."""
    out = b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", code)
    out += struct.pack("<Q", len(lengths)) + struct.pack("<Q", len(doc_indices))
    out += b"".join(struct.pack("<i", n) for n in lengths)
    out += b"".join(struct.pack("<q", p) for p in pointers)
    out += b"".join(struct.pack("<q", d) for d in doc_indices)
    if modes is not None:
        out += b"".join(struct.pack("<b", m) for m in modes)
    return out


def megatron_style_read(prefix: str):
    """Reads a dataset the way Megatron-LM's _IndexReader/_MMapBinReader do (frombuffer at offsets)."""
    with open(prefix + ".idx", "rb") as f:
        assert f.read(9) == b"MMIDIDX\x00\x00"
        assert struct.unpack("<Q", f.read(8))[0] == 1
        code = struct.unpack("<B", f.read(1))[0]
        n_seq, n_doc = struct.unpack("<Q", f.read(8))[0], struct.unpack("<Q", f.read(8))[0]
        offset = f.tell()
    dtype = {4: np.int32, 8: np.uint16}[code]
    buf = memoryview(np.memmap(prefix + ".idx", mode="r", order="C"))
    lengths = np.frombuffer(buf, np.int32, n_seq, offset)
    pointers = np.frombuffer(buf, np.int64, n_seq, offset + lengths.nbytes)
    docs = np.frombuffer(buf, np.int64, n_doc, offset + lengths.nbytes + pointers.nbytes)
    bin_buf = memoryview(np.memmap(prefix + ".bin", mode="r", order="C"))
    seqs = [np.frombuffer(bin_buf, dtype, int(n), int(p)).tolist() for n, p in zip(lengths, pointers)]
    return seqs, docs.tolist()


def test_index_is_byte_identical_to_reference(tmp_path):
    prefix = write_dataset(str(tmp_path / "small"), DOCS, np.uint16)
    expected_idx = reference_idx(8, [3, 1, 2], [0, 6, 8], [0, 1, 2, 3])
    assert open(prefix + ".idx", "rb").read() == expected_idx
    assert open(prefix + ".bin", "rb").read() == struct.pack("<6H", 1, 2, 3, 4, 5, 6)


def test_int32_tokens_for_large_vocab(tmp_path):
    assert optimal_dtype(65499) == np.uint16 and optimal_dtype(65500) == np.int32
    prefix = write_dataset(str(tmp_path / "big"), [[70000, 1], [2]], optimal_dtype(100000))
    assert open(prefix + ".idx", "rb").read() == reference_idx(4, [2, 1], [0, 8], [0, 1, 2])
    assert IndexedDataset(prefix)[0].tolist() == [70000, 1]


def test_megatron_style_reader_reads_our_files(tmp_path):
    prefix = write_dataset(str(tmp_path / "ours"), DOCS)
    assert megatron_style_read(prefix) == (DOCS, [0, 1, 2, 3])


def test_reads_megatron_written_file_with_multi_sentence_documents_and_modes(tmp_path):
    prefix = str(tmp_path / "theirs")
    seqs = [[10, 11], [12], [13, 14, 15]]  # document 0 = two sentences, document 1 = one
    with open(prefix + ".idx", "wb") as f:
        f.write(reference_idx(4, [2, 1, 3], [0, 8, 12], [0, 2, 3], modes=[0, 0, 0]))
    with open(prefix + ".bin", "wb") as f:
        f.write(np.array(sum(seqs, []), dtype=np.int32).tobytes())
    ds = IndexedDataset(prefix)
    assert len(ds) == 3 and ds.num_documents == 2 and ds.dtype == np.int32
    assert [ds[i].tolist() for i in range(3)] == seqs
    assert ds.document_indices.tolist() == [0, 2, 3]
    assert ds.sequence_lengths.tolist() == [2, 1, 3]
    assert ds.get(2, offset=1, length=2).tolist() == [14, 15]
    assert ds.get(2, offset=1).tolist() == [14, 15]


def test_arrays_are_views_of_the_mapped_files(tmp_path):
    ds = IndexedDataset(write_dataset(str(tmp_path / "v"), DOCS))
    for array in (ds.sequence_lengths, ds.sequence_pointers, ds.document_indices, ds[0]):
        assert not array.flags.owndata and not array.flags.writeable


def test_get_bounds(tmp_path):
    ds = IndexedDataset(write_dataset(str(tmp_path / "b"), DOCS))
    with pytest.raises(IndexError, match="out of range"):
        ds.get(0, offset=2, length=2)
    with pytest.raises(IndexError, match="sequence index 3"):
        ds[3]


def _corrupt(tmp_path, edit):
    prefix = write_dataset(str(tmp_path / "c"), DOCS)
    edit(prefix)
    return prefix


def _patch(path: str, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def _truncate(path: str, size: int) -> None:
    with open(path, "r+b") as f:
        f.truncate(size)


@pytest.mark.parametrize("edit, message", [
    (lambda p: _patch(p + ".idx", 0, b"NOTANIDX\x00"), "is not a Megatron index file"),
    (lambda p: _patch(p + ".idx", 9, struct.pack("<Q", 2)), "index version 2"),
    (lambda p: _patch(p + ".idx", 17, bytes([9])), "dtype code 9"),
    (lambda p: _truncate(p + ".idx", 20), "header alone needs 34"),
    (lambda p: _truncate(p + ".idx", 60), "truncated or corrupt: 3 sequences and 4 document"),
    (lambda p: _patch(p + ".idx", 18, struct.pack("<Q", 1000)), "1000 sequences"),
    (lambda p: _truncate(p + ".bin", 7), r"\.bin is truncated: sequence 1 ends at byte 8"),
    (lambda p: _patch(p + ".idx", 34 + 12 * 3 + 8 * 3, struct.pack("<q", 2)), "document_indices must start"),
    (lambda p: _patch(p + ".idx", 34 + 12 * 3 + 8, struct.pack("<q", 3) + struct.pack("<q", 1)), "decrease"),
    (lambda p: _patch(p + ".idx", 34, struct.pack("<i", -1)), "negative sequence length"),
])
def test_corrupt_files_raise_clear_errors(tmp_path, edit, message):
    prefix = _corrupt(tmp_path, edit)
    with pytest.raises(ValueError, match=message) as info:
        IndexedDataset(prefix)
    assert "c.idx" in str(info.value) or "c.bin" in str(info.value)


def test_missing_file(tmp_path):
    prefix = write_dataset(str(tmp_path / "m"), DOCS)
    os.remove(prefix + ".bin")
    with pytest.raises(FileNotFoundError, match=r"m\.bin does not exist"):
        IndexedDataset(prefix)


def test_builder_is_atomic_and_checks_dtype(tmp_path):
    prefix = str(tmp_path / "a")
    with pytest.raises(ValueError, match="do not fit uint16"):
        with IndexedDatasetBuilder(prefix, np.uint16) as builder:
            builder.add_document([1, 2])
            builder.add_document([70000])
    assert os.listdir(tmp_path) == []  # nothing half-written, no temporary left
    with pytest.raises(ValueError, match="no Megatron dtype code"):
        dtype_code(np.complex64)
