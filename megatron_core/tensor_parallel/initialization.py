"""Layout-independent initialization that any shard can compute alone (tensor-parallel or ZeRO-3 shards).

Each parameter draws one seed from the default generator when it is built (inside the module's
``seeded_init`` scope, so the seed depends only on the module's global identity). Row ``r`` of the *full*
(tp-unsplit) weight is then drawn from a generator seeded with ``(seed, r)``: the values of any element depend
only on the seed, its row and the row length, never on tp, pp, dp or the ZeRO stage. A tp rank computes only
the rows it holds, and a ZeRO-3 rank built on the meta device computes only the rows that overlap its 1/dp
shard (``init_flat_values``), so sharded construction never materializes a full parameter.

Each parameter records its ``init_recipe``; init methods made here (normal, scaled normal, padded-vocab
normal, constants) are *elementwise* and can be drawn row by row. Any other callable is applied to the whole
full weight, drawn from the default generator as before (such parameters cannot be built on the meta device).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable, Optional, Sequence

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake

from megatron_core.utils.accelerator import holds_no_data

InitMethod = Callable[[torch.Tensor], torch.Tensor]
_ROW_SEED_STRIDE = 2 ** 32  # row r of a parameter with seed s uses generator seed s * 2**32 + r


def _elementwise(init: InitMethod, **attributes) -> InitMethod:
    init.elementwise = True
    for name, value in attributes.items():
        setattr(init, name, value)
    return init


def init_method_normal(sigma: float) -> InitMethod:
    """``N(0, sigma^2)`` initialization (Megatron's default with sigma = ``init_method_std`` = 0.02)."""
    return _elementwise(lambda tensor: nn.init.normal_(tensor, mean=0.0, std=sigma))


def scaled_init_method_normal(sigma: float, num_layers: int) -> InitMethod:
    """``N(0, (sigma / sqrt(2 num_layers))^2)``: Megatron's init for the output projections of each layer."""
    return init_method_normal(sigma / math.sqrt(2.0 * num_layers))


def init_method_constant(value: float) -> InitMethod:
    """Every element ``value`` (biases 0, norm weights 1)."""
    return _elementwise(lambda tensor: nn.init.constant_(tensor, value), constant=value)


def padded_vocab_init(std: float, vocab_size: int) -> InitMethod:
    """Rows ``< vocab_size`` ``N(0, std^2)``, the padding rows zero: the weight is the same whatever padding
    tp requires (the padding rows of the embedding and output layer)."""
    def init(weight: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            weight[:vocab_size].normal_(0.0, std)
            weight[vocab_size:].zero_()
        return weight
    return _elementwise(init, rows_limit=vocab_size, row_init=init_method_normal(std))


@dataclasses.dataclass(frozen=True)
class InitRecipe:
    """How to compute any part of a (tp-local) parameter: its full shape, how tp splits it, and its seed."""

    seed: int
    init_method: InitMethod
    full_shape: tuple[int, ...]
    partition_dim: int = -1  # -1: replicated over tp
    stride: int = 1
    tp_rank: int = 0
    tp_size: int = 1

    @property
    def local_shape(self) -> tuple[int, ...]:
        shape = list(self.full_shape)
        if self.partition_dim >= 0:
            shape[self.partition_dim] //= self.tp_size
        return tuple(shape)

    def full_rows(self, rows: Sequence[int]) -> torch.Tensor:
        """Rows ``rows`` of the full weight as ``[len(rows), row_length]`` fp32 (a 1-D weight is one row)."""
        length = self.full_shape[-1] if len(self.full_shape) > 1 else self.full_shape[0]
        out = torch.empty(len(rows), length, dtype=torch.float32)
        constant = getattr(self.init_method, "constant", None)
        if constant is not None:
            return out.fill_(constant)
        limit = getattr(self.init_method, "rows_limit", None)
        row_init = getattr(self.init_method, "row_init", self.init_method)
        with torch.random.fork_rng(devices=[]):
            for i, row in enumerate(rows):
                if limit is not None and row >= limit:
                    out[i].zero_()
                    continue
                torch.default_generator.manual_seed(self.seed * _ROW_SEED_STRIDE + row)
                row_init(out[i:i + 1])
        return out

    def local_rows(self, lo: int, hi: int) -> torch.Tensor:
        """Rows ``[lo, hi)`` of this tp rank's part, ``[hi - lo, local_row_length]`` fp32."""
        if hi <= lo:
            return torch.empty(0, self.local_shape[-1])
        if len(self.full_shape) < 2:
            values = self.full_rows(range(1))
            return self._split_columns(values) if self.partition_dim == 0 else values
        if self.partition_dim == 0:
            block = self.full_shape[0] // (self.stride * self.tp_size)
            return self.full_rows([(self.tp_rank + (r // block) * self.tp_size) * block + r % block
                                   for r in range(lo, hi)])
        if self.partition_dim != 1:
            return self.full_rows(range(lo, hi))
        # full rows are tp times wider than the local ones: draw them a 1/tp of the rows at a time
        step = max(1, (hi - lo) // self.tp_size)
        return torch.cat([self._split_columns(self.full_rows(range(r, min(r + step, hi))))
                          for r in range(lo, hi, step)])

    def _split_columns(self, values: torch.Tensor) -> torch.Tensor:
        """This tp rank's column blocks (``stride`` interleaved blocks) of full rows ``values``."""
        block = values.shape[-1] // (self.stride * self.tp_size)
        return torch.cat(values.split(block, dim=-1)[self.tp_rank::self.tp_size], dim=-1)

    def local_flat(self, lo: int, hi: int) -> torch.Tensor:
        """Elements ``[lo, hi)`` of this tp rank's part, flattened (row-major)."""
        shape = self.local_shape
        width = shape[-1] if len(shape) > 1 else shape[0]
        first, last = lo // width, -(-hi // width)
        if len(shape) < 2:
            return self.local_rows(0, 1).reshape(-1)[lo:hi]
        rows = self.local_rows(first, last).reshape(-1)
        return rows[lo - first * width:hi - first * width]


def init_param_(param: torch.Tensor, full_shape: tuple[int, ...], *, init_method: InitMethod,
                partition_dim: int = -1, stride: int = 1, tp_rank: int = 0, tp_size: int = 1) -> None:
    """Records ``param``'s recipe (drawing its seed from the default generator) and, unless ``param`` is on
    the meta device, writes this tp rank's values into it.

    With ``stride`` s the partitioned dim is cut into ``s * tp`` equal blocks and rank r keeps blocks
    ``r, r + tp, r + 2 tp, ...`` (e.g. the q, k and v rows of its heads in a fused QKV weight).
    """
    seed = int(torch.randint(0, 2 ** 31 - 1, (1,)).item())
    if not getattr(init_method, "elementwise", False):
        if is_fake(param):
            return
        if param.is_meta:
            raise ValueError(f"init_method {init_method!r} is not elementwise, so a shard cannot be drawn alone: "
                             "build the model on a real device, or use an init method of "
                             "megatron_core.tensor_parallel.initialization")
        _init_whole(param, full_shape, init_method=init_method, partition_dim=partition_dim, stride=stride,
                    tp_rank=tp_rank, tp_size=tp_size)
        return
    recipe = InitRecipe(seed, init_method, tuple(full_shape), partition_dim, stride, tp_rank, tp_size)
    param.init_recipe = recipe
    if not holds_no_data(param):  # meta, or a dry run's fake tensor: the recipe alone
        with torch.no_grad():
            rows = recipe.local_shape[0] if len(full_shape) > 1 else 1
            param.copy_(recipe.local_rows(0, rows).reshape(param.shape))


def _init_whole(param: torch.Tensor, full_shape: tuple[int, ...], *, init_method: InitMethod, partition_dim: int,
                stride: int, tp_rank: int, tp_size: int) -> None:
    """A custom init method on the full weight, drawn on the CPU, then this rank's shard kept."""
    master = torch.empty(full_shape, dtype=torch.float32)
    init_method(master)
    if partition_dim >= 0:
        block = full_shape[partition_dim] // (stride * tp_size)
        master = torch.cat(torch.split(master, block, dim=partition_dim)[tp_rank::tp_size], dim=partition_dim)
    with torch.no_grad():
        param.copy_(master)


def init_flat_values(param: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """Flat elements ``[lo, hi)`` of ``param``'s initial (tp-local) value: read from it, or computed from its
    recipe when it was built on the meta device (only the rows overlapping ``[lo, hi)`` are drawn)."""
    if getattr(param, "unmaterialized_shape", None) is None and not param.is_meta:
        return param.data.reshape(-1)[lo:hi]
    recipe: Optional[InitRecipe] = getattr(param, "init_recipe", None)
    if recipe is None:
        raise ValueError(f"a parameter of shape {tuple(logical_shape(param))} was built on the meta device but has "
                         "no init recipe: build it with megatron_core's layers (or initialization.init_param_)")
    return recipe.local_flat(lo, hi).to(param.dtype)


def logical_shape(param: torch.Tensor) -> torch.Size:
    """The shape ``param`` has in the model (a meta parameter swapped for an empty one keeps it here)."""
    shape = getattr(param, "unmaterialized_shape", None)
    return param.shape if shape is None else shape


def swap_meta_parameters_(module: nn.Module, *, device: torch.device) -> None:
    """Replaces every meta parameter of ``module`` by a parameter on ``device``: trainable ones empty (their
    shape kept as ``unmaterialized_shape``, their attributes kept; ZeRO-3 then writes each rank's shard from the
    recipe), frozen ones with their full value. Tied parameters stay one object. A meta buffer is an error
    (nothing says what it should hold)."""
    replaced: dict[int, nn.Parameter] = {}
    for sub in module.modules():
        for name, param in list(sub._parameters.items()):
            if param is None or not param.is_meta:
                continue
            if id(param) not in replaced:
                if param.requires_grad:
                    new = nn.Parameter(torch.empty(0, dtype=param.dtype, device=device))
                    new.__dict__.update(param.__dict__)
                    new.unmaterialized_shape = param.shape
                else:
                    values = init_flat_values(param, 0, param.numel()).reshape(param.shape)
                    new = nn.Parameter(values.to(device), requires_grad=False)
                    new.__dict__.update(param.__dict__)
                replaced[id(param)] = new
            sub._parameters[name] = replaced[id(param)]
        for name, buffer in sub._buffers.items():
            if buffer is not None and buffer.is_meta:
                raise ValueError(f"buffer {name!r} of {type(sub).__name__} is on the meta device: create buffers on "
                                 "a real device (only parameters are materialized from their init recipes)")
