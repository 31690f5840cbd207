"""The pieces every Hugging Face adapter is made of: a tensor rule (HF names + transform <-> our global name +
tp partition), the transforms themselves, and the ``Adapter`` record a family module fills in.

A transform maps the HF tensors of one rule (one, or several that we fuse) to our one tensor and back, and
states the HF shapes our shape implies (so a file whose tensor disagrees with config.json is named before
anything is read). ``Dims`` carries the sizes the fused layouts need.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Collection, Optional, Sequence

import torch


@dataclasses.dataclass(frozen=True)
class Dims:
    """Attention sizes of a model: query heads, key/value groups, per-head channels."""

    heads: int
    groups: int
    kv_channels: int


@dataclasses.dataclass(frozen=True)
class Transform:
    """``to_ours(hf tensors, dims) -> ours``, ``to_hf(ours, dims) -> hf tensors`` and
    ``hf_shapes(our shape, dims) -> [hf shape per HF name]``."""

    name: str
    to_ours: Callable[[Sequence[torch.Tensor], Dims], torch.Tensor]
    to_hf: Callable[[torch.Tensor, Dims], list[torch.Tensor]]
    hf_shapes: Callable[[tuple, Dims], list[tuple]]


def _qkv_sizes(dims: Dims) -> list[int]:
    return [dims.heads * dims.kv_channels, dims.groups * dims.kv_channels, dims.groups * dims.kv_channels]


def _fuse_qkv(parts: Sequence[torch.Tensor], dims: Dims) -> torch.Tensor:
    """q ``[heads d, ...]``, k, v ``[groups d, ...]`` -> per group ``[q of its heads; k; v]`` rows (our
    ``linear_qkv`` layout, see transformer/attention.py); works for weights and biases."""
    q, k, v = parts
    rest = q.shape[1:]
    q = q.reshape(dims.groups, -1, *rest)  # [g, heads_per_group d, ...]
    k, v = k.reshape(dims.groups, -1, *rest), v.reshape(dims.groups, -1, *rest)  # [g, d, ...]
    return torch.cat([q, k, v], dim=1).reshape(-1, *rest).contiguous()


def _split_qkv(fused: torch.Tensor, dims: Dims) -> list[torch.Tensor]:
    rest = fused.shape[1:]
    per_group = fused.reshape(dims.groups, -1, *rest)  # [g, (heads_per_group + 2) d, ...]
    q_rows = dims.heads // dims.groups * dims.kv_channels
    q, k, v = torch.split(per_group, [q_rows, dims.kv_channels, dims.kv_channels], dim=1)
    return [t.reshape(-1, *rest).contiguous() for t in (q, k, v)]


def _gpt2_qkv_ours(parts: Sequence[torch.Tensor], dims: Dims) -> torch.Tensor:
    """GPT-2's Conv1D ``c_attn`` ``[h, 3 heads d]`` (bias ``[3 heads d]``) -> per head ``[q_h; k_h; v_h]``."""
    (t,) = parts
    t = t.t() if t.dim() == 2 else t  # [3 heads d, (h)]
    rest = t.shape[1:]
    return t.reshape(3, dims.heads, -1, *rest).transpose(0, 1).reshape(-1, *rest).contiguous()


def _gpt2_qkv_hf(ours: torch.Tensor, dims: Dims) -> list[torch.Tensor]:
    rest = ours.shape[1:]
    t = ours.reshape(dims.heads, 3, -1, *rest).transpose(0, 1).reshape(-1, *rest)
    return [(t.t() if t.dim() == 2 else t).contiguous()]


COPY = Transform("copy", lambda parts, dims: parts[0], lambda t, dims: [t], lambda shape, dims: [shape])
CONV1D = Transform("conv1d", lambda parts, dims: parts[0].t().contiguous(), lambda t, dims: [t.t().contiguous()],
                   lambda shape, dims: [tuple(reversed(shape))])
QKV = Transform("qkv", _fuse_qkv, _split_qkv,
                lambda shape, dims: [(n, *shape[1:]) for n in _qkv_sizes(dims)])
