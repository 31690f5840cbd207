"""``zero.Init``: build any model without any rank holding it whole (DeepSpeed's ``deepspeed.zero.Init``).

Inside the context every parameter a module registers is replaced by a parameter on the meta device that
records how to compute its values (``param.init_recipe``), and the initializers that run on it afterwards
(the module's ``reset_parameters``, Hugging Face's ``post_init``) are recorded instead of executed:

* ``normal_``, ``uniform_``, ``fill_`` / ``zero_`` / ``constant_``, ``kaiming_uniform_`` (and those built on
  them: ``ones_``, ``zeros_``, ``xavier_*``, ``kaiming_normal_``) become an *elementwise* recipe whose rows
  are drawn from per-row seeds, so any rank computes any slice of the parameter alone (``local_flat``), and
  the values depend only on the parameter's seed, never on dp or the ZeRO stage; ``weight[i].fill_(c)``
  (``padding_idx``) overrides one row;
* a parameter created with values (``nn.Parameter(torch.zeros(n))``) keeps them, and any other in-place op
  (``trunc_normal_``'s ``erfinv_``, ``copy_``, ...) materializes that one parameter from its recipe and
  applies the op; it is then held whole until the engine shards it.

The engine at stage 3 writes each rank's shard from the recipes (``DistributedDataParallel`` materializes
meta parameters shard by shard); at stages 0-2 ``materialize_`` builds every parameter whole. Seeds: rank 0's
``torch.initial_seed()`` is broadcast and each parameter, in registration order, derives its own, so every rank
computes the same model. The values are not those of a build outside the context (different RNG use).
Buffers are built normally.
"""
from __future__ import annotations

import math
import sys
from types import MappingProxyType
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.overrides import TorchFunctionMode

_ROW_SEED_STRIDE = 2 ** 32
# nn.init functions that do not dispatch to torch-function modes (and return at once on meta tensors):
# patched inside Init (also in transformers' table of them, when it is imported)
_UNDISPATCHED = ("trunc_normal_", "orthogonal_", "sparse_", "dirac_", "eye_")
_TORCH_INIT = MappingProxyType({name: getattr(nn.init, name) for name in _UNDISPATCHED})


class ElementwiseRecipe:
    """A parameter whose elements follow one distribution, drawn row by row (row = first dim).

    Args:
        seed: the parameter's seed (row r uses generator seed ``seed * 2**32 + r``).
        shape: the parameter's shape.
        kind: "normal" (mean, std), "trunc_normal" (mean, std, a, b), "uniform" (low, high) or "constant".
        args: the distribution's parameters.
    """

    def __init__(self, seed: int, shape: tuple[int, ...], kind: str, args: tuple[float, ...]) -> None:
        self.seed, self.shape, self.kind, self.args = seed, tuple(shape), kind, tuple(float(a) for a in args)
        self.row_constants: dict[int, float] = {}

    @property
    def width(self) -> int:
        return math.prod(self.shape[1:]) if len(self.shape) > 1 else max(1, math.prod(self.shape))

    def _row(self, row: int) -> torch.Tensor:
        out = torch.empty(self.width, dtype=torch.float32)
        if row in self.row_constants:
            return out.fill_(self.row_constants[row])
        if self.kind == "constant":
            return out.fill_(self.args[0])
        generator = torch.Generator().manual_seed(self.seed * _ROW_SEED_STRIDE + row)
        if self.kind == "normal":
            return out.normal_(self.args[0], self.args[1], generator=generator)
        if self.kind == "trunc_normal":
            return _TORCH_INIT["trunc_normal_"](out, *self.args, generator=generator)
        return out.uniform_(self.args[0], self.args[1], generator=generator)

    def local_flat(self, lo: int, hi: int) -> torch.Tensor:
        """Flat elements ``[lo, hi)`` as fp32 (only the rows overlapping them are drawn)."""
        if hi <= lo:
            return torch.empty(0)
        width = self.width
        first, last = lo // width, -(-hi // width)
        rows = torch.cat([self._row(r) for r in range(first, last)])
        return rows[lo - first * width:hi - first * width]


