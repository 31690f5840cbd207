"""Muon for the weight matrices, AdamW for the rest: Megatron-LM's ``--optimizer muon``.

Muon (MomentUm Orthogonalized by Newton-Schulz; Jordan et al. 2024, Liu et al. 2025 "Muon is Scalable for LLM
Training") keeps an EMA momentum per weight matrix and steps along the nearest semi-orthogonal matrix to it.
Megatron-LM builds it from NVIDIA's Emerging-Optimizers (``TensorParallelMuon`` over ``OrthogonalizedOptimizer``);
this is the same math, written from the definitions, per step and matrix ``W`` with gradient ``G``::

    W -= lr * wd * W                               (decoupled weight decay; none where exempt)
    M  = beta * M + (1 - beta) * G                 (--muon-momentum beta)
    U  = (1 - beta) * G + beta * M  if --muon-nesterov  else  M
    W -= lr * extra * scale(out, in) * NS(U)       (--muon-extra-scale-factor, --muon-scale-mode)

``NS(U)``: ``X = U / ||U||_F`` (transposed so that rows <= cols), then ``--muon-num-ns-steps`` iterations
``X = a X + (b A + c A A) X`` with ``A = X X^T`` and ``(a, b, c)`` per step from ``--muon-coefficient-type``, in
bf16 under ``--muon-fp32-matmul-prec medium`` (Megatron's default) or low, in fp32 under ``high``.
``scale``: spectral ``sqrt(max(out, in))``, unit_rms_norm ``sqrt(out / in)``, shape_scaling
``sqrt(max(1, out / in))``, from the matrix's full (not tp-local) shape.

Which parameters: every trainable weight with 2 dims except embedding tables and the output layer (Megatron's
``is_embedding_or_output_parameter``; position embeddings too: they are lookup tables, not linear maps). The rest
(embeddings, output layer, norm weights, biases) take AdamW with the run's Adam settings, in the same optimizer:
one state dict, one step. ``linear_qkv.weight`` is cut into the q, k and v rows of its query groups, each
orthogonalized and scaled as its own matrix (``--muon-no-split-qkv`` keeps it whole).

Tensor parallelism (``--muon-tp-mode``), for a matrix split over tp along ``partition_dim``:

- ``duplicated``: all-gather over tp along the split dim; every tp rank orthogonalizes the whole matrix and
  keeps its part, so the update equals the single-process one bit for bit (NS commutes with the row or column
  order, so strided splits such as SwiGLU's fc1 gather correctly by plain concatenation);
- ``distributed``: each rank keeps its part; ``||U||_F^2`` and every Gram matrix ``A`` are all-reduced over tp;
- ``blockwise``: each tp part is orthogonalized and scaled as a matrix of its own (Megatron's approximation).

Distributed optimizer (ZeRO 1-3, which Megatron's Muon refuses): a rank holds a flat 1/dp slice of each bucket.
Per bucket holding a Muon matrix, the slices' updates ``U`` are all-gathered over the bucket's dp group (fp32,
one bucket at a time); each rank orthogonalizes only the matrices its slice touches and applies its part.
Collectives: all-gather over dp (sharded stages), all-gather or all-reduces over tp (split matrices), in the
same order on every rank.
"""
from __future__ import annotations

import dataclasses
from itertools import chain, cycle, islice, repeat
from types import MappingProxyType
from typing import Any, Optional

import torch
import torch.distributed as dist

from megatron_core.tensor_parallel.mappings import _all_gather, _split
from megatron_core.tensor_parallel.utils import group_size

