"""``OptimizerConfig``: Megatron's optimizer settings (names follow Megatron's ``OptimizerConfig`` / flags)."""
from __future__ import annotations

import dataclasses
from typing import Optional

from megatron_core.optimizer.muon import COEFFICIENTS, MATMUL_PRECISIONS, SCALE_MODES, TP_MODES

OPTIMIZERS = ("adam", "sgd", "muon")
HOST_ADAMS = ("exact", "fused")


@dataclasses.dataclass(kw_only=True)
class OptimizerConfig:
    """Optimizer, precision, loss scaling, clipping and offload. Invalid values raise ``ValueError``."""

    optimizer: str = "adam"
    """``adam``: AdamW (decoupled weight decay), as Megatron's ``--optimizer adam``. ``sgd``: SGD with momentum
    (L2 weight decay added to the grad, as ``torch.optim.SGD``). ``muon``: Muon for the weight matrices, AdamW
    (the ``adam_*`` settings) for embeddings, output layer, norms and biases, as Megatron's ``--optimizer muon``
    (``megatron_core.optimizer.muon``)."""
    lr: float = 1e-3
    weight_decay: float = 0.01
    """Applied to parameters with 2 or more dims only: biases and norm weights (1-D) get none, as Megatron's
    default ``no_weight_decay_cond``."""
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    sgd_momentum: float = 0.9
    clip_grad: float = 1.0
    """Clip by global L2 norm (``--clip-grad``); 0 disables clipping (the norm is still returned)."""
    bf16: bool = False
    """bf16 model: fp32 master weights, no loss scaling (``--bf16``)."""
    fp16: bool = False
    """fp16 model: fp32 master weights and loss scaling (``--fp16``)."""
    loss_scale: Optional[float] = None
    """A static loss scale (``--loss-scale``); None with fp16 means dynamic loss scaling."""
    initial_loss_scale: float = 2.0 ** 32
    min_loss_scale: float = 1.0
    loss_scale_window: int = 1000
    """Good steps after which the dynamic scale doubles."""
    hysteresis: int = 2
    """Overflowing steps (since the last growth) tolerated before the dynamic scale halves."""
    optimizer_cpu_offload: bool = False
    """Keep master weights and optimizer states on the host and run the update there
    (``--optimizer-cpu-offload``)."""
    optimizer_nvme_offload_dir: Optional[str] = None
    """Keep this rank's fp32 master weights and Adam states in files under this folder (on an NVMe disk) and
    stream them through the update in chunks (``--optimizer-nvme-offload-dir``; DeepSpeed's
    ``offload_optimizer: {device: nvme}``). Adam only."""
    optimizer_nvme_chunk_elements: int = 4 * 2 ** 20
    """Elements per streamed chunk (``--optimizer-nvme-chunk-elements``): at most three chunks of masters and
    moments (``3 * 12`` bytes per element) are in memory during a step, none between steps."""
    optimizer_host_adam: str = "exact"
    """The Adam kernel of the host update (CPU or NVMe offload; ``--optimizer-host-adam``): ``exact`` repeats
    ``torch.optim.AdamW``'s op-by-op math (bit-identical to the in-memory run), ``fused`` uses torch's fused,
    vectorized CPU kernel (one pass over memory, several times faster; within an ulp of ``exact``)."""
    fused_adam: bool = True
    """The in-memory Adam update (no CPU/NVMe offload) runs torch's fused AdamW kernel
    (``torch.optim.AdamW(fused=True)``: one vectorized pass over each tensor, ~2.5x faster than the per-op update
    on CPU; within an ulp per step of ``torch.optim.AdamW``'s default math, not bit-identical), as Megatron-LM
    uses a fused Adam. False (``--no-fused-adam``): the per-op update, bit-identical to ``torch.optim.AdamW()``
    and to ``optimizer_host_adam="exact"`` offload. Devices the fused kernel does not cover run the per-op
    update."""
    muon_momentum: float = 0.9
    """Muon's momentum EMA coefficient (``--muon-momentum``; the default of Megatron-LM's flag)."""
    muon_use_nesterov: bool = False
    """Nesterov momentum (``--muon-nesterov``)."""
    muon_split_qkv: bool = True
    """Orthogonalize the q, k and v rows of ``linear_qkv.weight`` apart (``--muon-no-split-qkv``: whole)."""
    muon_num_ns_steps: int = 5
    """Newton-Schulz iterations (``--muon-num-ns-steps``)."""
    muon_coefficient_type: str = "quintic"
    """The iterations' coefficient set (``--muon-coefficient-type``): a key of ``muon.COEFFICIENTS``."""
    muon_scale_mode: str = "spectral"
    """The update's shape scale (``--muon-scale-mode``): spectral, unit_rms_norm or shape_scaling."""
    muon_extra_scale_factor: float = 1.0
    """A further factor on the update (``--muon-extra-scale-factor``; 0.2 matches AdamW's update RMS)."""
    muon_fp32_matmul_prec: str = "medium"
    """``low`` / ``medium``: the Newton-Schulz GEMMs in bf16 (Megatron's default); ``high``: in fp32."""
    muon_tp_mode: str = "duplicated"
    """A tp-split matrix: ``duplicated`` (gathered and orthogonalized whole on every tp rank), ``distributed``
    (Gram matrices all-reduced over tp) or ``blockwise`` (each tp part on its own)."""
    log_num_zeros_in_grad: bool = False
    """Count zero grad elements (``--log-num-zeros-in-grad``); else ``step()`` returns None for it."""

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer {self.optimizer!r} is not one of {OPTIMIZERS}")
        if self.fp16 and self.bf16:
            raise ValueError("fp16=True and bf16=True were both set: choose one precision (--fp16 or --bf16)")
        for name in ("lr", "weight_decay", "clip_grad", "adam_eps", "sgd_momentum"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} {getattr(self, name)} must be >= 0")
        for name in ("adam_beta1", "adam_beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"{name} {getattr(self, name)} must be in [0, 1)")
        if self.optimizer_host_adam not in HOST_ADAMS:
            raise ValueError(f"optimizer_host_adam {self.optimizer_host_adam!r} is not one of {HOST_ADAMS}")
        if self.optimizer_nvme_offload_dir is not None:
            if self.optimizer != "adam" or self.optimizer_cpu_offload:
                raise ValueError(f"optimizer_nvme_offload_dir {self.optimizer_nvme_offload_dir!r} needs "
                                 f"optimizer='adam' (got {self.optimizer!r}) and optimizer_cpu_offload=False (got "
                                 f"{self.optimizer_cpu_offload}): NVMe offload already updates on the host")
            if self.optimizer_nvme_chunk_elements < 1:
                raise ValueError(f"optimizer_nvme_chunk_elements {self.optimizer_nvme_chunk_elements} must be >= 1")
        if self.optimizer == "muon":
            self._validate_muon()
        if self.loss_scale is not None and self.loss_scale <= 0:
            raise ValueError(f"loss_scale {self.loss_scale} must be > 0 (or None for dynamic scaling)")
        if self.initial_loss_scale <= 0 or self.min_loss_scale <= 0:
            raise ValueError(f"initial_loss_scale {self.initial_loss_scale} and min_loss_scale "
                             f"{self.min_loss_scale} must be > 0")
        if self.loss_scale_window < 1 or self.hysteresis < 1:
            raise ValueError(f"loss_scale_window {self.loss_scale_window} and hysteresis {self.hysteresis} "
                             "must be >= 1")

    def _validate_muon(self) -> None:
        choices = {"muon_coefficient_type": tuple(COEFFICIENTS), "muon_scale_mode": SCALE_MODES,
                   "muon_tp_mode": TP_MODES, "muon_fp32_matmul_prec": MATMUL_PRECISIONS}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} {getattr(self, name)!r} is not one of {allowed}")
        if not 0.0 <= self.muon_momentum < 1.0:
            raise ValueError(f"muon_momentum {self.muon_momentum} must be in [0, 1)")
        if self.muon_num_ns_steps < 1:
            raise ValueError(f"muon_num_ns_steps {self.muon_num_ns_steps} must be >= 1")
        if self.optimizer_cpu_offload or self.optimizer_nvme_offload_dir is not None:
            raise ValueError("optimizer='muon' with optimizer_cpu_offload or optimizer_nvme_offload_dir is not built "
                             "(the Newton-Schulz iterations run where the weights are): drop the offload or use adam")
