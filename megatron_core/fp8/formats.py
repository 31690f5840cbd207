"""The FP8 element formats (OCP 8-bit floating point, as ``torch.float8_e4m3fn`` / ``torch.float8_e5m2``) and
which one each GEMM operand of a recipe uses.

E4M3 (``fn``: finite, no infinities): 1 sign, 4 exponent bits (bias 7), 3 mantissa bits; the all-ones exponent
with mantissa 111 is NaN, so the largest finite value is ``1.75 * 2**8 = 448``; normals down to ``2**-6``,
subnormals in steps of ``2**-9``.
E5M2 (IEEE-like): 1 sign, 5 exponent bits (bias 15), 2 mantissa bits; the all-ones exponent is inf/NaN, so the
largest finite value is ``1.75 * 2**15 = 57344``; normals down to ``2**-14``, subnormals in steps of ``2**-16``.
E8M0 (MX block scales): 8 exponent bits (bias 127), no sign or mantissa: ``2**(byte - 127)`` for bytes
0..254, 255 is NaN.
"""
from __future__ import annotations

import dataclasses
from types import MappingProxyType

import torch


@dataclasses.dataclass(frozen=True)
class Fp8Format:
    """One FP8 element format: its torch dtype and its definition (bits, bias, range)."""
    name: str
    dtype: torch.dtype
    exponent_bits: int
    mantissa_bits: int
    exponent_bias: int
    max: float
    """Largest finite magnitude (quantization saturates to +-max)."""
    emax: int
    """Exponent of the largest normal (``floor(log2(max))``): 8 for E4M3, 15 for E5M2 (the OCP MX ``emax_elem``)."""

    @property
    def emin(self) -> int:
        """Exponent of the smallest normal: ``1 - bias``."""
        return 1 - self.exponent_bias


E4M3 = Fp8Format("e4m3", torch.float8_e4m3fn, exponent_bits=4, mantissa_bits=3, exponent_bias=7, max=448.0, emax=8)
E5M2 = Fp8Format("e5m2", torch.float8_e5m2, exponent_bits=5, mantissa_bits=2, exponent_bias=15, max=57344.0,
                 emax=15)
FORMATS = MappingProxyType({"e4m3": E4M3, "e5m2": E5M2})

E8M0_BIAS = 127
E8M0_MIN_EXPONENT, E8M0_MAX_EXPONENT = -127, 127
"""Range of an E8M0 scale's exponent (byte 255 is NaN and never produced)."""

ROLES = ("input", "weight", "grad_output")
"""The tensors of a linear layer that are quantized; index order of the scaling state's rows."""
ROLE_INDEX = MappingProxyType({role: i for i, role in enumerate(ROLES)})


def role_format(fp8_format: str, role: str) -> Fp8Format:
    """The element format of ``role`` under ``fp8_format`` ("hybrid": E5M2 for output gradients, E4M3 for the
    rest; "e4m3": E4M3 everywhere)."""
    if role not in ROLE_INDEX:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    if fp8_format == "hybrid" and role == "grad_output":
        return E5M2
    if fp8_format in ("hybrid", "e4m3"):
        return E4M3
    raise ValueError(f"fp8_format must be 'hybrid' or 'e4m3', got {fp8_format!r}")


__all__ = ["Fp8Format", "E4M3", "E5M2", "FORMATS", "ROLES", "ROLE_INDEX", "role_format", "E8M0_BIAS",
           "E8M0_MIN_EXPONENT", "E8M0_MAX_EXPONENT"]