GATE_UP = Transform("gate_up", lambda parts, dims: torch.cat(list(parts), dim=0),
                    lambda t, dims: [c.contiguous() for c in t.chunk(2, dim=0)],
                    lambda shape, dims: [(shape[0] // 2, *shape[1:])] * 2)
GPT2_QKV = Transform("gpt2_qkv", _gpt2_qkv_ours, _gpt2_qkv_hf, lambda shape, dims: [tuple(reversed(shape))])


@dataclasses.dataclass(frozen=True)
class Rule:
    """One tensor of ours and the HF tensor(s) it is made of. Names may hold ``{i}`` (the layer index).
    ``hf_index``: the HF tensors stack every expert on dim 0 (``[E, ...]``, transformers 5's fused
    ``experts.gate_up_proj`` / ``experts.down_proj``) and ours is their slice ``hf_index`` (read alone)."""

    ours: str
    theirs: tuple[str, ...]
    transform: Transform = COPY
    partition_dim: Optional[int] = None
    stride: int = 1
    hf_index: Optional[int] = None

    def at_layer(self, i: int, ours_prefix: str, hf_prefix: str) -> "Rule":
        return dataclasses.replace(self, ours=ours_prefix.format(i=i) + self.ours,
                                   theirs=tuple(hf_prefix.format(i=i) + t for t in self.theirs))


def expand_rules(top: Sequence[Rule], layer: Sequence[Rule], num_layers: int, *, hf_prefix: str,
                 ours_prefix: str = "decoder.layers.{i}.") -> list[Rule]:
    """The concrete rules of a model: ``top`` once, ``layer`` for every layer index."""
    return [*top, *(rule.at_layer(i, ours_prefix, hf_prefix) for i in range(num_layers) for rule in layer)]


def _gated(flags: dict) -> bool:
    """fc1 holds ``[gate; up]`` (twice the ffn rows): SwiGLU or gpt-oss's quick GeGLU."""
    return bool(flags.get("swiglu") or flags.get("quick_geglu"))


def expected_shape(name: str, flags: dict, vocab: int) -> Optional[tuple[int, ...]]:
    """The shape our tensor ``name`` has in the model the run ``flags`` describe (None: not a known name)."""
    h, heads = flags["hidden_size"], flags["num_attention_heads"]
    d = flags.get("kv_channels") or h // heads
    groups = flags.get("num_query_groups") if flags.get("group_query_attention") else heads
    ffn = flags.get("ffn_hidden_size") or 4 * h
    fc1 = 2 * ffn if _gated(flags) else ffn
    qkv = (heads + 2 * groups) * d
    suffixes = {"word_embeddings.weight": (vocab, h), "output_layer.weight": (vocab, h),
                "position_embeddings.weight": (flags.get("max_position_embeddings") or flags.get("seq_length"), h),
                "layernorm.weight": (h,), "layernorm.bias": (h,), "q_layernorm.weight": (d,),
                "k_layernorm.weight": (d,), "linear_qkv.weight": (qkv, h), "linear_qkv.bias": (qkv,),
                "linear_proj.weight": (h, heads * d), "linear_proj.bias": (h,), "linear_fc1.weight": (fc1, h),
                "linear_fc1.bias": (fc1,), "linear_fc2.weight": (h, ffn), "linear_fc2.bias": (h,)}
    if ".mlp.experts.local_experts." in name:  # a routed expert: moe_ffn_hidden_size wide
        expert_ffn = flags.get("moe_ffn_hidden_size") or ffn
        suffixes.update({"linear_fc1.weight": (2 * expert_ffn if _gated(flags) else expert_ffn, h),
                         "linear_fc2.weight": (h, expert_ffn)})
    experts = flags.get("num_experts") or 0
    suffixes.update({"mlp.router.weight": (experts, h), "mlp.router.bias": (experts,),
                     "mlp.router.expert_bias": (experts,), "core_attention.softmax_offset": (heads,)})
    if ".mlp.experts.local_experts." in name:
        suffixes.update({"linear_fc1.bias": (suffixes["linear_fc1.weight"][0],), "linear_fc2.bias": (h,)})
    if ".mlp.shared_experts." in name:
        shared = flags.get("moe_shared_expert_intermediate_size") or 0
        suffixes.update({"linear_fc1.weight": (2 * shared if _gated(flags) else shared, h),
                         "linear_fc2.weight": (h, shared)})
    if flags.get("multi_latent_attention"):
        suffixes.update(_mla_shapes(flags))
    if name.startswith("mtp."):
        suffixes.update({"enorm.weight": (h,), "hnorm.weight": (h,), "eh_proj.weight": (h, 2 * h)})
    for suffix in sorted(suffixes, key=len, reverse=True):  # q_layernorm before layernorm
        if name.endswith(suffix):
            return tuple(suffixes[suffix])
    return None


def _mla_shapes(flags: dict) -> dict[str, tuple[int, ...]]:
    """Multi-latent attention's tensors (Megatron's names and layouts)."""
    h, heads = flags["hidden_size"], flags["num_attention_heads"]
    qk, pe, v = flags.get("qk_head_dim", 128), flags.get("qk_pos_emb_head_dim", 64), flags.get("v_head_dim", 128)
    kv_rank, q_rank = flags.get("kv_lora_rank", 32), flags.get("q_lora_rank")
    return {"linear_q_proj.weight": (heads * (qk + pe), h), "linear_q_down_proj.weight": (q_rank, h),
            "q_layernorm.weight": (q_rank,), "linear_q_up_proj.weight": (heads * (qk + pe), q_rank),
            "linear_kv_down_proj.weight": (kv_rank + pe, h), "kv_layernorm.weight": (kv_rank,),
            "linear_kv_up_proj.weight": (heads * (qk + v), kv_rank), "linear_proj.weight": (h, heads * v)}


def _deinterleave(t: torch.Tensor) -> torch.Tensor:
    """Rows (dim 0) ``g0 u0 g1 u1 ...`` -> ``[g0 g1 ...; u0 u1 ...]`` (gpt-oss's gate/up -> ours)."""
    return torch.cat([t[0::2], t[1::2]]).contiguous()


def _interleave(t: torch.Tensor) -> torch.Tensor:
    gate, up = t.chunk(2)
    return torch.stack([gate, up], dim=1).reshape(t.shape).contiguous()


TRANSPOSE = Transform("transpose", lambda parts, dims: parts[0].t().contiguous(), lambda t, dims: [t.t().contiguous()],
                      lambda shape, dims: [tuple(reversed(shape))])
INTERLEAVED_GATE_UP = Transform(
    "interleaved_gate_up", lambda parts, dims: _deinterleave(parts[0].t() if parts[0].dim() == 2 else parts[0]),
    lambda t, dims: [_interleave(t).t().contiguous() if t.dim() == 2 else _interleave(t)],
    lambda shape, dims: [tuple(reversed(shape))])
"""transformers' GptOssExperts ``gate_up_proj`` ``[h, 2f]`` (columns gate/up interleaved) and its bias ``[2f]``
<-> our fc1 ``[2f, h]`` (``[gate; up]``) and bias."""


def dims_of(flags: dict) -> Dims:
    heads = flags["num_attention_heads"]
    groups = flags.get("num_query_groups") if flags.get("group_query_attention") else heads
    return Dims(heads=heads, groups=groups or heads,
                kv_channels=flags.get("kv_channels") or flags["hidden_size"] // heads)


@dataclasses.dataclass(frozen=True)
class Adapter:
    """One Hugging Face family.

    Attributes:
        model_type: config.json's ``model_type``.
        architecture: the ``architectures`` entry an export writes (``LlamaForCausalLM``).
        required: config.json keys that must be present (positive integers).
        flags_from_hf: ``(config, path) -> run flags`` (architecture only); raises ValueError naming a key and
            value it cannot express.
        hf_config_from_flags: ``(flags, vocab) -> config.json`` of an export; raises ValueError for run flags
            the family cannot express.
        rules: ``flags -> [Rule]``, the concrete tensor map (tied output layer left out).
        hf_name: maps a name found in the file to the name the rules use (GPT2Model saves without
            ``transformer.``); identity by default.
        ignored: suffixes of file tensors that carry no weights (old ``rotary_emb.inv_freq`` buffers).
        tied_output: the output layer's HF names, ignored in a file of a tied model.
        file_rules: ``(flags, names in the file) -> [Rule]`` for a family with more than one layout on disk
            (per-expert or fused experts); ``rules`` when None.
    """

    model_type: str
    architecture: str
    required: tuple[str, ...]
    flags_from_hf: Callable[[dict, str], dict]
    hf_config_from_flags: Callable[[dict, int], dict]
    rules: Callable[[dict], list[Rule]]
    hf_name: Callable[[str], str] = lambda name: name
    ignored: tuple[str, ...] = ("rotary_emb.inv_freq", "attn.bias", "attn.masked_bias")
    tied_output: tuple[str, ...] = ("lm_head.weight",)
    file_rules: Optional[Callable[[dict, Collection[str]], list[Rule]]] = None


def refuse(path: str, key: str, value, why: str) -> ValueError:
    """The error for a config.json feature we cannot express: names the key, its value and why."""
    return ValueError(f"{path}: {key}={value!r} is not supported: {why}")


__all__ = ["Dims", "Transform", "Rule", "Adapter", "COPY", "CONV1D", "QKV", "GATE_UP", "GPT2_QKV", "TRANSPOSE",
           "INTERLEAVED_GATE_UP", "expand_rules",
           "expected_shape", "dims_of", "refuse"]
