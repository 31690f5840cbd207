"""Typed, validated configuration of the model and its parallel layout.

Every check raises ValueError naming the values and the fix; nothing is validated with ``assert``.
Derived defaults (``num_query_groups``, ``ffn_hidden_size``, ``kv_channels``) are filled in
``__post_init__`` as Megatron-LM does.
"""
from __future__ import annotations

import dataclasses
from types import MappingProxyType
from typing import TYPE_CHECKING, Optional

import torch

from megatron_core.config_variants import ArchitectureVariants

CP_COMM_TYPES = ("p2p", "a2a", "allgather", "a2a+p2p")
"""Context-parallel attention schemes (Megatron's ``--cp-comm-type``): ring attention, all-to-all (Ulysses),
all-gather of K/V, and hierarchical (all-to-all inside the inner cp level, ring across the outer one)."""

if TYPE_CHECKING:
    from megatron_core.fp8.config import Fp8Config
    from megatron_core.transformer.moe.config import MoEConfig


@dataclasses.dataclass(kw_only=True)
class ModelParallelConfig:
    """Options of the parallel layout the model is built for, and the numeric formats.

    The layout's sizes come from the ``ParallelState`` a model is built with: leave the four ``*_size`` fields
    at None and the model fills them in (``bind_layout``). They are still accepted, as in Megatron, and then
    checked against the state (a mismatch is a ValueError naming both values); tools that reason about a layout
    without processes (the planner, the converter) set them.
    """

    tensor_model_parallel_size: Optional[int] = None
    pipeline_model_parallel_size: Optional[int] = None
    virtual_pipeline_model_parallel_size: Optional[int] = None
    microbatch_group_size_per_vp_stage: Optional[int] = None
    """Interleaved schedule: micro-batches run on one virtual stage before the next (Megatron's
    ``--microbatch-group-size-per-virtual-pipeline-stage``); None = pipeline_model_parallel_size (depth-first)."""
    context_parallel_size: Optional[int] = None
    """Ranks the sequence is split over (load-balanced causal split; see ``megatron_core.context_parallel``)."""
    cp_comm_type: str = "p2p"
    """How attention communicates over cp: "p2p" (ring attention), "a2a" (Ulysses) or "allgather"."""
    sequence_parallel: bool = False
    """Split layernorm/dropout regions along the sequence (needs tensor parallelism)."""
    tp_comm_overlap: bool = False
    """Overlap the sequence-parallel all-gather / reduce-scatter of the column- and row-parallel linear layers
    with their GEMMs, chunk by chunk (Megatron's ``--tp-comm-overlap``; needs sequence_parallel)."""
    params_dtype: torch.dtype = torch.float32
    """dtype the parameters are created in."""
    bf16: bool = False
    fp16: bool = False

    def __post_init__(self) -> None:
        for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        self._validate_microbatch_group()
        if self.cp_comm_type not in CP_COMM_TYPES:
            raise ValueError(f"cp_comm_type must be one of {CP_COMM_TYPES}, got {self.cp_comm_type!r}")
        if self.bf16 and self.fp16:
            raise ValueError("bf16=True and fp16=True are mutually exclusive: choose one precision")
        if self.sequence_parallel and self.tensor_model_parallel_size == 1:  # None: checked when bound
            raise ValueError("sequence_parallel=True needs tensor_model_parallel_size > 1 (got 1): "
                             "sequence parallelism splits the tensor-parallel regions' activations")
        if self.tp_comm_overlap and not self.sequence_parallel:
            raise ValueError("tp_comm_overlap=True needs sequence_parallel=True: it overlaps the sequence-parallel "
                             "all-gather / reduce-scatter with the GEMMs")

    def _validate_microbatch_group(self) -> None:
        group, pp, vpp = (self.microbatch_group_size_per_vp_stage, self.pipeline_model_parallel_size,
                          self.virtual_pipeline_model_parallel_size)
        if group is None:
            return
        if group < 1 or (pp is not None and (vpp or 1) > 1 and group < pp):
            raise ValueError(f"microbatch_group_size_per_vp_stage {group} must be >= pipeline_model_parallel_size "
                             f"{pp} with virtual stages (virtual_pipeline_model_parallel_size {vpp}): each virtual "
                             "stage runs at least pp micro-batches before the next")

    def bind_layout(self, state) -> "ModelParallelConfig":
        """This config with the layout sizes of ``state`` (a ``ParallelState``): fields left at None take the
        state's value; a field that was given must equal it (ValueError otherwise). Re-validates (heads,
        query groups and ffn divisible by tp, layers by pp x vpp, a2a heads by cp)."""
        sizes = {"tensor_model_parallel_size": state.tp_size, "pipeline_model_parallel_size": state.pp_size,
                 "context_parallel_size": state.cp_size, "virtual_pipeline_model_parallel_size": state.vpp_size}
        if getattr(self, "cp_comm_type", None) == "a2a+p2p" and state.cp_size > 1:
            from megatron_core.context_parallel.hierarchical import hierarchical_levels
            hierarchical_levels(state)  # ValueError naming the flag when the state has no two levels
        for name, in_state in sizes.items():
            given = getattr(self, name)
            if given is not None and given != in_state:
                raise ValueError(f"config.{name}={given} does not match the parallel state's {in_state}; "
                                 "leave it unset (the model takes the sizes from the state) or build the config "
                                 "with the sizes given to initialize_model_parallel")
        if all(getattr(self, name) == value for name, value in sizes.items()):
            return self
        return dataclasses.replace(self, **sizes)


