"""Ahead-of-time compilation of every Triton launch the ops make, for a CUDA target, on a machine without a GPU.

The interpreter (``TRITON_INTERPRET=1``) runs the kernels on CPU tensors but accepts code that the compiler
rejects (an unsupported cast, a block shape the layout cannot hold). Triton's own compiler builds kernels for
any target without a device (``triton.compile(ASTSource(...), target=GPUTarget("cuda", 90, 32))``; ptxas
ships with triton), so this module runs each op forward and backward on CPU tensors of GPT shapes under
``KernelBackend.capture_launches`` (the Triton path is taken and every launch is recorded instead of run) and
compiles each distinct launch to a cubin. Import it only with ``TRITON_INTERPRET`` unset: interpreted kernels
cannot be compiled.

    python -m kernels.aot            # compiles the GPT-shape launches for sm_80 and sm_90, prints a summary
"""
from __future__ import annotations

import itertools
import sys
from types import MappingProxyType
from typing import Any, Iterable, Sequence

import torch

_POINTER = MappingProxyType({torch.float32: "*fp32", torch.float16: "*fp16", torch.bfloat16: "*bf16",
                             torch.int64: "*i64", torch.int32: "*i32", torch.uint8: "*u8", torch.bool: "*i1"})

Launch = tuple[Any, tuple, dict]


def _type_of(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return _POINTER[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -2 ** 31 <= value < 2 ** 31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"no Triton type for a launch argument of type {type(value).__name__}")


def source_of(launch: Launch):
    """``(ASTSource, options)`` of one recorded launch: argument types, constexpr values, num_warps."""
    from triton.compiler import ASTSource
    kernel, args, kwargs = launch
    names = [param.name for param in kernel.params]
    values = dict(zip(names, args), **{k: v for k, v in kwargs.items() if k in names})
    constexpr = {names[i] for i in kernel.constexprs}
    signature = {name: "constexpr" if name in constexpr else _type_of(values[name]) for name in names}
    constexprs = {name: values[name] for name in names if name in constexpr}
    options = {k: v for k, v in kwargs.items() if k not in names}
    return ASTSource(fn=kernel, signature=signature, constexprs=constexprs), options


def compile_launch(launch: Launch, capability: int):
    """The compiled kernel (``.asm["cubin"]``) of ``launch`` for ``sm_<capability>``."""
    import triton
    from triton.backends.compiler import GPUTarget
    source, options = source_of(launch)
    return triton.compile(source, target=GPUTarget("cuda", capability, 32), options=options)


def _key(launch: Launch) -> tuple:
    kernel, args, kwargs = launch
    return (kernel.fn.__qualname__, tuple(_type_of(a) for a in args), tuple(sorted(kwargs.items())))


def unique(launches: Iterable[Launch]) -> list[Launch]:
    """One launch per (kernel, argument types, constexprs and options)."""
    seen: dict[tuple, Launch] = {}
    for launch in launches:
        seen.setdefault(_key(launch), launch)
    return list(seen.values())


def gpt_launches(dtypes: Sequence[torch.dtype] = (torch.float32, torch.bfloat16, torch.float16),
                 hidden_sizes: Sequence[int] = (1000, 4096, 20000), score_lengths: Sequence[int] = (128, 4097),
                 vocab_sizes: Sequence[int] = (50257, 128256)) -> list[Launch]:
    """The launches of every op, forward and backward, on GPT shapes: odd and long rows (a hidden size above
    the one-block limit takes the looped path), each dtype, with and without bias, mask and label smoothing."""
    import kernels
    backend = kernels.KernelBackend("triton")
    with backend.capture_launches() as launches:
        for dtype, hidden in itertools.product(dtypes, hidden_sizes):
            x = torch.zeros(3, hidden, dtype=dtype, requires_grad=True)
            w = torch.ones(hidden, dtype=dtype, requires_grad=True)
            kernels.layer_norm(x, w, torch.zeros(hidden, dtype=dtype, requires_grad=True),
                              backend=backend).sum().backward()
            kernels.layer_norm(x, w, None, backend=backend).sum().backward()
            kernels.rms_norm(x, w, backend=backend).sum().backward()
        for dtype, sk in itertools.product(dtypes, score_lengths):
            scores = torch.zeros(1, 2, 3, sk, dtype=dtype, requires_grad=True)
            mask = torch.zeros(1, 1, 3, sk, dtype=torch.bool)
            kernels.scaled_masked_softmax(scores, mask, 0.125, backend=backend).sum().backward()
            causal = torch.zeros(2, sk, sk, dtype=dtype, requires_grad=True) if sk <= 256 else None
            if causal is not None:
                kernels.scaled_upper_triang_masked_softmax(causal, 0.125, backend=backend).sum().backward()
        for dtype, vocab, smoothing in itertools.product(dtypes, vocab_sizes, (0.0, 0.1)):
            logits = torch.zeros(3, vocab, dtype=dtype, requires_grad=True)
            kernels.cross_entropy(logits, torch.zeros(3, dtype=torch.int64), label_smoothing=smoothing,
                                  backend=backend).sum().backward()
    return unique(launches)


def main(argv: Sequence[str] = ()) -> int:
    capabilities = [int(a) for a in argv] or [80, 90]
    launches = gpt_launches()
    for capability in capabilities:
        sizes = [len(compile_launch(launch, capability).asm["cubin"]) for launch in launches]
        print(f"sm_{capability}: {len(sizes)} launches compiled, {sum(sizes) / 1e3:.0f} kB of cubin")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