# (a, b, c) per Newton-Schulz step: the published sets Emerging-Optimizers ships (its ``_COEFFICIENT_SETS``)
COEFFICIENTS: MappingProxyType = MappingProxyType({
    "simple": ((3.4445, -4.7750, 2.0315),),  # Jordan's original quintic
    "quintic": ((4.0848, -6.8946, 2.9270), (3.9505, -6.3029, 2.6377), (3.7418, -5.5913, 2.3037),
                (2.8769, -3.1427, 1.2046), (2.8366, -3.0525, 1.2012)),  # modded-nanogpt's per-step set
    "polar_express": ((8.2051, -22.9019, 16.4607), (4.0664, -2.8612, 0.5184), (3.9096, -2.8234, 0.5250),
                      (3.2856, -2.4153, 0.4853), (2.2779, -1.6198, 0.3985), (1.8726, -1.2307, 0.3585),
                      (1.8564, -1.2132, 0.3568), (1.8750, -1.2500, 0.3750)),  # arXiv:2505.16932
    "cans": ((8.4703, -25.1081, 18.6293), (4.1828, -3.1087, 0.5806), (3.9619, -2.9541, 0.5630),
             (3.2866, -2.4647, 0.5074), (2.2737, -1.6447, 0.4162)),  # arXiv:2506.10935
    "aol": ((4.0098, -7.0585, 2.4635), (3.4585, -5.5479, 2.5959), (2.7573, -3.2939, 1.4254),
            (2.7215, -3.0494, 1.3169)),
    "deepseekv4": ((3.4445, -4.7750, 2.0315),) * 8 + ((2.0, -1.5, 0.5),) * 2,
})
REPEAT_LAST = ("polar_express", "cans", "deepseekv4")  # past its end a schedule repeats its last step (else cycles)
SCALE_MODES = ("spectral", "unit_rms_norm", "shape_scaling")
TP_MODES = ("blockwise", "duplicated", "distributed")
MATMUL_PRECISIONS = ("low", "medium", "high")
EPS = 1e-7


def coefficient_schedule(coefficient_type: str, steps: int) -> list[tuple[float, float, float]]:
    """The ``(a, b, c)`` of each of ``steps`` Newton-Schulz iterations."""
    sets = COEFFICIENTS[coefficient_type]
    source = chain(sets, repeat(sets[-1])) if coefficient_type in REPEAT_LAST else cycle(sets)
    return list(islice(source, steps))


def scale_factor(size_out: int, size_in: int, mode: str) -> float:
    """The update's scale for a ``[size_out, size_in]`` matrix (``--muon-scale-mode``)."""
    if mode == "spectral":
        return max(size_out, size_in) ** 0.5
    if mode == "unit_rms_norm":
        return (size_out / size_in) ** 0.5
    return max(1.0, size_out / size_in) ** 0.5


def newton_schulz(x: torch.Tensor, *, steps: int, coefficient_type: str, bf16: bool,
                  tp_group=None, transpose: Optional[bool] = None) -> torch.Tensor:
    """The approximate orthogonalization ``NS(x)`` of ``x`` (fp32 ``[m, n]``), fp32 out.

    ``tp_group`` given: ``x`` is this rank's column block ``[m, n / tp]`` of the matrix (after the transpose):
    the squared norm and each Gram matrix ``x x^T`` are all-reduced (sum) over it.
    """
    if transpose is None:
        transpose = x.size(-2) > x.size(-1)
    if transpose:
        x = x.mT
    if tp_group is not None:
        square = (x * x).sum()
        dist.all_reduce(square, group=tp_group)
        X = x / torch.sqrt(square).clamp_min(EPS)
    else:
        X = torch.nn.functional.normalize(x, p=2, dim=(-2, -1), eps=EPS)
    if bf16:
        X = X.to(torch.bfloat16)
    for a, b, c in coefficient_schedule(coefficient_type, steps):
        A = X @ X.mT
        if tp_group is not None:
            dist.all_reduce(A, group=tp_group)
        B = torch.addmm(A, A, A, alpha=c, beta=b)
        X = torch.addmm(X, B, X, alpha=1.0, beta=a)
    X = X.to(torch.float32)
    return X.mT if transpose else X


@dataclasses.dataclass(frozen=True)
class MuonSettings:
    """The ``--muon-*`` settings (``OptimizerConfig.muon_*``)."""
    momentum: float
    nesterov: bool
    num_ns_steps: int
    coefficient_type: str
    scale_mode: str
    extra_scale_factor: float
    bf16: bool          # --muon-fp32-matmul-prec low/medium: the iterations in bf16
    tp_mode: str


@dataclasses.dataclass(eq=False)
class Matrix:
    """Where one Muon master piece sits: its parameter's tp-local ``shape``, its tp split, its QKV cut, and for
    a 1/dp slice the bucket and the slice's flat ranges."""
    shape: tuple[int, int]
    split_dim: Optional[int]                      # the tp-split dim (None: whole on this rank, or blockwise)
    tp_group: Any
    qkv_split: Optional[tuple[int, int, int]]     # rows of q, k, v per query group (None: one matrix)
    bucket: Any = None                            # the DDP bucket when the piece is a 1/dp slice
    bucket_range: tuple[int, int] = (0, 0)        # the parameter's flat elements inside the bucket
    param_range: tuple[int, int] = (0, 0)         # the piece's flat elements inside the parameter


