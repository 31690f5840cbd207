"""Tensor-parallel layers of Megatron-LM (arXiv 1909.08053): column- and row-parallel linear layers and the
vocab-parallel embedding, with the sequence-parallel variants of arXiv 2205.05198.

Initialization is layout-independent: each weight draws one seed from the default CPU generator and every
row of the full weight is drawn from that seed and its row number (``initialization``), so the same seed gives
the same full weight at any tp, and each rank computes only its own rows. On the meta device nothing is
drawn: the recipe is kept for ZeRO-3's sharded construction.

Every parameter records how it is split: ``tensor_model_parallel`` (bool), ``partition_dim`` (the dim cut
over tp ranks, -1 when replicated) and ``partition_stride`` (the number of interleaved blocks per shard, as
in a fused QKV weight). Replicated parameters whose gradients are partial per tp rank under sequence
parallelism (the row-parallel bias) also carry ``sequence_parallel = True``: their grads must be
all-reduced over tp.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from megatron_core.fp8 import comm_overlap as fp8_overlap  # modules: fp8 imports this package's utils
from megatron_core.fp8 import linear as fp8_ops
from megatron_core.fp8.config import Fp8Config
from megatron_core.fp8.param_gather import tag_weight
from megatron_core.tensor_parallel.comm_overlap import all_gather_linear, linear_reduce_scatter
from megatron_core.tensor_parallel.initialization import (
    InitMethod,
    InitRecipe,
    init_method_constant,
    init_method_normal,
    init_param_,
    scaled_init_method_normal,  # noqa: F401 (re-exported by megatron_core.tensor_parallel)
)
from megatron_core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from megatron_core.tensor_parallel.sequence_parallel_linear import sequence_parallel_linear
from megatron_core.tensor_parallel.utils import check_ids_in_range, divide, group_rank, group_size, vocab_range
from megatron_core.tensor_parallel.weight_grad_store import WeightGradStore, deferring_forward, linear_deferrable


def set_tensor_model_parallel_attributes(param: torch.Tensor, *, is_parallel: bool, dim: int, stride: int) -> None:
    """Records how ``param`` is split over tp ranks (read by grad-norm, checkpoints and converters)."""
    param.tensor_model_parallel = is_parallel
    param.partition_dim = dim
    param.partition_stride = stride


def _init_partitioned_weight(
    weight: torch.Tensor, full_shape: tuple[int, ...], *, partition_dim: int, stride: int,
    init_method: InitMethod, tp_rank: int, tp_size: int,
) -> None:
    """Initializes this rank's shard of the full weight (see ``initialization``) and tags the split."""
    divide(full_shape[partition_dim], stride * tp_size, what=f"partitioned dim {partition_dim} of size",
           by="stride x tensor_model_parallel_size")
    init_param_(weight, full_shape, init_method=init_method, partition_dim=partition_dim, stride=stride,
                tp_rank=tp_rank, tp_size=tp_size)
    set_tensor_model_parallel_attributes(weight, is_parallel=True, dim=partition_dim, stride=stride)


def _zero_bias(size: int, *, dtype: torch.dtype, device, is_parallel: bool, stride: int = 1) -> nn.Parameter:
    bias = nn.Parameter(torch.zeros(size, dtype=dtype, device=device))
    bias.init_recipe = InitRecipe(0, init_method_constant(0.0), (size,))
    set_tensor_model_parallel_attributes(bias, is_parallel=is_parallel, dim=0 if is_parallel else -1, stride=stride)
    return bias


def _check_last_dim(layer: str, input_: torch.Tensor, expected: int, what: str) -> None:
    if input_.dim() == 0 or input_.shape[-1] != expected:
        raise ValueError(
            f"{layer} expects an input whose last dim is {what} = {expected}, got shape {tuple(input_.shape)}"
        )


def _fp8_overlaps(layer: nn.Module, input_: torch.Tensor, weight: torch.Tensor, plan) -> bool:
    """Whether an FP8 linear runs its sequence-parallel collectives overlapped (``fp8.comm_overlap``)."""
    return (layer.sequence_parallel and layer.tp_comm_overlap and layer.tp_size > 1 and input_.shape[0] > 0
            and fp8_overlap.overlap_supported(plan, weight, deferring_forward(layer.weight_grad_store)))


