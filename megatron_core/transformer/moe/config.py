"""``MoEConfig``: the mixture-of-experts settings of a model (Megatron-LM's ``num_moe_experts`` / ``moe_*`` names).

It hangs off ``TransformerConfig.moe``; ``None`` there means a dense model. Layout sizes (expert parallelism)
are not stored here: they come from the ``ParallelState`` the layer is built with.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional, Union

import torch

LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none")
SCORE_FUNCTIONS = ("softmax", "sigmoid")
DISPATCHERS = ("alltoall", "allgather")
DROP_POLICIES = ("probs", "position")


@dataclasses.dataclass(kw_only=True)
class MoEConfig:
    """Settings of the MoE layers (validated in ``__post_init__``: ValueError naming the value and the fix)."""

    num_moe_experts: int
    """Routed experts per MoE layer (``--num-experts``)."""
    moe_router_topk: int = 2
    """Experts each token is sent to."""
    moe_router_load_balancing_type: str = "aux_loss"
    """``aux_loss`` (Switch/GShard over the micro-batch), ``seq_aux_loss`` (per sequence, DeepSeek-V2),
    ``global_aux_loss`` (the counts of the global batch so far: over dp and the step's micro-batches), ``sinkhorn``
    or ``none``."""
    moe_aux_loss_coeff: float = 0.0
    moe_z_loss_coeff: Optional[float] = None
    """Router z-loss (ST-MoE) coefficient; None or 0 = off."""
    moe_router_score_function: str = "softmax"
    moe_router_pre_softmax: bool = False
    """softmax over all experts before top-k (else softmax over the k selected logits)."""
    moe_router_enable_expert_bias: bool = False
    """Aux-loss-free balancing (DeepSeek-V3): a per-expert bias, not trained, added to the scores for the
    selection only and nudged by ``moe_router_bias_update_rate`` towards balance after every step."""
    moe_router_bias_update_rate: float = 1e-3
    moe_router_num_groups: Optional[int] = None
    """Group-limited (device/node-limited) routing, DeepSeek-V2/V3: the experts form this many groups of
    consecutive ids; each token picks ``moe_router_group_topk`` groups (by the sum of each group's top
    ``topk // group_topk`` scores) and its experts among theirs only."""
    moe_router_group_topk: Optional[int] = None
    moe_router_topk_scaling_factor: Optional[float] = None
    """The chosen experts' weights are multiplied by this (DeepSeek's ``routed_scaling_factor``)."""
    moe_router_force_load_balancing: bool = False
    """Benchmarking only (Megatron-LM's flag): the router's logits are replaced by random normal values (drawn
    from the model-parallel RNG state), gradients pass straight through."""
    moe_router_dtype: Optional[str] = None
    """``fp32`` / ``fp64``: compute the router logits, scores and aux losses in that dtype."""
    moe_token_dispatcher_type: str = "allgather"
    """"allgather" (Megatron-LM's default) or "alltoall"."""
    moe_grouped_gemm: bool = False
    """Run the local experts as one batched matmul over padded token groups instead of a loop."""
    moe_expert_capacity_factor: Optional[float] = None
    """None: dropless. Else each expert keeps at most ``ceil(tokens * topk / experts * factor)`` tokens."""
    moe_pad_expert_input_to_capacity: bool = False
    """With a capacity factor: every expert processes exactly its capacity (padding with zero-weight tokens)."""
    moe_token_drop_policy: str = "probs"
    moe_ffn_hidden_size: Optional[int] = None
    """Hidden size of each routed expert; default the model's ffn_hidden_size."""
    moe_shared_expert_intermediate_size: Optional[int] = None
    """Hidden size of the shared expert (all tokens, tensor-parallel like the dense MLP); None = none."""
    moe_layer_freq: Union[int, list[int]] = 1
    """Every n-th layer is MoE (``1``: all), or one 0/1 entry per layer."""
    moe_per_layer_logging: bool = False

    def __post_init__(self) -> None:
        experts, topk = self.num_moe_experts, self.moe_router_topk
        if not isinstance(experts, int) or experts < 1:
            raise ValueError(f"num_moe_experts must be an integer >= 1, got {experts!r}")
        if not 1 <= topk <= experts:
            raise ValueError(f"moe_router_topk {topk} must lie in [1, num_moe_experts {experts}]: a token cannot "
                             "be sent to more experts than there are; lower --moe-router-topk or add experts")
        choices = {"moe_router_load_balancing_type": LOAD_BALANCING_TYPES,
                   "moe_router_score_function": SCORE_FUNCTIONS, "moe_token_dispatcher_type": DISPATCHERS,
                   "moe_token_drop_policy": DROP_POLICIES, "moe_router_dtype": (None, "fp32", "fp64")}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        factor = self.moe_expert_capacity_factor
        if factor is not None and factor <= 0:
            raise ValueError(f"moe_expert_capacity_factor must be > 0 (or None for dropless), got {factor}")
        if self.moe_pad_expert_input_to_capacity and factor is None:
            raise ValueError("moe_pad_expert_input_to_capacity needs moe_expert_capacity_factor: padding is to "
                             "the capacity; give --moe-expert-capacity-factor")
        if self.moe_router_enable_expert_bias and self.moe_router_score_function != "sigmoid":
            raise ValueError("moe_router_enable_expert_bias works with moe_router_score_function 'sigmoid' (as "
                             f"in Megatron-LM), got {self.moe_router_score_function!r}")
        if self.moe_router_load_balancing_type == "sinkhorn" and (
                self.moe_aux_loss_coeff > 0 or self.moe_router_score_function != "softmax"
                or self.moe_router_enable_expert_bias):
            raise ValueError("sinkhorn routing balances the experts itself (as in Megatron-LM): it takes no aux loss, "
                             f"expert bias or other score function; got moe_aux_loss_coeff {self.moe_aux_loss_coeff}, "
                             f"score function {self.moe_router_score_function!r}, expert bias "
                             f"{self.moe_router_enable_expert_bias}")
        if self.moe_aux_loss_coeff < 0 or (self.moe_z_loss_coeff or 0.0) < 0:
            raise ValueError(f"moe_aux_loss_coeff {self.moe_aux_loss_coeff} and moe_z_loss_coeff "
                             f"{self.moe_z_loss_coeff} must be >= 0")
        self._validate_groups()
        for name in ("moe_ffn_hidden_size", "moe_shared_expert_intermediate_size"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1 or None, got {getattr(self, name)}")

    def _validate_groups(self) -> None:
        groups, group_topk = self.moe_router_num_groups, self.moe_router_group_topk
        factor = self.moe_router_topk_scaling_factor
        if factor is not None and factor <= 0:
            raise ValueError(f"moe_router_topk_scaling_factor must be > 0 (or None), got {factor}")
        if groups is None and group_topk is None:
            return
        values = (f"moe_router_num_groups {groups}, moe_router_group_topk {group_topk}, num_moe_experts "
                  f"{self.num_moe_experts}, moe_router_topk {self.moe_router_topk}")
        if groups is None or group_topk is None or groups < 1 or not 1 <= group_topk <= groups:
            raise ValueError(f"group-limited routing needs both --moe-router-num-groups and --moe-router-group-topk, "
                             f"with 1 <= group_topk <= num_groups ({values})")
        if self.num_moe_experts % groups or self.moe_router_topk % group_topk:
            raise ValueError(f"group-limited routing needs num_moe_experts divisible by num_groups and topk by "
                             f"group_topk ({values})")
        if self.moe_router_topk // group_topk > self.num_moe_experts // groups:
            raise ValueError(f"each chosen group scores its top topk/group_topk experts, more than a group holds "
                             f"({values})")
        if self.moe_router_load_balancing_type == "sinkhorn":
            raise ValueError("group-limited routing does not combine with sinkhorn routing (Megatron-LM neither)")

    def is_moe_layer(self, layer_number: int, num_layers: int) -> bool:
        """Whether global layer ``layer_number`` (1-based) is an MoE layer under ``moe_layer_freq``."""
        freq = self.moe_layer_freq
        if isinstance(freq, int):
            if freq < 1:
                raise ValueError(f"moe_layer_freq must be >= 1 or a list of 0/1 per layer, got {freq}")
            return (layer_number - 1) % freq == 0
        if len(freq) != num_layers or any(f not in (0, 1) for f in freq):
            raise ValueError(f"moe_layer_freq {freq} must have one 0/1 entry per layer ({num_layers} layers)")
        return bool(freq[layer_number - 1])

    def capacity(self, num_tokens: int) -> Optional[int]:
        """Tokens per expert for ``num_tokens`` local tokens (Megatron's ``get_capacity``); None when dropless."""
        if self.moe_expert_capacity_factor is None:
            return None
        per_expert = num_tokens * self.moe_router_topk / self.num_moe_experts
        return math.ceil(per_expert * self.moe_expert_capacity_factor)

    @property
    def router_dtype(self) -> Optional[torch.dtype]:
        return {"fp32": torch.float32, "fp64": torch.float64}.get(self.moe_router_dtype)

    @property
    def has_aux_loss(self) -> bool:
        return self.moe_router_load_balancing_type not in ("none", "sinkhorn") and self.moe_aux_loss_coeff > 0