def orthogonalize_matrix(update: torch.Tensor, spec: Matrix, settings: MuonSettings) -> torch.Tensor:
    """``scale * extra * NS(update)`` of one tp-local matrix ``update`` (fp32, ``spec.shape``), tp-local out.
    Collectives: over ``spec.tp_group`` when the matrix is split (see the module docstring)."""
    tp = group_size(spec.tp_group) if spec.split_dim is not None else 1
    ns = dict(steps=settings.num_ns_steps, coefficient_type=settings.coefficient_type, bf16=settings.bf16)
    size = list(update.shape)
    if tp > 1:
        size[spec.split_dim] *= tp
    scale = scale_factor(size[0], size[1], settings.scale_mode) * settings.extra_scale_factor
    if tp == 1:
        return newton_schulz(update, **ns) * scale
    if settings.tp_mode == "duplicated":
        full = newton_schulz(_all_gather(update, spec.split_dim, spec.tp_group), **ns)
        return _split(full, spec.split_dim, spec.tp_group) * scale
    # distributed: the split dim becomes the column (contracted) dim of the Gram matrices
    return newton_schulz(update, **ns, tp_group=spec.tp_group, transpose=spec.split_dim == 0) * scale


def orthogonalize(update: torch.Tensor, spec: Matrix, settings: MuonSettings) -> torch.Tensor:
    """As ``orthogonalize_matrix``, the QKV weight cut into its q, k and v matrices first."""
    if spec.qkv_split is None:
        return orthogonalize_matrix(update, spec, settings)
    rows, cols = update.shape
    groups = rows // sum(spec.qkv_split)
    parts = torch.split(update.view(groups, sum(spec.qkv_split), cols), list(spec.qkv_split), dim=1)
    done = [orthogonalize_matrix(part.reshape(-1, cols), spec, settings).reshape(groups, -1, cols) for part in parts]
    return torch.cat(done, dim=1).reshape(rows, cols)


class Muon(torch.optim.AdamW):
    """AdamW over the groups without ``"muon": True``; Muon over those with it.

    Args:
        groups: param groups of fp32 master tensors (1-D); a Muon group's masters are keys of ``matrices``.
        matrices: ``{master: Matrix}`` of every Muon master.
        buckets: every DDP bucket holding a Muon matrix's slice on any rank of its dp group, in launch order
            (the same list on every rank of a pipeline stage): one dp all-gather each per step.
        settings: the Muon settings; the remaining keyword arguments go to ``torch.optim.AdamW``.
    State: ``momentum_buffer`` per Muon master (Megatron's name), ``exp_avg`` / ``exp_avg_sq`` / ``step`` per
    Adam master.
    """

    def __init__(self, groups: list[dict], *, matrices: dict[torch.Tensor, Matrix], buckets: list,
                 settings: MuonSettings, **adamw: Any) -> None:
        super().__init__(groups, **adamw)
        self.matrices, self.buckets, self.settings = matrices, buckets, settings

    @torch.no_grad()
    def step(self, closure=None) -> None:  # noqa: D102 (see the class docstring)
        everything = self.param_groups
        adam = [g for g in everything if not g.get("muon", False)]
        try:
            self.param_groups = adam
            if adam:
                super().step()
        finally:
            self.param_groups = everything
        self.muon_step()

    def muon_step(self) -> None:
        """Momentum, orthogonalized update and weight decay of every Muon master (collectives: module docstring)."""
        updates: dict[torch.Tensor, tuple[torch.Tensor, float]] = {}
        beta = self.settings.momentum
        for group in self.param_groups:
            if not group.get("muon", False):
                continue
            for master in group["params"]:
                if master.grad is None:
                    continue
                if group["weight_decay"] != 0.0:
                    master.add_(master, alpha=-group["weight_decay"] * group["lr"])
                buffer = self.state[master].setdefault("momentum_buffer", torch.zeros_like(master))
                buffer.lerp_(master.grad, 1 - beta)
                update = master.grad.lerp(buffer, beta) if self.settings.nesterov else buffer
                updates[master] = (update, group["lr"])
        whole = [(m, u, lr) for m, (u, lr) in updates.items() if self.matrices[m].bucket is None]
        for master, update, lr in whole:
            spec = self.matrices[master]
            master.add_(orthogonalize(update.view(spec.shape), spec, self.settings).reshape(-1), alpha=-lr)
        for bucket in self.buckets:
            self._step_bucket(bucket, {m: v for m, v in updates.items() if self.matrices[m].bucket is bucket})

    def _step_bucket(self, bucket, updates: dict[torch.Tensor, tuple[torch.Tensor, float]]) -> None:
        """The Muon masters that are slices of ``bucket``: all-gather the slices' updates over the bucket's dp
        group (fp32, ``[bucket.numel]``), orthogonalize each matrix a slice of this rank touches, apply its part."""
        shard = torch.zeros(bucket.shard_size, dtype=torch.float32, device=bucket.device)
        for master, (update, _) in updates.items():
            spec = self.matrices[master]
            start = spec.bucket_range[0] + spec.param_range[0] - bucket.shard_lo
            shard[start:start + update.numel()] = update
        full = shard
        if group_size(bucket.dp_group) > 1:
            full = torch.empty(bucket.numel, dtype=torch.float32, device=bucket.device)
            dist.all_gather_single(full, shard, group=bucket.dp_group)
        for master, (update, lr) in updates.items():
            spec = self.matrices[master]
            lo, hi = spec.bucket_range
            done = orthogonalize(full[lo:hi].view(spec.shape), spec, self.settings).reshape(-1)
            master.add_(done[spec.param_range[0]:spec.param_range[1]], alpha=-lr)