def _check_overlap(layer: str, tp_comm_overlap: bool, sequence_parallel: bool) -> None:
    if tp_comm_overlap and not sequence_parallel:
        raise ValueError(f"{layer}: tp_comm_overlap=True needs sequence_parallel=True (it overlaps the "
                         "sequence-parallel all-gather / reduce-scatter with the GEMM)")


class ColumnParallelLinear(nn.Module):
    """``Y = X A + b`` with ``A`` split by columns: rank r holds ``A_r`` of ``[output_size/tp, input_size]``.

    Args:
        input_size, output_size: sizes of the full (unsplit) layer; output_size must divide by tp * stride.
        tp_group: the tensor-parallel group; None means no tensor parallelism.
        bias: add a bias (split like the output).
        gather_output: all-gather the output to ``[..., output_size]``; otherwise each rank returns
            ``[..., output_size/tp]``.
        skip_bias_add: return the bias instead of adding it (so the caller can fuse it into the next op);
            with gather_output the returned bias is gathered too (``[output_size]``).
        sequence_parallel: the input is ``[s/tp, b, input_size]``, all-gathered along s before the GEMM.
        init_method: initializes the full weight in place; default ``N(0, 0.02^2)``.
        params_dtype, device: of the parameters.
        stride: interleaved blocks per shard (fused QKV / SwiGLU layouts).
        skip_weight_param_allocation: hold no weight; ``forward`` then needs ``weight=`` (tied output layer).
        tp_comm_overlap: overlap the sequence-parallel all-gather (and backward's reduce-scatter) with the
            GEMM, chunk by chunk (``comm_overlap``); needs sequence_parallel.
        weight_grad_store: the layout's ``WeightGradStore`` (``parallel_state.weight_grad_store``): under a
            zero-bubble pipeline schedule the weight-gradient GEMM waits for its W pass (not with tp_comm_overlap).
        fp8: run the GEMMs in FP8 (``megatron_core.fp8``); the delayed recipe keeps its scaling state in
            ``self.fp8_state``. The weight and the output grad are split over tp: the tensorwise recipe
            all-reduces their amaxes with MAX over tp (forward / backward). With sequence parallelism the
            local input chunk is quantized and its FP8 bytes gathered; with tp_comm_overlap under a per-tensor
            recipe the FP8 gathers and reduce-scatters run chunk by chunk beside the FP8 GEMMs
            (``fp8.comm_overlap``).

    Communication: forward all-gathers the input along s when sequence_parallel (backward all-gathers it
    again, as only the local chunk is saved, and reduce-scatters its gradient), else backward all-reduces
    the input gradient over tp; gather_output all-gathers the
    output along the last dim (backward splits it).

    Returns from forward: ``(output, output_bias)``, ``output_bias`` None unless ``skip_bias_add``.
    """

    def __init__(
        self, input_size: int, output_size: int, *, tp_group=None, bias: bool = True, gather_output: bool = False,
        skip_bias_add: bool = False, sequence_parallel: bool = False, init_method: Optional[InitMethod] = None,
        params_dtype: torch.dtype = torch.float32, device=None, stride: int = 1,
        skip_weight_param_allocation: bool = False, tp_comm_overlap: bool = False,
        weight_grad_store: Optional[WeightGradStore] = None, fp8: Optional[Fp8Config] = None,
    ) -> None:
        super().__init__()
        if gather_output and sequence_parallel:
            raise ValueError("ColumnParallelLinear: gather_output=True cannot be combined with sequence_parallel=True")
        _check_overlap("ColumnParallelLinear", tp_comm_overlap, sequence_parallel)
        self.tp_comm_overlap, self.weight_grad_store = tp_comm_overlap, weight_grad_store
        self.input_size, self.output_size = input_size, output_size
        self.tp_group, self.tp_size, tp_rank = tp_group, group_size(tp_group), group_rank(tp_group)
        self.output_size_per_partition = divide(output_size, self.tp_size, what="output_size")
        self.gather_output, self.skip_bias_add, self.sequence_parallel = gather_output, skip_bias_add, sequence_parallel
        if skip_weight_param_allocation:
            self.weight = None
        else:
            self.weight = nn.Parameter(
                torch.empty(self.output_size_per_partition, input_size, dtype=params_dtype, device=device))
            _init_partitioned_weight(
                self.weight, (output_size, input_size), partition_dim=0, stride=stride,
                init_method=init_method or init_method_normal(0.02), tp_rank=tp_rank, tp_size=self.tp_size)
        self.bias = (_zero_bias(self.output_size_per_partition, dtype=params_dtype, device=device,
                                is_parallel=True, stride=stride) if bias else None)
        self.fp8, self.fp8_state = fp8, fp8_ops.scaling_state(fp8, device=device)
        if self.weight is not None:
            tag_weight(self.weight, fp8, self.fp8_state, amax_group=tp_group if self.tp_size > 1 else None)

    def forward(self, input_: torch.Tensor, weight: Optional[torch.Tensor] = None):
        """``input_`` ``[..., input_size]`` (``[s/tp, b, input_size]`` with sequence_parallel)."""
        weight = self.weight if weight is None else weight
        if weight is None:
            raise ValueError("ColumnParallelLinear was built with skip_weight_param_allocation=True: pass weight=")
        if tuple(weight.shape) != (self.output_size_per_partition, self.input_size):
            raise ValueError(f"ColumnParallelLinear weight must have shape "
                             f"{(self.output_size_per_partition, self.input_size)}, got {tuple(weight.shape)}")
        _check_last_dim("ColumnParallelLinear", input_, self.input_size, "input_size")
        bias = None if self.skip_bias_add else self.bias
        if self.fp8 is not None:
            output = self._fp8_forward(input_, weight, bias)
        elif self.sequence_parallel and self.tp_comm_overlap and self.tp_size > 1 and input_.shape[0] > 0:
            output = all_gather_linear(input_, weight, bias, self.tp_group)  # [s, b, out/tp], chunked overlap
        elif self.sequence_parallel:  # all-gathers s; saves only the local [s/tp, b, in] chunk for backward
            output = sequence_parallel_linear(input_, weight, bias, self.tp_group, self.weight_grad_store)
        else:
            output = linear_deferrable(copy_to_tensor_model_parallel_region(input_, self.tp_group), weight, bias,
                                       self.weight_grad_store)
        output_bias = self.bias if self.skip_bias_add else None
        if self.gather_output:
            output = gather_from_tensor_model_parallel_region(output, self.tp_group)  # [..., out]
            if output_bias is not None:  # returned whole, so that it adds to the gathered output
                output_bias = gather_from_tensor_model_parallel_region(output_bias, self.tp_group)  # [out]
        return output, output_bias

    def _fp8_forward(self, input_: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]):
        """The FP8 GEMMs: ``[s/tp, b, in]`` all-gathered (sequence_parallel) or ``[..., in]`` -> ``[..., out/tp]``."""
        plan = fp8_ops.layer_plan(self.fp8, self.fp8_state, training=self.training, tp_group=self.tp_group,
                          split_roles=("weight", "grad_output"))
        if _fp8_overlaps(self, input_, weight, plan):
            return fp8_overlap.fp8_all_gather_linear(input_, weight, bias, plan, self.tp_group)
        if self.sequence_parallel:
            return fp8_ops.fp8_linear(input_, weight, bias, plan, gather_group=self.tp_group,
                              weight_grad_store=self.weight_grad_store)
        return fp8_ops.fp8_linear(copy_to_tensor_model_parallel_region(input_, self.tp_group), weight, bias, plan,
                          weight_grad_store=self.weight_grad_store)

    def extra_repr(self) -> str:
        return (f"input_size={self.input_size}, output_size={self.output_size}, tp={self.tp_size}, "
                f"bias={self.bias is not None}, gather_output={self.gather_output}, "
                f"sequence_parallel={self.sequence_parallel}" + _fp8_repr(self.fp8))


