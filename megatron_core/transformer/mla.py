"""Multi-latent attention (DeepSeek-V2/V3, arXiv 2405.04434; Megatron-LM's ``MLASelfAttention``): keys and values
are up-projected from one small joint latent per token, queries optionally from a low-rank latent too, and a few
rotary channels per head carry the position, the key's shared by every head.

Per token (``r = kv_lora_rank``, ``p = qk_pos_emb_head_dim``, ``dn = qk_head_dim``, ``dv = v_head_dim``)::

    q     = linear_q_proj(x)                                   or linear_q_up_proj(q_layernorm(linear_q_down_proj(x)))
    [c; k_pe] = linear_kv_down_proj(x)                         c [r], k_pe [p] (one head, shared)
    [k_nope; v] per head = linear_kv_up_proj(kv_layernorm(c))  [heads * (dn + dv)]
    q = [q_nope; rope(q_pe)] per head, k = [k_nope; rope(k_pe)], attention, linear_proj

Parameter layouts are Megatron's (and transformers' ``DeepseekV3Attention``'s, row for row): ``linear_q_*`` rows
per head ``[q_nope (dn); q_pe (p)]``, ``linear_kv_down_proj`` rows ``[latent (r); k_pe (p)]``, ``linear_kv_up_proj``
rows per head ``[k_nope (dn); v (dv)]``. Tensor parallelism cuts the up projections and ``linear_proj`` over whole
heads; the down projections and their norms are replicated on every tp rank. As in Megatron only ``linear_proj``
has a bias (``add_bias_linear``).

Sequence parallelism: the input is ``[s/tp, b, h]``. The replicated down projections and norms run on the local
chunk only (no gather of the hidden states), and the up projections are sequence-parallel column-parallel layers:
they all-gather the small latents (``q_lora_rank`` and ``kv_lora_rank`` channels instead of ``hidden_size``) and
reduce-scatter their grads; ``k_pe`` (p channels) is all-gathered the same way. The replicated weights then see
only this rank's tokens: they carry ``sequence_parallel = True`` and ``finalize_model_grads`` sums their grads
over tp (as the layer norms').
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from megatron_core.config import TransformerConfig
from megatron_core.fp8.config import Fp8Config, layer_fp8
from megatron_core.fp8.linear import fp8_linear, layer_plan, scaling_state
from megatron_core.fp8.param_gather import tag_weight
from megatron_core.parallel_state import ParallelState
from megatron_core.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    checkpoint,
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    init_method_normal,
    scaled_init_method_normal,
    set_tensor_model_parallel_attributes,
)
from megatron_core.tensor_parallel.initialization import InitMethod, InitRecipe, init_method_constant, init_param_
from megatron_core.tensor_parallel.weight_grad_store import WeightGradStore, linear_deferrable
from megatron_core.transformer.attention import DotProductAttention
from megatron_core.transformer.inference_cache import InferenceCache, check_cache_inputs
from megatron_core.transformer.norms import Norm
from megatron_core.transformer.rope import apply_rotary_pos_emb


class ReplicatedLinear(nn.Module):
    """``Y = X W^T (+ b)`` with the whole ``W [output_size, input_size]`` on every tp rank (Megatron's
    "duplicated" linear). forward: ``[..., input_size]`` -> ``(output [..., output_size], None)``. No
    communication.

    Its parameters are tagged replicated (``tensor_model_parallel = False``) and, with ``sequence_parallel``
    (each tp rank feeds only its chunk of the sequence), ``sequence_parallel = True``: ``finalize_model_grads``
    all-reduces their grads over tp. The weight gets a layout-independent init recipe (meta-device builds).

    With ``fp8`` the GEMMs run in FP8 (``megatron_core.fp8``). Under sequence parallelism the input and the
    output grad hold only this rank's tokens: the tensorwise recipe all-reduces their amaxes with MAX over
    ``tp_group`` (forward / backward), so the scales are the whole sequence's, as at tp 1."""

    def __init__(self, input_size: int, output_size: int, *, init_method: InitMethod, sequence_parallel: bool,
                 bias: bool = False, params_dtype: torch.dtype = torch.float32, device=None,
                 weight_grad_store: Optional[WeightGradStore] = None, fp8: Optional[Fp8Config] = None,
                 tp_group=None) -> None:
        super().__init__()
        self.input_size, self.output_size, self.weight_grad_store = input_size, output_size, weight_grad_store
        self.sequence_parallel, self.tp_group = sequence_parallel, tp_group
        self.fp8, self.fp8_state = fp8, scaling_state(fp8, device=device)
        self.weight = nn.Parameter(torch.empty(output_size, input_size, dtype=params_dtype, device=device))
        init_param_(self.weight, (output_size, input_size), init_method=init_method)
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.zeros(output_size, dtype=params_dtype, device=device))
            self.bias.init_recipe = InitRecipe(0, init_method_constant(0.0), (output_size,))
        for param in self.parameters():
            set_tensor_model_parallel_attributes(param, is_parallel=False, dim=-1, stride=1)
            param.sequence_parallel = sequence_parallel
        tag_weight(self.weight, fp8, self.fp8_state)  # replicated: the amax needs no tp reduction

    def forward(self, input_: torch.Tensor):
        if input_.shape[-1] != self.input_size:
            raise ValueError(f"ReplicatedLinear expects an input whose last dim is input_size = {self.input_size}, "
                             f"got shape {tuple(input_.shape)}")
        if self.fp8 is not None:
            plan = layer_plan(self.fp8, self.fp8_state, training=self.training, tp_group=self.tp_group,
                              split_roles=("input", "grad_output") if self.sequence_parallel else ())
            return fp8_linear(input_, self.weight, self.bias, plan, weight_grad_store=self.weight_grad_store), None
        return linear_deferrable(input_, self.weight, self.bias, self.weight_grad_store), None

    def extra_repr(self) -> str:
        return f"input_size={self.input_size}, output_size={self.output_size}, bias={self.bias is not None}"


