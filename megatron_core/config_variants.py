"""The fields of the frontier architectures, a base class of ``TransformerConfig`` (Megatron-LM's names):

- multi-latent attention (DeepSeek-V2/V3, Megatron's ``MLASelfAttention``): ``multi_latent_attention`` with
  ``q_lora_rank``, ``kv_lora_rank``, ``qk_head_dim``, ``qk_pos_emb_head_dim``, ``v_head_dim``;
- YaRN rope scaling (``rope_type="yarn"``, the default with MLA as in Megatron): ``rotary_scaling_factor``,
  ``mscale``, ``mscale_all_dim``, ``yarn_original_max_position_embeddings``, ``yarn_beta_fast/slow``;
- gpt-oss's layers: sliding-window attention (``window_size``, ``window_attn_skip_freq``), attention sinks
  (``softmax_type``), the clamped GeGLU of its experts (activation ``quick_geglu`` with ``glu_linear_offset``
  and ``activation_func_clamp_value``);
- multi-token prediction (DeepSeek-V3): ``mtp_num_layers``, ``mtp_loss_scaling_factor``.

Validation raises ValueError naming the values and the fix (called from ``TransformerConfig.__post_init__``).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional, Union

SOFTMAX_TYPES = ("vanilla", "off-by-one", "learnable")
ROPE_TYPES = ("rope", "yarn")
YARN_DEFAULT_ORIGINAL_MAX_POSITIONS = 4096  # Megatron's MLATransformerConfig default


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature ``0.1 * mscale * ln(scale) + 1`` (1 for scale <= 1)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@dataclasses.dataclass(kw_only=True)
class ArchitectureVariants:
    """See the module docstring; every field is off (or Megatron's default) unless set."""

    multi_latent_attention: bool = False
    """DeepSeek's multi-latent attention instead of the fused-QKV self-attention."""
    q_lora_rank: Optional[int] = None
    """MLA: rank of the query's down projection (None: queries projected directly, as DeepSeek-V2-Lite)."""
    kv_lora_rank: int = 32
    """MLA: rank of the joint key/value compression (the latent the KV cache stores)."""
    qk_head_dim: int = 128
    """MLA: per-head query/key channels without position information."""
    qk_pos_emb_head_dim: int = 64
    """MLA: per-head rotary channels (the key's are shared by every head)."""
    v_head_dim: int = 128
    """MLA: per-head value channels."""
    softmax_scale: Optional[float] = None
    """Attention logits are multiplied by this; default ``attention_softmax_scale``."""
    rope_type: Optional[str] = None
    """"rope" or "yarn"; None: "yarn" with multi-latent attention, else "rope" (Megatron-LM)."""
    rotary_scaling_factor: float = 1.0
    """YaRN: the context extension factor."""
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    """YaRN: the attention temperature terms; the rotary cos/sin are scaled by ``yarn_get_mscale(factor, mscale)
    / yarn_get_mscale(factor, mscale_all_dim)`` and MLA's softmax scale by ``yarn_get_mscale(factor,
    mscale_all_dim) ** 2`` (DeepSeek's rule)."""
    yarn_original_max_position_embeddings: Optional[int] = None
    """YaRN: the context the model was pretrained at (default 4096, Megatron's)."""
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_correction_range_round_to_int: bool = True
    """YaRN: floor/ceil the correction range's bounds (transformers' ``truncate``; gpt-oss: False)."""
    window_size: Optional[tuple[int, int]] = None
    """Sliding-window attention ``(left, right)``: token i sees keys ``i - left .. i + right`` (``right`` is 0
    for a causal model); None: full attention. Megatron's ``--window-size 127,0`` is transformers'
    ``sliding_window: 128``."""
    window_attn_skip_freq: Union[int, list[int], None] = None
    """Which layers use the window: None all; an int N makes every N-th layer (N, 2N, ..., 1-based) full;
    a list holds one 0/1 per layer (1 = windowed)."""
    softmax_type: str = "vanilla"
    """"vanilla"; "off-by-one" (an extra zero logit per row, Evan Miller's softmax_1); "learnable" (one trained
    sink logit per head, gpt-oss's ``sinks``)."""
    glu_linear_offset: float = 0.0
    """Gated activations: ``act(gate) * (up + glu_linear_offset)`` (gpt-oss: 1.0)."""
    activation_func_clamp_value: Optional[float] = None
    """Gated activations: the gate is clamped to ``<= value`` and up to ``[-value, value]`` first (gpt-oss:
    7.0)."""
    mtp_num_layers: Optional[int] = None
    """Multi-token prediction depths (DeepSeek-V3): module k predicts token t + k + 1."""
    mtp_loss_scaling_factor: float = 0.1
    """The MTP losses, averaged over the depths, enter the loss times this factor."""

    @property
    def gated_activation(self) -> bool:
        """fc1 produces ``[gate; up]`` (twice the ffn rows): SwiGLU, or gpt-oss's quick GeGLU."""
        return self.activation in ("swiglu", "quick_geglu")

    @property
    def effective_rope_type(self) -> str:
        return self.rope_type or ("yarn" if self.multi_latent_attention else "rope")

    @property
    def yarn_rope_scaling(self):
        """The ``rope.YarnRopeScaling`` of the config, or None without YaRN."""
        if self.effective_rope_type != "yarn":
            return None
        from megatron_core.transformer.rope import YarnRopeScaling
        return YarnRopeScaling(
            factor=self.rotary_scaling_factor,
            original_max_position_embeddings=(self.yarn_original_max_position_embeddings
                                              or YARN_DEFAULT_ORIGINAL_MAX_POSITIONS),
            beta_fast=self.yarn_beta_fast, beta_slow=self.yarn_beta_slow, mscale=self.mscale,
            mscale_all_dim=self.mscale_all_dim, round_to_int=self.yarn_correction_range_round_to_int)

    @property
    def rope_attention_factor(self) -> float:
        """What rope's cos and sin are multiplied by: YaRN's ``attention_factor``, else 1."""
        yarn = self.yarn_rope_scaling
        return 1.0 if yarn is None else yarn.attention_factor

    @property
    def attention_head_dim(self) -> int:
        """Channels of each query/key head: ``qk_head_dim + qk_pos_emb_head_dim`` with MLA, else kv_channels."""
        return self.qk_head_dim + self.qk_pos_emb_head_dim if self.multi_latent_attention else self.kv_channels

    @property
    def attention_softmax_scale(self) -> float:
        """``softmax_scale`` if given, else ``1 / sqrt(attention_head_dim)``; with MLA and YaRN times
        ``yarn_get_mscale(rotary_scaling_factor, mscale_all_dim) ** 2`` (DeepSeek-V3, Megatron, transformers)."""
        if self.softmax_scale is not None:
            return self.softmax_scale
        scale = 1.0 / math.sqrt(self.attention_head_dim)
        if self.multi_latent_attention and self.effective_rope_type == "yarn" and self.mscale_all_dim:
            scale *= yarn_get_mscale(self.rotary_scaling_factor, self.mscale_all_dim) ** 2
        return scale

    def window_for(self, layer_number: int) -> Optional[tuple[int, int]]:
        """The ``(left, right)`` window of global layer ``layer_number`` (1-based), or None (full attention)."""
        if self.window_size is None:
            return None
        freq = self.window_attn_skip_freq
        if freq is None:
            return tuple(self.window_size)
        if isinstance(freq, int):
            return None if layer_number % freq == 0 else tuple(self.window_size)
        return tuple(self.window_size) if freq[layer_number - 1] else None

    def _validate_variants(self) -> None:
        self._validate_mla()
        self._validate_rope_type()
        self._validate_window()
        self._validate_gpt_oss_activation()
        if self.mtp_num_layers is not None and self.mtp_num_layers < 1:
            raise ValueError(f"mtp_num_layers must be >= 1 (or None for no multi-token prediction), got "
                             f"{self.mtp_num_layers}")
        if self.mtp_loss_scaling_factor < 0:
            raise ValueError(f"mtp_loss_scaling_factor must be >= 0, got {self.mtp_loss_scaling_factor}")
        if self.softmax_scale is not None and self.softmax_scale <= 0:
            raise ValueError(f"softmax_scale must be > 0 (or None for 1/sqrt(head dim)), got {self.softmax_scale}")

    def _validate_mla(self) -> None:
        if not self.multi_latent_attention:
            return
        sizes = {"kv_lora_rank": self.kv_lora_rank, "qk_head_dim": self.qk_head_dim,
                 "qk_pos_emb_head_dim": self.qk_pos_emb_head_dim, "v_head_dim": self.v_head_dim}
        if self.q_lora_rank is not None:
            sizes["q_lora_rank"] = self.q_lora_rank
        bad = {name: value for name, value in sizes.items() if not isinstance(value, int) or value < 1}
        if bad:
            raise ValueError(f"multi-latent attention needs positive sizes, got {bad}")
        if self.qk_pos_emb_head_dim % 2:
            raise ValueError(f"qk_pos_emb_head_dim {self.qk_pos_emb_head_dim} must be even: rope rotates channel pairs")
        if self.num_query_groups != self.num_attention_heads:
            raise ValueError(f"multi-latent attention has one key/value head per query head: num_query_groups "
                             f"{self.num_query_groups} must equal num_attention_heads {self.num_attention_heads} "
                             "(drop --group-query-attention)")
        if self.position_embedding_type != "rope":
            raise ValueError(f"multi-latent attention rotates its qk_pos_emb_head_dim channels: it needs "
                             f"position_embedding_type 'rope', got {self.position_embedding_type!r}")
        if self.softmax_type != "vanilla" or self.window_size is not None:
            raise ValueError(f"multi-latent attention with softmax_type {self.softmax_type!r} / window_size "
                             f"{self.window_size} is not built: those are gpt-oss's (grouped-query) attention")

    def _validate_rope_type(self) -> None:
        if self.rope_type not in (None, *ROPE_TYPES):
            raise ValueError(f"rope_type must be one of {ROPE_TYPES}, got {self.rope_type!r}")
        if self.effective_rope_type != "yarn":
            return
        if self.position_embedding_type != "rope":
            raise ValueError(f"rope_type 'yarn' needs position_embedding_type 'rope', got "
                             f"{self.position_embedding_type!r}")
        if self.rope_scaling or self.rotary_seq_len_interpolation_factor is not None:
            raise ValueError("rope_type 'yarn' and Llama-3 rope scaling / linear interpolation are three ways to "
                             "scale rope: give one of them")
        if self.rotary_scaling_factor <= 0 or self.yarn_beta_fast <= 0 or self.yarn_beta_slow <= 0:
            raise ValueError(f"YaRN needs rotary_scaling_factor, yarn_beta_fast and yarn_beta_slow > 0, got "
                             f"{self.rotary_scaling_factor}, {self.yarn_beta_fast}, {self.yarn_beta_slow}")

    def _validate_window(self) -> None:
        if self.softmax_type not in SOFTMAX_TYPES:
            raise ValueError(f"softmax_type must be one of {SOFTMAX_TYPES}, got {self.softmax_type!r}")
        window, freq = self.window_size, self.window_attn_skip_freq
        if window is None:
            if freq is not None:
                raise ValueError(f"window_attn_skip_freq {freq} needs window_size (--window-size LEFT,RIGHT)")
            return
        if len(window) != 2 or any(not isinstance(w, int) or w < -1 for w in window):
            raise ValueError(f"window_size must be two integers (left, right), each >= 0 (-1: unbounded), got "
                             f"{window}")
        if window[1] not in (0, -1):
            raise ValueError(f"window_size {tuple(window)} looks right of each token; a causal decoder needs "
                             "right 0 (e.g. --window-size 127,0)")
        if isinstance(freq, int) and freq < 1:
            raise ValueError(f"window_attn_skip_freq must be >= 1 or a 0/1 list per layer, got {freq}")
        if isinstance(freq, list) and (len(freq) != self.num_layers or any(f not in (0, 1) for f in freq)):
            raise ValueError(f"window_attn_skip_freq {freq} must have one 0/1 entry per layer ({self.num_layers} "
                             "layers)")

    def _validate_gpt_oss_activation(self) -> None:
        clamp = self.activation_func_clamp_value
        gated = self.activation in ("swiglu", "quick_geglu")
        if clamp is not None and (not gated or not math.isfinite(clamp) or clamp <= 0):
            raise ValueError(f"activation_func_clamp_value {clamp} needs a gated activation (swiglu or quick_geglu) "
                             "and a finite value > 0")
        if self.glu_linear_offset != 0.0 and not gated:
            raise ValueError(f"glu_linear_offset {self.glu_linear_offset} needs a gated activation (swiglu or "
                             f"quick_geglu), got activation {self.activation!r}")


__all__ = ["ArchitectureVariants", "yarn_get_mscale", "SOFTMAX_TYPES", "ROPE_TYPES"]