def _is_table_or_output(name: str, module: torch.nn.Module) -> bool:
    return isinstance(module, torch.nn.Embedding) or type(module).__name__.endswith("Embedding") or \
        name.split(".")[-1] == "output_layer"


def muon_parameters(chunks: list[torch.nn.Module], *, split_qkv: bool) -> dict[int, Optional[tuple[int, int, int]]]:
    """``{id(param): qkv_split or None}`` of the parameters Muon may update: trainable, not in an embedding table
    or the output layer (the caller keeps those of 2 dims: a ZeRO-3 parameter's own shape is empty between
    gathers); ``qkv_split`` the q, k, v rows per query group of a ``linear_qkv.weight``."""
    found: dict[int, Optional[tuple[int, int, int]]] = {}
    excluded: set[int] = set()
    for chunk in chunks:
        model = getattr(chunk, "module", chunk)  # a DistributedDataParallel chunk wraps its model
        config = getattr(model, "config", None)
        for name, module in model.named_modules():
            if _is_table_or_output(name, module):
                excluded.update(id(p) for p in module.parameters())
        for name, param in model.named_parameters():
            if not param.requires_grad or id(param) in excluded:
                continue
            qkv = None
            if split_qkv and name.endswith("linear_qkv.weight") and config is not None:
                kv = config.kv_channels
                qkv = (config.num_attention_heads // config.num_query_groups * kv, kv, kv)
            found[id(param)] = qkv
    return found


def matrix_of(piece: Any, qkv_split: Optional[tuple[int, int, int]], *, tp_mode: str, tp_group) -> Matrix:
    """The ``Matrix`` of an optimizer piece (``MegatronOptimizer``'s ``_Piece``) of a Muon parameter."""
    param = piece.param
    split = getattr(param, "partition_dim", -1) if getattr(param, "tensor_model_parallel", False) else -1
    split_dim = None if split < 0 or tp_mode == "blockwise" or group_size(tp_group) == 1 else split
    bucket = piece.bucket if piece.is_shard else None
    return Matrix(shape=tuple(piece.param_shape), split_dim=split_dim, tp_group=tp_group, qkv_split=qkv_split,
                  bucket=bucket, bucket_range=bucket.ranges[param] if bucket is not None else (0, 0),
                  param_range=piece.param_range)


__all__ = ["COEFFICIENTS", "MATMUL_PRECISIONS", "Matrix", "Muon", "MuonSettings", "SCALE_MODES", "TP_MODES",
           "coefficient_schedule", "matrix_of", "muon_parameters", "newton_schulz", "orthogonalize", "scale_factor"]
