"""Megatron-LM's flexible pipeline layout (``--pipeline-model-parallel-layout``) and per-chunk layer counts.

A layout string lists the model chunks in Megatron's chunk order, separated by ``|``: chunk ``i`` is held by
pipeline rank ``i % pp`` as its virtual stage ``i // pp``, so a string of ``pp x vpp`` chunks sets vpp. Inside
a chunk, ``E`` is the embedding, ``t`` a transformer layer, ``m`` a multi-token-prediction layer and ``L``
the output layer with the loss; ``X*N`` repeats an item N times, ``(...)*N`` a group (groups may hold ``|``
and nest), commas are cosmetic. ``"Et*3|(tt|)*6tmL"`` is 8 chunks of 3, 2, 2, 2, 2, 2, 2 and 1 transformer
layers. Global layer order follows the chunk order, so a chunk's first layer is the sum of all earlier chunks'.

Here the embedding always sits on the first chunk, multi-token prediction and the loss on the last, so a
parsed layout is just the transformer-layer count of every chunk (``TransformerConfig.
pipeline_model_parallel_layout``); chunks of zero layers are allowed (``"E|t*4|tL"``).
"""
from __future__ import annotations

import re
from types import MappingProxyType
from typing import Optional, Sequence

LAYER_CHARS = MappingProxyType({"E": "the embedding", "t": "a transformer layer", "m": "a multi-token-prediction layer",
                               "L": "the output layer and loss"})
_SYNTAX = "chunks of E, t, m, L separated by '|', X*N and (...)*N repeats, e.g. 'Et*3|(tt|)*6tmL'"


def expand_layout(text: str) -> list[str]:
    """The chunks of layout string ``text``, repeats unrolled: ``"E|(t|)*2tL"`` -> ``["E", "t", "t", "tL"]``.
    Raises ValueError naming the string for a character, parenthesis or repeat it cannot read."""
    source = text.replace(",", "").replace(" ", "")  # commas (and spaces) are cosmetic
    flat, end = _expand(source, 0, text)
    if end != len(source):
        raise ValueError(f"pipeline layout {text!r} has an unmatched ')'; expected {_SYNTAX}")
    return flat.split("|")


def _expand(source: str, pos: int, text: str) -> tuple[str, int]:
    """Unrolls ``source`` from ``pos`` up to an unmatched ')' or its end; returns (expanded, position)."""
    out = []
    while pos < len(source) and source[pos] != ")":
        if source[pos] == "(":
            item, pos = _expand(source, pos + 1, text)
            if pos >= len(source):
                raise ValueError(f"pipeline layout {text!r} has an unclosed '('; expected {_SYNTAX}")
            pos += 1
        elif source[pos] in LAYER_CHARS or source[pos] == "|":
            item, pos = source[pos], pos + 1
        else:
            raise ValueError(f"pipeline layout {text!r} has {source[pos]!r}, which is no layer; expected {_SYNTAX}")
        if pos < len(source) and source[pos] == "*":
            digits = pos + 1
            while digits < len(source) and source[digits].isdigit():
                digits += 1
            if digits == pos + 1:
                raise ValueError(f"pipeline layout {text!r} has a '*' without a count; expected {_SYNTAX}")
            item, pos = item * int(source[pos + 1: digits]), digits
        out.append(item)
    return "".join(out), pos


def parse_layout(text: str, *, pipeline_model_parallel_size: int, num_layers: int,
                 mtp_num_layers: Optional[int] = None) -> list[int]:
    """The transformer-layer count of every chunk of layout ``text`` (Megatron's chunk order), validated:
    the chunks are a multiple of pp; one ``E``, first in the first chunk; one ``L``, last in the last chunk;
    the ``m`` layers (as many as ``mtp_num_layers``) in the last chunk after its transformer layers; the ``t``
    layers sum to ``num_layers``. Raises ValueError naming the string and the fix."""
    chunks = expand_layout(text)
    pp = pipeline_model_parallel_size
    where = f"pipeline layout {text!r} ({len(chunks)} chunks: {'|'.join(chunks)})"
    if len(chunks) % pp:
        raise ValueError(f"{where} is not a multiple of --pipeline-model-parallel-size {pp}: give pp x vpp chunks")
    flat = "".join(chunks)
    if flat.count("E") != 1 or not chunks[0].startswith("E"):
        raise ValueError(f"{where} must hold one E (the embedding), at the start of the first chunk")
    if flat.count("L") != 1 or not chunks[-1].endswith("L"):
        raise ValueError(f"{where} must hold one L (the output layer and loss), at the end of the last chunk")
    mtp, expected = flat.count("m"), mtp_num_layers or 0
    if mtp != chunks[-1].count("m") or not re.fullmatch(r"E?t*m*L", chunks[-1]):
        raise ValueError(f"{where}: the m layers (multi-token prediction) must sit in the last chunk, after its "
                         "transformer layers, before L")
    if mtp != expected:
        raise ValueError(f"{where} has {mtp} m layers but --mtp-num-layers is {mtp_num_layers}: give one m per "
                         "multi-token-prediction depth")
    counts = [chunk.count("t") for chunk in chunks]
    if sum(counts) != num_layers:
        raise ValueError(f"{where} has {sum(counts)} transformer layers (t) but --num-layers is {num_layers}")
    return counts