class ValuesRecipe:
    """A parameter held whole (created with values, or changed by a non-elementwise op)."""

    def __init__(self, values: torch.Tensor) -> None:
        self.values = values

    def local_flat(self, lo: int, hi: int) -> torch.Tensor:
        return self.values.reshape(-1)[lo:hi].float()


def full_values(param: torch.Tensor) -> torch.Tensor:
    """The whole value of a parameter built under ``Init``, in its dtype (shape ``param.shape``)."""
    return param.init_recipe.local_flat(0, param.numel()).reshape(param.shape).to(param.dtype)


def materialize_(module: nn.Module, *, device: torch.device) -> None:
    """Replaces every meta parameter of ``module`` that has an ``init_recipe`` by a whole parameter on
    ``device`` (tied parameters stay one object). A no-op for a model built outside ``Init``."""
    replaced: dict[int, nn.Parameter] = {}
    for sub in module.modules():
        for name, param in list(sub._parameters.items()):
            if param is None or not param.is_meta or getattr(param, "init_recipe", None) is None:
                continue
            if id(param) not in replaced:
                new = nn.Parameter(full_values(param).to(device), requires_grad=param.requires_grad)
                new.__dict__.update({k: v for k, v in param.__dict__.items() if k != "init_recipe"})
                replaced[id(param)] = new
            sub._parameters[name] = replaced[id(param)]


def _arg(args: tuple, kwargs: dict, index: int, name: str, default: Any) -> Any:
    if name in kwargs:
        return kwargs[name]
    return args[index] if len(args) > index else default


def _number(value: Any) -> float:
    return float(value.item()) if isinstance(value, torch.Tensor) else float(value)


def _kaiming_bound(tensor: torch.Tensor, args: tuple, kwargs: dict) -> float:
    a = _arg(args, kwargs, 1, "a", 0.0)
    mode = _arg(args, kwargs, 2, "mode", "fan_in")
    nonlinearity = _arg(args, kwargs, 3, "nonlinearity", "leaky_relu")
    fan = nn.init._calculate_correct_fan(tensor, mode)
    return math.sqrt(3.0) * nn.init.calculate_gain(nonlinearity, a) / math.sqrt(fan)