class RowParallelLinear(nn.Module):
    """``Y = X A + b`` with ``A`` split by rows: rank r holds ``A_r`` of ``[output_size, input_size/tp]``.

    Args:
        input_size, output_size: sizes of the full layer; input_size must divide by tp.
        tp_group: the tensor-parallel group; None means no tensor parallelism.
        bias: add a bias (replicated, added once after the reduction).
        input_is_parallel: the input is already split ``[..., input_size/tp]`` (the output of a
            ColumnParallelLinear); otherwise it is ``[..., input_size]`` and each rank keeps its chunk.
        skip_bias_add: return the bias instead of adding it.
        sequence_parallel: reduce-scatter the output along s to ``[s/tp, b, output_size]`` instead of
            all-reducing it (needs input_is_parallel).
        init_method, params_dtype, device, stride: as in ColumnParallelLinear.
        tp_comm_overlap: overlap the reduce-scatter (and backward's all-gather) with the GEMM, chunk by
            chunk (``comm_overlap``); needs sequence_parallel.
        weight_grad_store: as in ColumnParallelLinear.
        fp8: as in ColumnParallelLinear; here the input and the weight are split over tp (the tensorwise
            recipe all-reduces their amaxes with MAX over tp in forward), the output grad is whole on every
            rank (all-gathered first under sequence parallelism).

    Communication: forward all-reduces the output over tp (reduce-scatter along s with sequence_parallel;
    backward then all-gathers the gradient); with ``input_is_parallel=False`` backward all-gathers the input
    gradient along the last dim.

    Returns from forward: ``(output, output_bias)``, ``output_bias`` None unless ``skip_bias_add``.
    """

    def __init__(
        self, input_size: int, output_size: int, *, tp_group=None, bias: bool = True, input_is_parallel: bool = True,
        skip_bias_add: bool = False, sequence_parallel: bool = False, init_method: Optional[InitMethod] = None,
        params_dtype: torch.dtype = torch.float32, device=None, stride: int = 1, tp_comm_overlap: bool = False,
        weight_grad_store: Optional[WeightGradStore] = None, fp8: Optional[Fp8Config] = None,
    ) -> None:
        super().__init__()
        if sequence_parallel and not input_is_parallel:
            raise ValueError("RowParallelLinear: sequence_parallel=True needs input_is_parallel=True")
        _check_overlap("RowParallelLinear", tp_comm_overlap, sequence_parallel)
        self.tp_comm_overlap, self.weight_grad_store = tp_comm_overlap, weight_grad_store
        self.input_size, self.output_size = input_size, output_size
        self.tp_group, self.tp_size, tp_rank = tp_group, group_size(tp_group), group_rank(tp_group)
        self.input_size_per_partition = divide(input_size, self.tp_size, what="input_size")
        self.input_is_parallel, self.skip_bias_add, self.sequence_parallel = (
            input_is_parallel, skip_bias_add, sequence_parallel)
        self.weight = nn.Parameter(
            torch.empty(output_size, self.input_size_per_partition, dtype=params_dtype, device=device))
        _init_partitioned_weight(
            self.weight, (output_size, input_size), partition_dim=1, stride=stride,
            init_method=init_method or init_method_normal(0.02), tp_rank=tp_rank, tp_size=self.tp_size)
        self.bias = _zero_bias(output_size, dtype=params_dtype, device=device, is_parallel=False) if bias else None
        if self.bias is not None and sequence_parallel:
            self.bias.sequence_parallel = True
        self.fp8, self.fp8_state = fp8, fp8_ops.scaling_state(fp8, device=device)
        tag_weight(self.weight, fp8, self.fp8_state, amax_group=tp_group if self.tp_size > 1 else None)

    def forward(self, input_: torch.Tensor):
        """``input_`` ``[..., input_size/tp]`` (or ``[..., input_size]`` when not input_is_parallel)."""
        if self.input_is_parallel:
            _check_last_dim("RowParallelLinear", input_, self.input_size_per_partition, "input_size / tp")
            input_parallel = input_
        else:
            _check_last_dim("RowParallelLinear", input_, self.input_size, "input_size")
            input_parallel = scatter_to_tensor_model_parallel_region(input_, self.tp_group)
        if self.fp8 is not None:
            output = self._fp8_forward(input_parallel)
        elif self.sequence_parallel and self.tp_comm_overlap and self.tp_size > 1:
            output = linear_reduce_scatter(input_parallel, self.weight, self.tp_group)  # [s/tp, b, out], chunked
        elif self.sequence_parallel:
            # [s, b, out], a partial sum on each tp rank
            partial = linear_deferrable(input_parallel, self.weight, None, self.weight_grad_store)
            output = reduce_scatter_to_sequence_parallel_region(partial, self.tp_group)  # [s/tp, b, out]
        else:
            # [..., out], a partial sum on each tp rank
            partial = linear_deferrable(input_parallel, self.weight, None, self.weight_grad_store)
            output = reduce_from_tensor_model_parallel_region(partial, self.tp_group, inplace=True)
        if self.skip_bias_add or self.bias is None:
            return output, (self.bias if self.skip_bias_add else None)
        return output + self.bias, None

    def _fp8_forward(self, input_parallel: torch.Tensor) -> torch.Tensor:
        """The FP8 GEMM on ``[..., in/tp]``, then the all-reduce (reduce-scatter along s) of the partial sums."""
        plan = fp8_ops.layer_plan(self.fp8, self.fp8_state, training=self.training, tp_group=self.tp_group,
                          split_roles=("input", "weight"))
        if _fp8_overlaps(self, input_parallel, self.weight, plan):
            return fp8_overlap.fp8_linear_reduce_scatter(input_parallel, self.weight, plan, self.tp_group)
        partial = fp8_ops.fp8_linear(input_parallel, self.weight, None, plan, weight_grad_store=self.weight_grad_store)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_parallel_region(partial, self.tp_group)  # [s/tp, b, out]
        return reduce_from_tensor_model_parallel_region(partial, self.tp_group, inplace=True)

    def extra_repr(self) -> str:
        return (f"input_size={self.input_size}, output_size={self.output_size}, tp={self.tp_size}, "
                f"bias={self.bias is not None}, input_is_parallel={self.input_is_parallel}, "
                f"sequence_parallel={self.sequence_parallel}" + _fp8_repr(self.fp8))