class MLASelfAttention(nn.Module):
    """Pre-normed hidden states -> multi-latent attention output, tensor-parallel over heads (see the module
    docstring for the projections and the sequence-parallel scheme).

    forward: hidden ``[s, b, h]`` (``[s/tp, b, h]`` with sequence parallelism; this cp rank's tokens with context
    parallelism), attention_mask (see ``DotProductAttention``), rotary angles ``[s, b, 1, qk_pos_emb_head_dim]``
    (``RotaryEmbedding(config.rotary_dim)``, YaRN's frequencies) or None -> ``(output, bias)`` with output
    ``[s, b, h]`` (``[s/tp, b, h]``) all-reduced (reduce-scattered) over tp and linear_proj's bias (or None).

    Communication, forward: the up projections' all-gathers of the latents and the all-gather of ``k_pe`` along
    s (sequence parallelism; without it an identity whose backward all-reduces over tp), the core attention's
    context-parallel scheme, ``linear_proj``'s all-reduce (reduce-scatter). Backward: the reverse of each. With
    context parallelism the value head dim is zero-padded to the query's around the core attention (``attend``).

    Selective recompute: ``"mla_up_proj"`` checkpoints the up projections, rope and concatenation (its inputs,
    the latents, are kept); with ``"core_attn"`` as well one checkpoint covers both, so the expanded per-head keys
    and values are never stored; ``"core_attn"`` alone checkpoints the core attention.

    With an ``inference_cache`` the cache keeps, per token and layer, the normed key/value latent
    (``kv_lora_rank``) and the roped shared key (``qk_pos_emb_head_dim``), not the per-head keys and values; the
    prompt's latents are up-projected, later steps attend over the latents with the up projection absorbed
    into the query and output (``decode``; no sequence or context parallelism, causal mask only).

    FP8 (``layer_fp8(config, layer_number)``): every projection, the replicated down projections included, runs
    its GEMMs in FP8; the norms, rope, core attention and the absorbed decoding (which reads
    ``linear_kv_up_proj.weight`` itself) stay in high precision.
    """

    def __init__(self, config: TransformerConfig, *, layer_number: int, parallel_state: ParallelState,
                 core_attention: type[nn.Module] = DotProductAttention) -> None:
        super().__init__()
        if not config.multi_latent_attention:
            raise ValueError("MLASelfAttention needs config.multi_latent_attention=True (--multi-latent-attention) "
                             "for its sizes; use SelfAttention otherwise")
        self.config, self.layer_number = config, layer_number
        self.rng_tracker = parallel_state.rng_tracker  # replayed by selective recompute
        self.tp_group, self.cp_size = parallel_state.tp_group, parallel_state.cp_size
        self.rope_mscale = config.rope_attention_factor  # YaRN's cos/sin factor, computed once
        self.heads_per_rank = config.num_attention_heads // parallel_state.tp_size
        self.q_head_dim = config.qk_head_dim + config.qk_pos_emb_head_dim
        common = dict(tp_group=parallel_state.tp_group, sequence_parallel=config.sequence_parallel,
                      tp_comm_overlap=config.tp_comm_overlap, params_dtype=config.params_dtype,
                      device=parallel_state.device, weight_grad_store=parallel_state.weight_grad_store,
                      fp8=layer_fp8(config, layer_number))
        self._build_query(config, parallel_state, common)
        self._build_key_value(config, parallel_state, common)
        self.core_attention = core_attention(config, layer_number=layer_number, parallel_state=parallel_state)
        self.linear_proj = RowParallelLinear(
            config.num_attention_heads * config.v_head_dim, config.hidden_size, bias=config.add_bias_linear,
            input_is_parallel=True, skip_bias_add=True,
            init_method=scaled_init_method_normal(config.init_method_std, config.num_layers), **common)

    @staticmethod
    def _replicated(config: TransformerConfig, state: ParallelState, in_size: int, out_size: int,
                    fp8: Optional[Fp8Config]) -> ReplicatedLinear:
        return ReplicatedLinear(in_size, out_size, init_method=init_method_normal(config.init_method_std),
                                sequence_parallel=config.sequence_parallel, params_dtype=config.params_dtype,
                                device=state.device, weight_grad_store=state.weight_grad_store, fp8=fp8,
                                tp_group=state.tp_group)

    @staticmethod
    def _norm(config: TransformerConfig, state: ParallelState, size: int) -> Optional[nn.Module]:
        """The latent's norm when ``qk_layernorm`` (Megatron's rule); tagged ``sequence_parallel`` by ``Norm``."""
        if not config.qk_layernorm:
            return None
        return Norm(config, size, device=state.device, kernel_backend=state.kernel_backend)

    def _build_query(self, config: TransformerConfig, state: ParallelState, common: dict) -> None:
        init = init_method_normal(config.init_method_std)
        out_size = config.num_attention_heads * self.q_head_dim
        self.linear_q_proj = self.linear_q_down_proj = self.q_layernorm = self.linear_q_up_proj = None
        if config.q_lora_rank is None:
            self.linear_q_proj = ColumnParallelLinear(config.hidden_size, out_size, bias=False, init_method=init,
                                                      **common)
            return
        self.linear_q_down_proj = self._replicated(config, state, config.hidden_size, config.q_lora_rank,
                                                   common["fp8"])
        self.q_layernorm = self._norm(config, state, config.q_lora_rank)
        self.linear_q_up_proj = ColumnParallelLinear(config.q_lora_rank, out_size, bias=False, init_method=init,
                                                     **common)

    def _build_key_value(self, config: TransformerConfig, state: ParallelState, common: dict) -> None:
        self.linear_kv_down_proj = self._replicated(config, state, config.hidden_size,
                                                    config.kv_lora_rank + config.qk_pos_emb_head_dim, common["fp8"])
        self.kv_layernorm = self._norm(config, state, config.kv_lora_rank)
        self.linear_kv_up_proj = ColumnParallelLinear(
            config.kv_lora_rank, config.num_attention_heads * (config.qk_head_dim + config.v_head_dim), bias=False,
            init_method=init_method_normal(config.init_method_std), **common)

    # -- the down projections: this rank's tokens, replicated weights ------------------------------------------

    def compress(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """hidden ``[s_local, b, h]`` -> ``(q_input, kv_latent, k_pe)``: the query's normed latent
        ``[s_local, b, q_lora_rank]`` (the hidden states themselves without ``q_lora_rank``), the normed key/value
        latent ``[s_local, b, kv_lora_rank]`` and the shared rotary key ``[s_local, b, qk_pos_emb_head_dim]``
        (not yet rotated). No communication."""
        q_input = hidden
        if self.linear_q_down_proj is not None:
            q_input, _ = self.linear_q_down_proj(hidden)
            if self.q_layernorm is not None:
                q_input = self.q_layernorm(q_input)
        compressed, _ = self.linear_kv_down_proj(hidden)
        kv_latent, k_pe = torch.split(compressed, [self.config.kv_lora_rank, self.config.qk_pos_emb_head_dim], -1)
        if self.kv_layernorm is not None:
            kv_latent = self.kv_layernorm(kv_latent)
        return q_input, kv_latent, k_pe

    # -- the up projections: every token of the sequence, this rank's heads -----------------------------------

    def _rope(self, x: torch.Tensor, rotary_pos_emb: Optional[torch.Tensor]) -> torch.Tensor:
        if rotary_pos_emb is None:
            return x
        return apply_rotary_pos_emb(x, rotary_pos_emb, interleaved=self.config.rotary_interleaved,
                                    mscale=self.rope_mscale)

    def project_query(self, q_input: torch.Tensor, rotary_pos_emb: Optional[torch.Tensor]) -> torch.Tensor:
        """``[s_local, b, q_lora_rank or h]`` -> query ``[s, b, heads/tp, qk_head_dim + qk_pos_emb_head_dim]``,
        its last ``qk_pos_emb_head_dim`` channels rotated. Communication: the column-parallel layer's."""
        layer = self.linear_q_proj if self.linear_q_proj is not None else self.linear_q_up_proj
        query, _ = layer(q_input)  # [s, b, heads/tp * (dn + p)]
        query = query.view(*query.shape[:2], self.heads_per_rank, self.q_head_dim)
        q_nope, q_pe = torch.split(query, [self.config.qk_head_dim, self.config.qk_pos_emb_head_dim], dim=-1)
        return torch.cat([q_nope, self._rope(q_pe, rotary_pos_emb)], dim=-1)

    def shared_key_pe(self, k_pe: torch.Tensor, rotary_pos_emb: Optional[torch.Tensor]) -> torch.Tensor:
        """``[s_local, b, p]`` -> the rotated shared key ``[s, b, p]``. Forward: all-gather along s with sequence
        parallelism (backward: reduce-scatter), else identity (backward: all-reduce over tp; each rank's heads
        give a partial grad)."""
        if self.config.sequence_parallel:
            k_pe = gather_from_sequence_parallel_region(k_pe, self.tp_group)
        else:
            k_pe = copy_to_tensor_model_parallel_region(k_pe, self.tp_group)
        return self._rope(k_pe.unsqueeze(2), rotary_pos_emb).squeeze(2)

    def project_key_value(self, kv_latent: torch.Tensor, k_pe: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_latent ``[s_local, b, r]`` (all of the sequence's tokens when not sequence-parallel), the rotated
        k_pe ``[s, b, p]`` -> key ``[s, b, heads/tp, dn + p]`` (k_pe broadcast to every head) and value
        ``[s, b, heads/tp, dv]``. Communication: the column-parallel layer's."""
        kv, _ = self.linear_kv_up_proj(kv_latent)  # [s, b, heads/tp * (dn + dv)]
        kv = kv.view(*kv.shape[:2], self.heads_per_rank, self.config.qk_head_dim + self.config.v_head_dim)
        k_nope, value = torch.split(kv, [self.config.qk_head_dim, self.config.v_head_dim], dim=-1)
        k_pe = k_pe.unsqueeze(2).expand(-1, -1, self.heads_per_rank, -1)
        return torch.cat([k_nope, k_pe], dim=-1), value

    def expand(self, q_input: torch.Tensor, kv_latent: torch.Tensor, k_pe: torch.Tensor,
               rotary_pos_emb: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The outputs of ``compress`` -> ``(query, key, value)`` for the core attention (the "mla_up_proj"
        region)."""
        query = self.project_query(q_input, rotary_pos_emb)
        key, value = self.project_key_value(kv_latent, self.shared_key_pe(k_pe, rotary_pos_emb))
        return query, key, value

    def decode(self, q_input: torch.Tensor, kv_latent: torch.Tensor, k_pe: torch.Tensor,
               rotary_pos_emb: Optional[torch.Tensor], inference_cache: InferenceCache) -> torch.Tensor:
        """Attention of the new tokens over every cached one -> ``[s, b, heads/tp * v_head_dim]``, after
        appending the new tokens' latent and rotated k_pe to the cache. With nothing cached yet (the prompt) the
        latents are up-projected; later steps absorb the up projection instead (``_absorbed_attention``)."""
        attention_mask = inference_cache.attention_mask(q_input.shape[0], q_input.device)
        absorb = inference_cache.offset > 0
        query = self.project_query(q_input, rotary_pos_emb)
        k_pe = self.shared_key_pe(k_pe, rotary_pos_emb)
        kv_latent, k_pe = inference_cache.update_latent(self.layer_number, kv_latent, k_pe)  # [offset + s, b, ...]
        if absorb:
            return self._absorbed_attention(query, kv_latent, k_pe, attention_mask)
        return self.core_attention(query, *self.project_key_value(kv_latent, k_pe), attention_mask)

    def _absorbed_attention(self, query: torch.Tensor, latents: torch.Tensor, k_pe: torch.Tensor,
                            attention_mask: Optional[torch.Tensor]) -> torch.Tensor:
        """query ``[s, b, heads/tp, dn + p]`` over every cached latent ``[S, b, r]`` and k_pe ``[S, b, p]`` ->
        ``[s, b, heads/tp * dv]`` without up-projecting the cache (DeepSeek-V2's absorption): ``q_nope . W_k c =
        (W_k^T q_nope) . c`` and ``sum_j p_j W_v c_j = W_v sum_j p_j c_j``, so the heads attend over one shared
        key ``[c; k_pe]`` and value ``c``, and only the new tokens meet ``W_k``, ``W_v``. The heads become query
        rows of that one head (row ``i * heads + h``), so the shared key is never repeated per head. Reads
        ``linear_kv_up_proj.weight`` itself (parameters in place, as generation builds the model). No
        communication."""
        config, heads, rank = self.config, self.heads_per_rank, self.config.kv_lora_rank
        weight = self.linear_kv_up_proj.weight.view(heads, config.qk_head_dim + config.v_head_dim, rank)
        w_k, w_v = torch.split(weight, [config.qk_head_dim, config.v_head_dim], dim=1)
        q_nope, q_pe = torch.split(query, [config.qk_head_dim, config.qk_pos_emb_head_dim], dim=-1)
        query = torch.cat([torch.einsum("sbhd,hdr->sbhr", q_nope, w_k), q_pe], dim=-1)  # [s, b, heads/tp, r + p]
        s, b = query.shape[:2]
        rows = query.transpose(1, 2).reshape(s * heads, b, 1, -1)
        mask = attention_mask.unsqueeze(3).expand(-1, -1, -1, heads, -1).flatten(2, 3)  # [1, 1, s * heads, S]
        key = torch.cat([latents, k_pe], dim=-1).unsqueeze(2)  # [S, b, 1, r + p]
        context = self.core_attention(rows, key, latents.unsqueeze(2), mask)  # [s * heads, b, r]
        context = context.view(s, heads, b, rank).transpose(1, 2)  # [s, b, heads/tp, r]
        return torch.einsum("sbhr,hvr->sbhv", context, w_v).flatten(2)

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: Optional[torch.Tensor]) -> torch.Tensor:
        """The core attention -> ``[s, b, heads/tp * v_head_dim]``. Its eager single-rank paths take a value
        head dim that differs from the query's. The context-parallel schemes (``cp_comm_type`` p2p, a2a,
        allgather) move and attend over one head dim, and torch.compile's SDPA (torch 2.13 inductor) fails on
        permuted inputs with a narrower value: there the narrower of (q and k, v) is zero-padded (exact: zero
        channels add nothing to the scores, and zero value channels give zero output channels, cut off here).
        Communication: the core attention's."""
        dqk, dv = query.shape[-1], value.shape[-1]
        if dqk == dv or (self.cp_size == 1 and not torch.compiler.is_compiling()):
            return self.core_attention(query, key, value, attention_mask)
        width = max(dqk, dv)
        query, key, value = (F.pad(x, (0, width - x.shape[-1])) for x in (query, key, value))
        context = self.core_attention(query, key, value, attention_mask)  # [s, b, heads/tp * width]
        return context.view(*context.shape[:2], self.heads_per_rank, width)[..., :dv].flatten(2)

    def _expand_and_attend(self, q_input, kv_latent, k_pe, rotary_pos_emb, attention_mask):
        """One recompute region for "mla_up_proj" with "core_attn": ``[s, b, heads/tp * v_head_dim]``."""
        return self.attend(*self.expand(q_input, kv_latent, k_pe, rotary_pos_emb), attention_mask)

    def forward(self, hidden: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                rotary_pos_emb: Optional[torch.Tensor] = None, inference_cache: Optional[InferenceCache] = None):
        latents = self.compress(hidden)
        up_proj = self.config.recomputes("mla_up_proj") and torch.is_grad_enabled()
        core_attn = self.config.recomputes("core_attn")
        if inference_cache is not None:
            check_cache_inputs(attention_mask, sequence_parallel=self.config.sequence_parallel, cp_size=self.cp_size)
            context = self.decode(*latents, rotary_pos_emb, inference_cache)
        elif up_proj and core_attn:
            context = checkpoint(self._expand_and_attend, *latents, rotary_pos_emb, attention_mask,
                                 rng_tracker=self.rng_tracker)
        else:
            if up_proj:
                query, key, value = checkpoint(self.expand, *latents, rotary_pos_emb, rng_tracker=self.rng_tracker)
            else:
                query, key, value = self.expand(*latents, rotary_pos_emb)
            if core_attn:
                context = checkpoint(self.attend, query, key, value, attention_mask, rng_tracker=self.rng_tracker)
            else:
                context = self.attend(query, key, value, attention_mask)  # [s, b, heads/tp * dv]
        return self.linear_proj(context)


__all__ = ["MLASelfAttention", "ReplicatedLinear"]