RECOMPUTE_MODULES = ("core_attn", "mlp", "layernorm", "mla_up_proj", "moe")
_CHOICES = MappingProxyType({
    "normalization": ("LayerNorm", "RMSNorm"),
    "activation": ("gelu", "swiglu", "squared_relu", "quick_geglu"),
    "position_embedding_type": ("learned_absolute", "rope", "none"),
    "recompute_granularity": (None, "full", "selective"),
    "recompute_method": (None, "uniform", "block"),
})


@dataclasses.dataclass(kw_only=True)
class TransformerConfig(ArchitectureVariants, ModelParallelConfig):
    """Architecture of a GPT-style decoder (Megatron-LM's names); the fields of MLA, YaRN, gpt-oss's layers and
    multi-token prediction are in ``config_variants.ArchitectureVariants``."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: Optional[int] = None
    """Key/value heads for grouped-query attention; default num_attention_heads (multi-head attention)."""
    ffn_hidden_size: Optional[int] = None
    """Default 4 * hidden_size."""
    kv_channels: Optional[int] = None
    """Per-head dim; default hidden_size // num_attention_heads."""
    normalization: str = "LayerNorm"
    activation: str = "gelu"
    openai_gelu: bool = False
    """GeLU with the tanh approximation (GPT-2's ``gelu_new``); only with activation "gelu"."""
    add_bias_linear: bool = True
    add_qkv_bias: Optional[bool] = None
    """Bias on the fused QKV projection; default add_bias_linear."""
    position_embedding_type: str = "learned_absolute"
    """"learned_absolute", "rope", or "none" (no position information besides the causal mask)."""
    rotary_base: float = 10000.0
    rotary_percent: float = 1.0
    """Share of each head's kv_channels that rope rotates (the rest pass through), in (0, 1]."""
    rotary_seq_len_interpolation_factor: Optional[float] = None
    """Positions are divided by this factor before rope (linear position interpolation)."""
    rotary_interleaved: bool = False
    """Rope pairs channels (2i, 2i + 1) (the paper's and GPT-J's layout) instead of (i, i + d/2)."""
    rope_scaling: bool = False
    """Llama-3.1's rope frequency scaling (Megatron's ``--use-rope-scaling``; transformers' rope type "llama3")
    with the four ``rope_scaling_*`` values below."""
    rope_scaling_factor: float = 8.0
    rope_scaling_low_freq_factor: float = 1.0
    rope_scaling_high_freq_factor: float = 4.0
    rope_scaling_original_max_position_embeddings: int = 8192
    max_position_embeddings: Optional[int] = None
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    layernorm_epsilon: float = 1e-5
    layernorm_zero_centered_gamma: bool = False
    """Norm weights are stored as ``gamma - 1`` (initialized to 0) and applied as ``1 + weight``
    (Megatron's ``--apply-layernorm-1p``)."""
    qk_layernorm: bool = False
    """Normalize each head's query and key (over kv_channels, with ``normalization``) before rope."""
    init_method_std: float = 0.02
    untie_embeddings_and_output_weights: bool = False
    recompute_granularity: Optional[str] = None
    """None, "full" (whole layers, see recompute_method) or "selective" (core attention only)."""
    recompute_method: Optional[str] = None
    """With full recompute: "uniform" (checkpoint chunks of recompute_num_layers layers) or "block"
    (checkpoint the first recompute_num_layers layers of each pipeline stage)."""
    recompute_num_layers: Optional[int] = None
    recompute_modules: tuple[str, ...] = ("core_attn",)
    """With selective recompute: which parts run again in backward: "core_attn", "mlp", "layernorm",
    "mla_up_proj" (MLA's up projections and rope), "moe" (the MoE layer, as "mlp" does for dense MLPs)."""
    compile: bool = False
    """``torch.compile`` each transformer layer's forward (regional compilation, see
    ``megatron_core.transformer.compile``); the model's structure, state dict and hooks stay eager."""
    first_pipeline_num_layers: Optional[int] = None
    """Layers on the first pipeline stage when the split is uneven (the rest are spread evenly)."""
    last_pipeline_num_layers: Optional[int] = None
    pipeline_model_parallel_layout: Optional[list[int]] = None
    """Transformer layers of every model chunk in Megatron's chunk order (chunk i on pipeline rank i % pp,
    virtual stage i // pp; pp x vpp entries, zeros allowed); global layer order follows the chunk order.
    Parsed from ``--pipeline-model-parallel-layout`` by ``pipeline_parallel.layout.parse_layout``; instead of
    first/last_pipeline_num_layers."""
    fp8: Optional["Fp8Config"] = None
    """FP8 training settings (``megatron_core.fp8.Fp8Config``); None = the linears run in params/bf16 dtype."""
    moe: Optional["MoEConfig"] = None
    """Mixture-of-experts settings (``megatron_core.transformer.moe.MoEConfig``); None = dense MLPs. Build the
    model with ``moe_layer_spec()`` for them to act."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self._fill_defaults()
        self._validate_sizes()
        self._validate_choices()
        self._validate_rope_scaling()
        self._validate_activation()
        self._validate_recompute()
        self._validate_pipeline_split()
        self._validate_variants()

    def _fill_defaults(self) -> None:
        if self.num_query_groups is None:
            self.num_query_groups = self.num_attention_heads
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
        if self.kv_channels is None and self.num_attention_heads > 0:
            if self.hidden_size % self.num_attention_heads != 0:
                raise ValueError(f"hidden_size {self.hidden_size} is not divisible by num_attention_heads "
                                 f"{self.num_attention_heads}; set kv_channels explicitly or change the sizes")
            self.kv_channels = self.hidden_size // self.num_attention_heads
        if self.add_qkv_bias is None:
            self.add_qkv_bias = self.add_bias_linear

    def _validate_sizes(self) -> None:
        for name in ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size",
                     "kv_channels"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        tp, cp = self.tensor_model_parallel_size or 1, self.context_parallel_size or 1  # unbound: checked when bound
        heads, groups = self.num_attention_heads, self.num_query_groups
        if heads % tp != 0:
            raise ValueError(f"num_attention_heads {heads} is not divisible by tensor_model_parallel_size {tp}")
        if heads % groups != 0:
            raise ValueError(f"num_query_groups {groups} does not divide num_attention_heads {heads}")
        if groups % tp != 0:
            raise ValueError(f"num_query_groups {groups} is not divisible by tensor_model_parallel_size {tp}: "
                             "tensor parallelism splits whole key/value groups")
        if cp > 1 and self.cp_comm_type == "a2a" and (heads // tp % cp or groups // tp % cp):
            raise ValueError(f"cp_comm_type 'a2a' splits attention heads over context_parallel_size {cp}, but each "
                             f"tensor-parallel rank has {heads // tp} query heads and {groups // tp} key/value groups "
                             f"(num_attention_heads {heads}, num_query_groups {groups} / tensor_model_parallel_size "
                             f"{tp}); both must be divisible by {cp}: use cp_comm_type 'p2p' or 'allgather', or "
                             "change the sizes")
        if self.ffn_hidden_size % tp != 0:
            raise ValueError(f"ffn_hidden_size {self.ffn_hidden_size} is not divisible by "
                             f"tensor_model_parallel_size {tp}")
        for name in ("hidden_dropout", "attention_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"{name} must lie in [0, 1), got {getattr(self, name)}")
        if self.position_embedding_type == "learned_absolute" and not self.max_position_embeddings:
            raise ValueError("position_embedding_type='learned_absolute' needs max_position_embeddings")
        if self.position_embedding_type == "rope" and self.kv_channels % 2 != 0:
            raise ValueError(f"rotary embeddings need an even kv_channels, got {self.kv_channels}")
        if not 0.0 < self.rotary_percent <= 1.0:
            raise ValueError(f"rotary_percent must lie in (0, 1], got {self.rotary_percent}")
        if self.position_embedding_type == "rope" and (self.rotary_dim < 2 or self.rotary_dim % 2):
            raise ValueError(f"rotary_percent {self.rotary_percent} of kv_channels {self.kv_channels} gives "
                             f"{self.rotary_dim} rotated channels; it must be even and >= 2")
        if self.rotary_seq_len_interpolation_factor is not None and self.rotary_seq_len_interpolation_factor <= 0:
            raise ValueError(f"rotary_seq_len_interpolation_factor must be > 0, got "
                             f"{self.rotary_seq_len_interpolation_factor}")

    def _validate_rope_scaling(self) -> None:
        if not self.rope_scaling:
            return
        values = (f"rope_scaling_factor={self.rope_scaling_factor}, rope_scaling_low_freq_factor="
                  f"{self.rope_scaling_low_freq_factor}, rope_scaling_high_freq_factor="
                  f"{self.rope_scaling_high_freq_factor}, rope_scaling_original_max_position_embeddings="
                  f"{self.rope_scaling_original_max_position_embeddings}")
        if self.position_embedding_type != "rope":
            raise ValueError(f"rope_scaling=True needs position_embedding_type='rope', got "
                             f"{self.position_embedding_type!r}")
        if self.rotary_seq_len_interpolation_factor is not None:
            raise ValueError(f"rope_scaling=True (Llama-3 scaling) and rotary_seq_len_interpolation_factor="
                             f"{self.rotary_seq_len_interpolation_factor} (linear scaling) disagree: give one of them")
        if not (self.rope_scaling_factor > 0 and 0 < self.rope_scaling_low_freq_factor
                < self.rope_scaling_high_freq_factor and self.rope_scaling_original_max_position_embeddings >= 1):
            raise ValueError(f"Llama-3 rope scaling needs factor > 0, 0 < low_freq_factor < high_freq_factor and "
                             f"original_max_position_embeddings >= 1, got {values}")

    @property
    def llama3_rope_scaling(self):
        """The ``rope.Llama3RopeScaling`` of ``rope_scaling``, or None."""
        if not self.rope_scaling:
            return None
        from megatron_core.transformer.rope import Llama3RopeScaling
        return Llama3RopeScaling(factor=self.rope_scaling_factor, low_freq_factor=self.rope_scaling_low_freq_factor,
                                 high_freq_factor=self.rope_scaling_high_freq_factor,
                                 original_max_position_embeddings=self.rope_scaling_original_max_position_embeddings)

    def _validate_choices(self) -> None:
        for name, allowed in _CHOICES.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")

    def _validate_activation(self) -> None:
        if self.openai_gelu and self.activation != "gelu":
            raise ValueError(f"openai_gelu=True (the tanh GeLU) only applies to activation='gelu', got "
                             f"activation={self.activation!r}; drop openai_gelu or use activation='gelu'")

    def _validate_recompute(self) -> None:
        granularity, method, count = self.recompute_granularity, self.recompute_method, self.recompute_num_layers
        if granularity == "full":
            if method is None or count is None or count < 1:
                raise ValueError(f"recompute_granularity='full' needs recompute_method ('uniform' or 'block') and "
                                 f"recompute_num_layers >= 1, got recompute_method={method!r}, "
                                 f"recompute_num_layers={count!r}")
        elif method is not None or count is not None:
            raise ValueError(f"recompute_method={method!r} and recompute_num_layers={count!r} only apply to "
                             f"recompute_granularity='full', got recompute_granularity={granularity!r}")
        unknown = [m for m in self.recompute_modules if m not in RECOMPUTE_MODULES]
        if unknown:
            raise ValueError(f"recompute_modules {unknown} are not among {RECOMPUTE_MODULES}")

    def _validate_pipeline_split(self) -> None:
        if self.pipeline_model_parallel_layout is not None:
            self._validate_layout()
            return
        pp, vpp = self.pipeline_model_parallel_size or 1, self.virtual_pipeline_model_parallel_size or 1
        first, last = self.first_pipeline_num_layers, self.last_pipeline_num_layers
        values = (f"num_layers={self.num_layers}, pipeline_model_parallel_size={pp}, "
                  f"virtual_pipeline_model_parallel_size={self.virtual_pipeline_model_parallel_size}, "
                  f"first_pipeline_num_layers={first}, last_pipeline_num_layers={last}")
        if first is None and last is None:
            if self.num_layers % (pp * vpp) != 0:
                raise ValueError(f"num_layers {self.num_layers} is not divisible by pipeline_model_parallel_size "
                                 f"{pp} x virtual_pipeline_model_parallel_size {vpp} ({values}); change the sizes "
                                 "or give first_pipeline_num_layers / last_pipeline_num_layers")
            return
        if pp == 1 or vpp > 1:
            raise ValueError(f"first/last_pipeline_num_layers need pipeline parallelism without virtual stages "
                             f"({values})")
        fixed = [n for n in (first, last) if n is not None]
        middle_stages, middle_layers = pp - len(fixed), self.num_layers - sum(fixed)
        if any(n < 1 for n in fixed) or middle_layers < middle_stages or (
                middle_stages and middle_layers % middle_stages) or (not middle_stages and middle_layers):
            raise ValueError(f"the uneven pipeline split does not work out: {middle_layers} layers left for "
                             f"{middle_stages} other stages ({values})")

    def _validate_layout(self) -> None:
        from megatron_core.pipeline_parallel.layout import check_chunk_counts
        first, last = self.first_pipeline_num_layers, self.last_pipeline_num_layers
        if first is not None or last is not None:
            raise ValueError(f"pipeline_model_parallel_layout {self.pipeline_model_parallel_layout} and "
                             f"first_pipeline_num_layers={first} / last_pipeline_num_layers={last} are two ways to "
                             "split the layers: give one of them")
        self.pipeline_model_parallel_layout = list(self.pipeline_model_parallel_layout)
        check_chunk_counts(self.pipeline_model_parallel_layout, num_layers=self.num_layers,
                           pp=self.pipeline_model_parallel_size, vpp=self.virtual_pipeline_model_parallel_size)

    def pipeline_layer_range(self, pp_rank: int, vp_stage: Optional[int] = None) -> tuple[int, int]:
        """``(offset, count)``: the 0-based global index of the first layer of pipeline rank ``pp_rank``
        (model chunk ``vp_stage`` with interleaving) and its number of layers.

        Even split: ``num_layers / (pp * vpp)`` layers per chunk, chunk v of rank r starting at layer
        ``(v * pp + r) * per_chunk``. Uneven split: the first/last stage hold the given counts and the other
        stages share the rest evenly. With ``pipeline_model_parallel_layout``: chunk ``v * pp + r``'s count,
        after the layers of every earlier chunk.
        """
        pp, vpp = self.pipeline_model_parallel_size or 1, self.virtual_pipeline_model_parallel_size or 1
        if self.pipeline_model_parallel_layout is not None:
            from megatron_core.pipeline_parallel.layout import chunk_layer_range
            counts = self.pipeline_model_parallel_layout
            return chunk_layer_range(counts, self.pipeline_model_parallel_size or len(counts) // vpp, pp_rank,
                                     vp_stage)
        first, last = self.first_pipeline_num_layers, self.last_pipeline_num_layers
        if first is None and last is None:
            per_chunk = self.num_layers // (pp * vpp)
            return ((vp_stage or 0) * pp + pp_rank) * per_chunk, per_chunk
        counts = self._uneven_stage_counts()
        return sum(counts[:pp_rank]), counts[pp_rank]

    def _uneven_stage_counts(self) -> list[int]:
        pp, first, last = (self.pipeline_model_parallel_size or 1, self.first_pipeline_num_layers,
                           self.last_pipeline_num_layers)
        middle_stages = pp - (first is not None) - (last is not None)
        middle_layers = self.num_layers - (first or 0) - (last or 0)
        per_middle = middle_layers // middle_stages if middle_stages else 0
        counts = [per_middle] * pp
        if first is not None:
            counts[0] = first
        if last is not None:
            counts[-1] = last
        return counts

    @property
    def rotary_dim(self) -> int:
        """Channels of each head that rope rotates: ``int(kv_channels * rotary_percent)``; with multi-latent
        attention its ``qk_pos_emb_head_dim``."""
        if self.multi_latent_attention:
            return self.qk_pos_emb_head_dim
        return int(self.kv_channels * self.rotary_percent)

    def recomputes(self, module: str) -> bool:
        """Whether selective recompute covers ``module`` ("core_attn", "mlp" or "layernorm")."""
        return self.recompute_granularity == "selective" and module in self.recompute_modules

    @property
    def num_heads_per_group(self) -> int:
        return self.num_attention_heads // self.num_query_groups