def check_chunk_counts(counts: Sequence[int], *, num_layers: int, pp: Optional[int], vpp: Optional[int]) -> None:
    """Raises ValueError naming the values unless ``counts`` (per-chunk transformer layers) are >= 0, sum to
    ``num_layers`` and, when pp is bound, number pp x vpp."""
    values = (f"pipeline_model_parallel_layout={list(counts)}, num_layers={num_layers}, "
              f"pipeline_model_parallel_size={pp}, virtual_pipeline_model_parallel_size={vpp}")
    if not counts or any(not isinstance(n, int) or n < 0 for n in counts):
        raise ValueError(f"pipeline_model_parallel_layout must list a transformer-layer count >= 0 per chunk "
                         f"({values})")
    if sum(counts) != num_layers:
        raise ValueError(f"pipeline_model_parallel_layout holds {sum(counts)} layers, not num_layers ({values})")
    if pp is not None and len(counts) != pp * (vpp or 1):
        raise ValueError(f"pipeline_model_parallel_layout has {len(counts)} chunks, not pipeline_model_parallel_size "
                         f"x virtual_pipeline_model_parallel_size = {pp * (vpp or 1)} ({values}); give one count "
                         "per chunk, in Megatron's order (chunk i on pp rank i % pp, virtual stage i // pp)")


def chunk_layer_range(counts: Sequence[int], pp: int, pp_rank: int, vp_stage: Optional[int]) -> tuple[int, int]:
    """``(offset, count)`` of the chunk of pipeline rank ``pp_rank``, virtual stage ``vp_stage``: chunk
    ``vp_stage * pp + pp_rank``, whose first layer follows every earlier chunk's layers."""
    index = (vp_stage or 0) * pp + pp_rank
    return sum(counts[:index]), counts[index]


def split_chunk_counts(num_layers: int, pp: int, vpp: int, *, first: Optional[int] = None,
                       last: Optional[int] = None, embedding: bool = False, loss: bool = False) -> list[int]:
    """Per-chunk counts of Megatron's uneven splits with ``vpp`` virtual stages, as flags name them:
    ``first`` / ``last`` (``--decoder-first/last-pipeline-num-layers``) layers on the first / last stage, the
    other stages sharing the rest, each stage's layers spread evenly over its chunks; or ``embedding`` /
    ``loss`` (``--account-for-*-in-pipeline-split``): ``num_layers`` plus those split evenly over every chunk,
    the first / last chunk holding one transformer layer fewer. Raises ValueError naming the values."""
    values = (f"--num-layers {num_layers}, --pipeline-model-parallel-size {pp}, {vpp} virtual stages per rank, "
              f"--decoder-first-pipeline-num-layers {first}, --decoder-last-pipeline-num-layers {last}")
    if embedding or loss:
        total, chunks = num_layers + int(embedding) + int(loss), pp * vpp
        if total % chunks or total // chunks < 1:
            raise ValueError(f"--num-layers {num_layers} plus the embedding and loss counted as layers ({total}) "
                             f"is not divisible by the {chunks} model chunks (pp {pp} x vpp {vpp})")
        counts = [total // chunks] * chunks
        counts[0], counts[-1] = counts[0] - int(embedding), counts[-1] - int(loss)
        return counts
    fixed = [n for n in (first, last) if n is not None]
    middle_stages, middle_layers = pp - len(fixed), num_layers - sum(fixed)
    if any(n < 1 for n in fixed) or middle_layers < 0 or (middle_stages and middle_layers % middle_stages) or (
            not middle_stages and middle_layers):
        raise ValueError(f"the uneven pipeline split does not work out: {middle_layers} layers left for "
                         f"{middle_stages} other stages ({values})")
    stages = [middle_layers // middle_stages if middle_stages else 0] * pp
    stages[0] = first if first is not None else stages[0]
    stages[-1] = last if last is not None else stages[-1]
    uneven = [(rank, n) for rank, n in enumerate(stages) if n % vpp]
    if uneven:
        raise ValueError(f"the pipeline stages' layer counts {stages} must be divisible by the {vpp} virtual stages "
                         f"of each rank (stage {uneven[0][0]} holds {uneven[0][1]}; {values}); give "
                         "--pipeline-model-parallel-layout for another split")
    return [stages[rank] // vpp for _ in range(vpp) for rank in range(pp)]


def format_counts(counts: Sequence[int]) -> str:
    """The layout string of per-chunk counts: ``[1, 3]`` -> ``"Et|tttL"`` (no MTP)."""
    chunks = ["t" * n for n in counts]
    chunks[0], chunks[-1] = "E" + chunks[0], chunks[-1] + "L"
    return "|".join(chunks)


__all__ = ["LAYER_CHARS", "expand_layout", "parse_layout", "check_chunk_counts", "chunk_layer_range",
           "split_chunk_counts", "format_counts"]
