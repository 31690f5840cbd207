"""GPTModel: embedding on the first pipeline stage, transformer layers, output layer and loss on the last."""
from __future__ import annotations

from typing import Optional, Sequence, Union

import torch
from torch import nn

from megatron_core.config import TransformerConfig
from megatron_core.models.embedding import WORD_EMBEDDING_SEED_OFFSET, LanguageModelEmbedding, padded_vocab_init
from megatron_core.models.mtp import MultiTokenPrediction
from megatron_core.parallel_state import ParallelState
from megatron_core.tensor_parallel import (
    ColumnParallelLinear,
    check_ids_in_range,
    gather_from_tensor_model_parallel_region,
    vocab_parallel_cross_entropy,
    vocab_range,
    vocab_size_with_padding,
)
from megatron_core.transformer.block import TransformerBlock, seeded_init
from megatron_core.transformer.inference_cache import InferenceCache
from megatron_core.transformer.moe.losses import attach_loss
from megatron_core.transformer.rope import RotaryEmbedding
from megatron_core.transformer.spec import TransformerLayerSpec
from megatron_core.transformer.specs import layer_spec_for

OUTPUT_LAYER_SEED_OFFSET = 2


class GPTModel(nn.Module):
    """A GPT decoder, or the part of it that one pipeline stage (model chunk) holds.

    Args:
        config: the architecture; its parallel sizes must match ``parallel_state``.
        parallel_state: the layout (groups, ranks, device).
        vocab_size: the tokenizer's true vocab. The embedding and output layer are padded to a multiple of
            ``make_vocab_size_divisible_by * tp`` (Megatron); padded logits are masked to -inf, so they
            never affect the loss or predictions, and padded rows start at zero.
        max_sequence_length: positions of the learned position embedding.
        pre_process: this chunk holds the embedding (first stage); post_process: the output layer (last).
        share_embeddings_and_output_weights: tie the output layer to the word embedding (unless
            ``config.untie_embeddings_and_output_weights``). Across pipeline stages the last stage keeps a
            copy, initialized identically; ``finalize_model_grads`` sums the two grads over the embedding group.
        parallel_output: return logits split over tp ``[b, s, V_padded/tp]``; otherwise gathered and cut to
            the true vocab ``[b, s, vocab_size]``.
        layer_spec: the submodule classes of each layer (default ``layer_spec_for(config)``: GPT's, with MLA
            and MoE layers where the config has them).
        vp_stage: the model chunk index with interleaved pipelining.

    Initialization is layout-independent: one number drawn from the default generator seeds every module
    by its global identity (embedding, layer number, output layer).

    Multi-token prediction (``config.mtp_num_layers``): the last stage holds ``mtp`` (``models.mtp``) and, at
    pp > 1, its own copy of the embedding (initialized identically; its grads are summed with the first
    stage's over the embedding group). It runs in training mode when labels are given (never for logits or
    with ``inference_cache``); its loss enters backward through the returned main loss, which it leaves
    unchanged, with the gradient ``mtp.loss_scale`` (1 by default): a caller that scales the main loss before
    backward (gradient accumulation, fp16) sets the same scale with ``models.mtp.set_mtp_loss_scale``.
    """

    def __init__(self, config: TransformerConfig, *, parallel_state: ParallelState, vocab_size: int,
                 max_sequence_length: int, pre_process: bool = True, post_process: bool = True,
                 share_embeddings_and_output_weights: bool = True, parallel_output: bool = True,
                 layer_spec: Optional[TransformerLayerSpec] = None, vp_stage: Optional[int] = None,
                 make_vocab_size_divisible_by: int = 128) -> None:
        super().__init__()
        config = config.bind_layout(parallel_state)  # the layout sizes come from the state
        self.config, self.parallel_state = config, parallel_state
        self.pre_process, self.post_process, self.parallel_output = pre_process, post_process, parallel_output
        self.vocab_size = vocab_size
        self.padded_vocab_size = vocab_size_with_padding(
            vocab_size, make_vocab_size_divisible_by=make_vocab_size_divisible_by,
            tensor_model_parallel_size=parallel_state.tp_size)
        self.share_embeddings_and_output_weights = (share_embeddings_and_output_weights
                                                    and not config.untie_embeddings_and_output_weights)
        base_seed = int(torch.randint(0, 2**31 - 1, (1,)).item())  # the same on every rank and layout
        self.mtp_process = post_process and config.mtp_num_layers is not None
        if pre_process or self.mtp_process:  # MTP embeds the tokens ahead on the last stage
            self.embedding = LanguageModelEmbedding(
                config, parallel_state=parallel_state, vocab_size=vocab_size,
                padded_vocab_size=self.padded_vocab_size, max_sequence_length=max_sequence_length,
                base_seed=base_seed)
        self.rotary_pos_emb = (RotaryEmbedding(config.rotary_dim, rotary_base=config.rotary_base,
                                               seq_len_interpolation_factor=config.rotary_seq_len_interpolation_factor,
                                               rope_scaling=config.llama3_rope_scaling,
                                               interleaved=config.rotary_interleaved,
                                               yarn=config.yarn_rope_scaling)
                               if config.position_embedding_type == "rope" else None)
        spec = layer_spec or layer_spec_for(config)
        self.decoder = TransformerBlock(config, parallel_state=parallel_state, spec=spec,
                                        base_seed=base_seed, pre_process=pre_process, post_process=post_process,
                                        vp_stage=vp_stage)
        if self.mtp_process:
            self.mtp = MultiTokenPrediction(config, parallel_state=parallel_state, spec=spec, base_seed=base_seed)
        if post_process:
            self.output_layer = self._build_output_layer(base_seed)
        self._tag_shared_embedding()

    def _build_output_layer(self, base_seed: int) -> ColumnParallelLinear:
        config, state = self.config, self.parallel_state
        tied = self.share_embeddings_and_output_weights
        offset = WORD_EMBEDDING_SEED_OFFSET if tied else OUTPUT_LAYER_SEED_OFFSET  # a tied copy equals the embedding
        with seeded_init(base_seed, offset):
            return ColumnParallelLinear(
                config.hidden_size, self.padded_vocab_size, tp_group=state.tp_group, bias=False,
                sequence_parallel=config.sequence_parallel, tp_comm_overlap=config.tp_comm_overlap,
                params_dtype=config.params_dtype, device=state.device,
                init_method=padded_vocab_init(config.init_method_std, self.vocab_size),
                skip_weight_param_allocation=tied and hasattr(self, "embedding"),
                weight_grad_store=state.weight_grad_store)

    def _tag_shared_embedding(self) -> None:
        """Marks the weights both the first and the last stage hold (the tied word embedding; with MTP at
        pp > 1 the word and position embeddings), whose grads are summed over the embedding group."""
        for param in self._shared_embedding_params():
            param.shared_embedding = True

    def _shared_embedding_params(self) -> list:
        tied, mtp = self.share_embeddings_and_output_weights, self.config.mtp_num_layers is not None
        if self.pre_process and self.post_process:  # one stage: only a tied weight is marked (as before MTP)
            return [self.embedding.word_embeddings.weight] if tied else []
        if self.pre_process or self.mtp_process:  # the embedding of the first stage, or the last stage's copy
            if not mtp:
                return [self.embedding.word_embeddings.weight] if tied else []
            positions = self.embedding.position_embeddings
            return [self.embedding.word_embeddings.weight] + ([positions.weight] if positions is not None else [])
        return [self.output_layer.weight] if self.post_process and tied else []

    def set_input_tensor(self, input_tensor: Union[torch.Tensor, Sequence[torch.Tensor], None]) -> None:
        """The activation ``[s, b, h]`` (``[s/tp, b, h]``) received from the previous pipeline stage."""
        if isinstance(input_tensor, (list, tuple)):
            if len(input_tensor) != 1:
                raise ValueError(f"GPTModel takes one input tensor per stage, got {len(input_tensor)}")
            input_tensor = input_tensor[0]
        self.decoder.set_input_tensor(input_tensor)

    def forward(self, input_ids: Optional[torch.Tensor], position_ids: Optional[torch.Tensor],
                attention_mask: Optional[torch.Tensor] = None, labels: Optional[torch.Tensor] = None,
                inference_cache: Optional[InferenceCache] = None,
                loss_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Token ids and positions ``[b, s]``; attention_mask None (causal) or boolean ``[b, 1, s, s]`` with
        True = masked out; labels ``[b, s]``. With ``inference_cache`` (incremental decoding) the tokens are
        the new ones only, they attend to every cached position, position_ids default to
        ``offset .. offset + s - 1``, and the cache's offset advances by s. ``loss_mask`` ``[b, s]`` (default
        all ones): how the MTP losses average their tokens, as the caller averages the returned main loss.

        Returns: on the last stage, the per-token fp32 loss ``[b, s]`` when labels are given, else logits
        (see ``parallel_output``); on other stages, the hidden states ``[s, b, h]`` (``[s/tp, b, h]``)
        to send downstream.
        """
        if inference_cache is not None and input_ids is not None:
            inference_cache.check_room(input_ids.shape[1], input_ids.shape[0])
        if inference_cache is not None and position_ids is None and input_ids is not None:
            position_ids = inference_cache.offset + torch.arange(input_ids.shape[1], device=input_ids.device)
            position_ids = position_ids.unsqueeze(0).expand_as(input_ids)
        hidden = self.embedding(input_ids, position_ids) if self.pre_process else None
        rotary = None
        if self.rotary_pos_emb is not None:
            if position_ids is None:
                raise ValueError("rotary position embeddings need position_ids on every pipeline stage")
            rotary = self.rotary_pos_emb(position_ids)
        if inference_cache is None:
            hidden = self.decoder(hidden, attention_mask, rotary)
        else:
            hidden = self.decoder(hidden, attention_mask, rotary, inference_cache=inference_cache)
            inference_cache.offset += hidden.shape[0]
        if not self.post_process:
            return hidden
        if labels is None:
            logits = self._logits(hidden)
            if not self.parallel_output:
                logits = gather_from_tensor_model_parallel_region(logits, self.parallel_state.tp_group)
                logits = logits[..., : self.vocab_size]
            return logits.transpose(0, 1).contiguous()  # [b, s, V]
        check_ids_in_range(labels, self.vocab_size, "labels")
        loss = self._per_token_loss(hidden, labels)
        if self.mtp_process and self.training and inference_cache is None:
            loss = attach_loss(loss, self._mtp_loss(hidden, input_ids, position_ids, labels, loss_mask,
                                                    attention_mask, rotary), scale=self.mtp.loss_scale)
        return loss

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The output layer: ``[s(/tp), b, h] -> [s, b, V_padded/tp]``, padded vocab entries at -inf."""
        weight = self.embedding.word_embeddings.weight if self.output_layer.weight is None else None
        logits, _ = self.output_layer(hidden, weight=weight)  # [s, b, V_padded/tp]
        return self._mask_padded_vocab(logits)

    def _per_token_loss(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Vocab-parallel cross entropy of the output layer's logits: hidden, labels ``[b, s]`` -> fp32 ``[b, s]``."""
        loss = vocab_parallel_cross_entropy(self._logits(hidden), labels.t(), tp_group=self.parallel_state.tp_group,
                                            kernel_backend=self.parallel_state.kernel_backend)  # [s, b]
        return loss.t().contiguous()

    def _mtp_loss(self, hidden, input_ids, position_ids, labels, loss_mask, attention_mask, rotary) -> torch.Tensor:
        """``F / N * sum_k`` of the MTP depths' loss-mask averages (``models.mtp``)."""
        if input_ids is None or position_ids is None:
            raise ValueError("multi-token prediction (mtp_num_layers "
                             f"{self.config.mtp_num_layers}) needs input_ids and position_ids on the last "
                             "pipeline stage: pass the micro-batch's tokens and positions to every stage")
        if loss_mask is None:
            loss_mask = torch.ones(labels.shape, dtype=torch.float32, device=labels.device)
        return self.mtp(hidden, input_ids=input_ids, position_ids=position_ids, labels=labels, loss_mask=loss_mask,
                        embedding=self.embedding, per_token_loss=self._per_token_loss,
                        attention_mask=attention_mask, rotary_pos_emb=rotary)

    def _mask_padded_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """Sets the logits of padded vocab entries held by this rank to -inf."""
        start, end = vocab_range(self.padded_vocab_size, self.parallel_state.tp_rank, self.parallel_state.tp_size)
        first_padded = max(self.vocab_size - start, 0)
        if first_padded >= end - start:
            return logits
        return torch.cat([logits[..., :first_padded], torch.full_like(logits[..., first_padded:], float("-inf"))], -1)