class _Recorder(TorchFunctionMode):
    """Records initializers applied to the meta parameters of ``Init`` (see the module docstring)."""

    def __init__(self, init: "Init") -> None:
        super().__init__()
        self.init = init

    def __torch_function__(self, func: Callable, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        first = args[0] if args else kwargs.get("tensor")  # nn.init functions dispatch with keywords
        target = self.init.target_of(first)
        if target is None:
            return func(*args, **kwargs)
        if func is torch.Tensor.data.__get__:
            return self.init.track(func(*args), target[0], target[1])
        name = getattr(func, "__name__", "")
        if name == "__getitem__" and target[1] is None:
            return self.init.track(func(*args, **kwargs), target[0], args[1])
        if not args:
            args, kwargs = (first,), {k: v for k, v in kwargs.items() if k != "tensor"}
        if self.init.record(func, name, target, args, kwargs):
            return first
        return func(*args, **kwargs)


class Init:
    """Sharded construction context (DeepSpeed's ``deepspeed.zero.Init``); see the module docstring.

    Args:
        module: accepted for DeepSpeed's signature: a model built already is sharded by the engine itself.
        enabled: False makes the context a no-op.
        dtype: the parameters' dtype (default: as built; ``config_dict_or_path`` with fp16 / bf16 sets it).
        config_dict_or_path: a DeepSpeed config, read for the precision only.
        data_parallel_group: the group whose rank 0's seed every rank uses (default: the world).
    Other DeepSpeed arguments (``remote_device``, ``pin_memory``, ``mpu``, ...) are accepted and unused.
    Collective: a broadcast of rank 0's seed over the group on entry.
    """

    def __init__(self, module: Optional[nn.Module] = None, data_parallel_group=None, *, enabled: bool = True,
                 dtype: Optional[torch.dtype] = None, config_dict_or_path: Any = None, config: Any = None,
                 **unused: Any) -> None:
        del unused
        self.enabled = enabled and module is None
        self.group, self.dtype = data_parallel_group, dtype or _config_dtype(config_dict_or_path or config)
        self._targets: dict[int, tuple[nn.Parameter, Any]] = {}
        self._keep: list[torch.Tensor] = []  # aliases and views, alive so their ids stay theirs
        self._count, self._base_seed = 0, 0

    # ----------------------------------------------------------------------------------------------------------
    def __enter__(self) -> "Init":
        if not self.enabled:
            return self
        seed = torch.tensor([torch.initial_seed() % 2 ** 31], dtype=torch.int64)
        if dist.is_initialized():
            dist.broadcast(seed, src=dist.get_global_rank(self.group, 0) if self.group else 0, group=self.group)
        self._base_seed = int(seed.item())
        self._original_register = nn.Module.register_parameter
        init = self

        def register_parameter(module: nn.Module, name: str, param: Optional[nn.Parameter]) -> None:
            init._original_register(module, name, init.convert(param))
        nn.Module.register_parameter = register_parameter
        self._patch_init_functions({name: self._undispatched(name) for name in _UNDISPATCHED})
        self._recorder = _Recorder(self).__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if not self.enabled:
            return
        self._recorder.__exit__(*exc)
        nn.Module.register_parameter = self._original_register
        self._patch_init_functions(_TORCH_INIT)
        self._targets, self._keep = {}, []

    @staticmethod
    def _patch_init_functions(functions: dict[str, Callable]) -> None:
        tables = [vars(nn.init)]
        hf = sys.modules.get("transformers.initialization")
        if hf is not None and isinstance(getattr(hf, "TORCH_INIT_FUNCTIONS", None), dict):
            tables.append(hf.TORCH_INIT_FUNCTIONS)
        for table in tables:
            for name, function in functions.items():
                if name in table:
                    table[name] = function

    def _undispatched(self, name: str) -> Callable:
        """``nn.init.<name>`` for tracked parameters: trunc_normal_ recorded, the others applied whole."""
        original = _TORCH_INIT[name]

        def init_function(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            target = self.target_of(tensor)
            if target is None:
                return original(tensor, *args, **kwargs)
            param, index = target
            if name == "trunc_normal_" and index is None:
                values = [_arg(args, kwargs, i, key, default) for i, (key, default) in
                          enumerate((("mean", 0.0), ("std", 1.0), ("a", -2.0), ("b", 2.0)))]
                self._elementwise(param, "trunc_normal", *values)
                return tensor
            self._apply_whole(original, param, index, (tensor, *args), kwargs)
            return tensor
        return init_function

    # ----------------------------------------------------------------------------------------------------------
    def convert(self, param: Optional[nn.Parameter]) -> Optional[nn.Parameter]:
        """A new parameter becomes a meta parameter holding its values as its recipe (until an initializer
        replaces them: ``nn.Linear``'s ``torch.empty`` is never read)."""
        if param is None or param.is_meta or id(param) in self._targets:
            return param
        dtype = self.dtype if self.dtype is not None and param.is_floating_point() else param.dtype
        meta = nn.Parameter(torch.empty(param.shape, dtype=dtype, device="meta"), requires_grad=param.requires_grad)
        meta.__dict__.update(param.__dict__)
        meta.init_recipe = ValuesRecipe(param.data)
        meta.init_seed = (self._base_seed * 1_000_003 + self._count) % 2 ** 31
        self._count += 1
        self.track(meta, meta, None)
        return meta

    def track(self, tensor: torch.Tensor, param: nn.Parameter, index: Any) -> torch.Tensor:
        self._targets[id(tensor)] = (param, index)
        self._keep.append(tensor)
        return tensor

    def target_of(self, value: Any) -> Optional[tuple[nn.Parameter, Any]]:
        return self._targets.get(id(value)) if isinstance(value, torch.Tensor) else None

    def _elementwise(self, param: nn.Parameter, kind: str, *args: float) -> bool:
        param.init_recipe = ElementwiseRecipe(param.init_seed, tuple(param.shape), kind, args)
        return True

    def record(self, func: Callable, name: str, target: tuple, args: tuple, kwargs: dict) -> bool:
        """Records (True) or applies an in-place op on a tracked parameter; False lets a read-only op run."""
        param, index = target
        init_fn = getattr(nn.init, name, None) is func
        if index is None and init_fn and name in ("normal_", "uniform_", "constant_", "kaiming_uniform_"):
            if name == "normal_":
                return self._elementwise(param, "normal", _arg(args, kwargs, 1, "mean", 0.0),
                                         _arg(args, kwargs, 2, "std", 1.0))
            if name == "uniform_":
                return self._elementwise(param, "uniform", _arg(args, kwargs, 1, "a", 0.0),
                                         _arg(args, kwargs, 2, "b", 1.0))
            if name == "constant_":
                return self._elementwise(param, "constant", _number(_arg(args, kwargs, 1, "val", 0.0)))
            bound = _kaiming_bound(args[0], args, kwargs)
            return self._elementwise(param, "uniform", -bound, bound)
        if index is None and name == "normal_":
            return self._elementwise(param, "normal", _arg(args, kwargs, 1, "mean", 0.0),
                                     _arg(args, kwargs, 2, "std", 1.0))
        if index is None and name == "uniform_":
            return self._elementwise(param, "uniform", _arg(args, kwargs, 1, "from", 0.0),
                                     _arg(args, kwargs, 2, "to", 1.0))
        if index is None and name in ("fill_", "zero_"):
            return self._elementwise(param, "constant", 0.0 if name == "zero_" else _number(args[1]))
        recipe = param.init_recipe
        if isinstance(index, int) and name in ("fill_", "zero_") and isinstance(recipe, ElementwiseRecipe):
            recipe.row_constants[index % param.shape[0]] = 0.0 if name == "zero_" else _number(args[1])
            return True
        if not (name.endswith("_") and not name.startswith("__")) and name != "__setitem__":
            return False  # not in place: runs on the meta tensor (shapes, views)
        return self._apply_whole(func, param, index, args, kwargs)

    def _apply_whole(self, func: Callable, param: nn.Parameter, index: Any, args: tuple, kwargs: dict) -> bool:
        """Any other in-place op: the parameter is materialized from its recipe and the op applied to it."""
        if not isinstance(param.init_recipe, ValuesRecipe):
            param.init_recipe = ValuesRecipe(full_values(param))
        values = param.init_recipe.values
        if values.dtype != param.dtype:
            param.init_recipe = ValuesRecipe(values.to(param.dtype))
            values = param.init_recipe.values
        target = values if index is None else values[index]

        def real(value: Any) -> Any:
            tracked = self.target_of(value)
            if tracked is None:
                return value
            whole = values if tracked[0] is param else full_values(tracked[0])
            return whole if tracked[1] is None else whole[tracked[1]]
        func(target, *[real(a) for a in args[1:]], **{k: real(v) for k, v in kwargs.items()})
        return True


def _config_dtype(config: Any) -> Optional[torch.dtype]:
    if config is None:
        return None
    from megatron_core.engine.config import _load
    raw, _ = _load(config)
    if raw.get("fp16", {}).get("enabled"):
        return torch.float16
    if raw.get("bf16", raw.get("bfloat16", {})).get("enabled"):
        return torch.bfloat16
    return None


__all__ = ["Init", "ElementwiseRecipe", "ValuesRecipe", "materialize_", "full_values"]