def _fp8_repr(fp8: Optional[Fp8Config]) -> str:
    return "" if fp8 is None else f", fp8={fp8.fp8_recipe}/{fp8.fp8_format}"


class VocabParallelEmbedding(nn.Module):
    """Embedding with the vocab split over tp: rank r holds rows ``[r V/tp, (r+1) V/tp)`` of ``[V, h]``.

    ``num_embeddings`` is the padded vocab (see ``vocab_size_with_padding``) and must divide by tp.
    Each rank looks up the ids that fall in its range (zeros elsewhere), then the partial embeddings are
    all-reduced over tp (backward: identity). With ``reduce_scatter_embeddings`` (sequence parallelism)
    they are instead transposed to ``[s, b, h]`` and reduce-scattered along s (backward: all-gather).

    forward: ids ``[b, s]`` (int64) -> ``[b, s, h]``, or ``[s/tp, b, h]`` with reduce_scatter_embeddings.
    Ids outside ``[0, num_embeddings)`` raise instead of silently embedding to zeros.
    """

    backward_uses_parameters = False  # the weight grad is a scatter-add of the output grad (ZeRO-3 skips a gather)

    def __init__(
        self, num_embeddings: int, embedding_dim: int, *, tp_group=None, init_method: Optional[InitMethod] = None,
        params_dtype: torch.dtype = torch.float32, device=None, reduce_scatter_embeddings: bool = False,
    ) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.tp_group, self.tp_size, tp_rank = tp_group, group_size(tp_group), group_rank(tp_group)
        self.reduce_scatter_embeddings = reduce_scatter_embeddings
        self.vocab_start_index, self.vocab_end_index = vocab_range(num_embeddings, tp_rank, self.tp_size)
        self.num_embeddings_per_partition = self.vocab_end_index - self.vocab_start_index
        self.weight = nn.Parameter(
            torch.empty(self.num_embeddings_per_partition, embedding_dim, dtype=params_dtype, device=device))
        _init_partitioned_weight(
            self.weight, (num_embeddings, embedding_dim), partition_dim=0, stride=1,
            init_method=init_method or init_method_normal(0.02), tp_rank=tp_rank, tp_size=self.tp_size)

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        check_ids_in_range(input_, self.num_embeddings, "token ids")
        if self.reduce_scatter_embeddings:
            input_ = input_.t()  # looked up as [s, b]: the embedding comes out [s, b, h], no transpose copy
        if self.tp_size > 1:
            outside = (input_ < self.vocab_start_index) | (input_ >= self.vocab_end_index)
            local_ids = (input_ - self.vocab_start_index).masked_fill(outside, 0)
            # in place: the embedding's backward does not read its output
            partial = F.embedding(local_ids, self.weight).masked_fill_(outside.unsqueeze(-1), 0.0)
        else:
            partial = F.embedding(input_, self.weight)
        if self.reduce_scatter_embeddings:
            return reduce_scatter_to_sequence_parallel_region(partial, self.tp_group)  # [s/tp, b, h]
        return reduce_from_tensor_model_parallel_region(partial, self.tp_group, inplace=True)  # [b, s, h]

    def extra_repr(self) -> str:
        return f"num_embeddings={self.num_embeddings}, embedding_dim={self.embedding_dim}, tp={self.tp_size}"
