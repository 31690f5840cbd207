"""FP8 quantizers against references written from the formats' definitions (bits, bias, range; OCP MX v1.0 for
the E8M0 block scales): the casts' round-to-nearest-even with subnormals, saturation, NaN / inf, per-tensor,
blockwise (partial and zero blocks) and mxfp8 quantization bit for bit, delayed scaling's history and scale
update, and the _scaled_mm GEMM path against the emulation."""
import math

import numpy as np
import pytest
import torch

from megatron_core.fp8 import E4M3, E5M2, Fp8Config, Fp8ScalingState, quantize_blocks, quantize_mxfp8
from megatron_core.fp8.gemm import nt_gemm
from megatron_core.fp8.quantize import FP32_MAX, cast_to_fp8, quantize_tensorwise, quantize_with_scale, scale_from_amax

FORMATS = {"e4m3": E4M3, "e5m2": E5M2}


# -- references from the definitions -------------------------------------------------------------------------------

def ref_decode(byte: int, fmt) -> float:
    """The value of an FP8 bit pattern: sign, exponent field, mantissa field (E4M3fn: S.1111.111 is NaN, no
    inf; E5M2: exponent all ones is inf / NaN)."""
    m, e = fmt.mantissa_bits, fmt.exponent_bits
    sign = -1.0 if byte >> 7 else 1.0
    exponent, mantissa = (byte >> m) & ((1 << e) - 1), byte & ((1 << m) - 1)
    if fmt is E4M3 and exponent == 15 and mantissa == 7:
        return math.nan
    if fmt is E5M2 and exponent == 31:
        return sign * math.inf if mantissa == 0 else math.nan
    if exponent == 0:  # subnormal: 0.mantissa * 2**(1 - bias)
        return sign * mantissa * 2.0 ** (1 - fmt.exponent_bias - m)
    return sign * (1 + mantissa / 2 ** m) * 2.0 ** (exponent - fmt.exponent_bias)


def ref_round(value: float, fmt) -> float:
    """Round to nearest even on the format's grid after saturating to +-max (NaN stays NaN)."""
    if math.isnan(value):
        return math.nan
    value = min(max(value, -fmt.max), fmt.max)
    if value == 0:
        return value
    exponent = max(math.frexp(abs(value))[1] - 1, fmt.emin)  # floor(log2 |v|), subnormals share emin
    ulp = 2.0 ** (exponent - fmt.mantissa_bits)
    return math.copysign(round(abs(value) / ulp) * ulp, value)  # round(): half to even; |v| / ulp is exact


def ref_amax(values: np.ndarray) -> float:
    finite = np.abs(values[~np.isnan(values)])
    return float(finite.max()) if finite.size else 0.0


def ref_scale(amax: float, fmt, margin: int = 0) -> np.float32:
    if amax == 0 or not math.isfinite(amax):
        return np.float32(1.0)
    scale = np.float32(np.float32(fmt.max) / np.float32(amax)) / np.float32(2.0 ** margin)
    return np.float32(FP32_MAX) if np.isinf(scale) else scale


def ref_quantize(values: np.ndarray, scale: np.float32, fmt) -> np.ndarray:
    """fp32 ``values * scale`` (rounded to fp32 first, as the hardware), then the format's rounding."""
    scaled = (values.astype(np.float32) * np.float32(scale)).astype(np.float64)
    return np.vectorize(lambda v: ref_round(v, fmt), otypes=[np.float64])(scaled)


def ref_tensorwise(x: torch.Tensor, fmt, margin: int = 0):
    values = x.double().numpy()
    scale = ref_scale(ref_amax(values), fmt, margin)
    return ref_quantize(values, scale, fmt), np.float32(1.0) / scale


def ref_blocks(x: torch.Tensor, fmt, block):
    """Per block of ``block`` (partial edge blocks their own): scale fmt.max / amax (fp32)."""
    values = x.float().numpy()
    q, inv = np.zeros(values.shape), np.zeros(values.shape, dtype=np.float32)
    for r in range(0, values.shape[0], block[0]):
        for c in range(0, values.shape[1], block[1]):
            part = values[r:r + block[0], c:c + block[1]]
            scale = ref_scale(ref_amax(part.astype(np.float64)), fmt)
            q[r:r + block[0], c:c + block[1]] = ref_quantize(part, scale, fmt)
            inv[r:r + block[0], c:c + block[1]] = np.float32(1.0) / scale
    return q, inv


def ref_mx(x: torch.Tensor, fmt, size: int = 32):
    """OCP MX v1.0: X = 2**(floor(log2(amax)) - emax_elem), clamped to E8M0's [-127, 127]; P = round(V / X)."""
    values = x.float().numpy()
    q, exps = np.zeros(values.shape), []
    for r in range(values.shape[0]):
        row = []
        for c in range(0, values.shape[1], size):
            part = values[r, c:c + size]
            amax = ref_amax(part.astype(np.float64))
            e = 0 if amax == 0 or not math.isfinite(amax) else min(max(math.frexp(amax)[1] - 1 - fmt.emax, -127), 127)
            q[r, c:c + size] = [ref_round(float(v) * 2.0 ** -e, fmt) for v in part]  # exact: a power of two
            row.append(e)
        exps.append(row)
    return q, np.array(exps)


def same(actual: torch.Tensor, expected: np.ndarray) -> None:
    """Bit equality of values, NaNs in the same places."""
    actual = actual.double().numpy()
    np.testing.assert_array_equal(np.isnan(actual), np.isnan(expected))
    np.testing.assert_array_equal(np.nan_to_num(actual), np.nan_to_num(expected))


def sample(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * torch.exp2(torch.randint(-12, 6, (rows, cols), generator=g).float())
    return x


# -- the element formats -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", FORMATS)
def test_every_bit_pattern_decodes_as_defined(name):
    fmt = FORMATS[name]
    decoded = torch.arange(256, dtype=torch.uint8).view(fmt.dtype).double().numpy()
    same(torch.from_numpy(decoded), np.array([ref_decode(b, fmt) for b in range(256)]))
    finite = decoded[np.isfinite(decoded)]
    assert finite.max() == fmt.max == {"e4m3": 448.0, "e5m2": 57344.0}[name]
    assert finite[finite > 0].min() == 2.0 ** (fmt.emin - fmt.mantissa_bits)  # smallest subnormal


@pytest.mark.parametrize("name", FORMATS)
def test_cast_rounds_to_nearest_even_and_saturates(name):
    fmt = FORMATS[name]
    grid = np.unique(np.abs([ref_decode(b, fmt) for b in range(256)]))
    grid = grid[np.isfinite(grid)]
    midpoints = (grid[1:] + grid[:-1]) / 2  # ties: to the even mantissa
    specials = [fmt.max * 1.01, fmt.max * 1.0625, 1e30, math.inf, -math.inf, math.nan, 0.0, -0.0,
                grid[1] / 2, grid[1] * 0.49, grid[1] * 0.51, 2.0 ** fmt.emin * (1 - 2 ** -10)]
    values = np.concatenate([grid, midpoints, midpoints * (1 + 2 ** -20), midpoints * (1 - 2 ** -20), specials])
    values = np.concatenate([values, -values]).astype(np.float32)
    q = cast_to_fp8(torch.from_numpy(values), fmt)
    same(q.float(), np.array([ref_round(float(v), fmt) for v in values]))
    assert not torch.isinf(q.float()).any()


# -- per-tensor scaling --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("margin", [0, 2])
def test_tensorwise_bit_equal_to_reference(name, margin):
    fmt = FORMATS[name]
    x = sample(17, 23)
    x[0, 0], x[5, 6] = math.nan, -1e-42  # NaN ignored by the amax and kept
    x[1, :3] = torch.tensor([2.0 ** -30, 3e-45, -7e-40])  # underflow to zero / subnormals
    q = quantize_tensorwise(x, fmt, margin)
    expected, inv = ref_tensorwise(x, fmt, margin)
    same(q.data.float(), expected)
    assert q.scale_inv.item() == inv
    same(q.dequantize(), (expected.astype(np.float32) * inv).astype(np.float64))
    x[3, 4] = -math.inf  # a non-finite amax: scale 1, the inf saturates
    q = quantize_tensorwise(x, fmt, margin)
    assert q.scale_inv.item() == 1.0 and q.data[3, 4].float().item() == -fmt.max
    same(q.data.float(), ref_tensorwise(x, fmt, margin)[0])


def test_scale_edge_cases():
    amax = torch.tensor([0.0, math.inf, math.nan, 1e-45, 448.0, 2.0])
    scale = scale_from_amax(amax, E4M3, margin=1)
    assert scale.tolist() == [1.0, 1.0, 1.0, FP32_MAX, 0.5, np.float32(448.0 / 2.0) / 2]
    q = quantize_tensorwise(torch.zeros(4, 4), E4M3)  # all zeros: scale 1
    assert q.scale_inv.item() == 1.0 and (q.data.float() == 0).all()


def test_tensorwise_per_group_and_empty():
    x = sample(3 * 5, 8).view(3, 5, 8)
    q = quantize_tensorwise(x, E5M2)
    for e in range(3):  # one scale per leading index (a grouped GEMM's experts)
        expected, inv = ref_tensorwise(x[e], E5M2)
        same(q.data[e].float(), expected)
        assert q.scale_inv[e].item() == inv
    empty = quantize_tensorwise(torch.zeros(0, 8), E4M3)
    assert empty.data.shape == (0, 8) and empty.scale_inv.item() == 1.0


# -- block scaling -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("block,shape", [((1, 128), (3, 300)), ((128, 128), (130, 200)), ((1, 128), (2, 64))])
@pytest.mark.parametrize("name", FORMATS)
def test_blockwise_bit_equal_to_reference(block, shape, name):
    fmt = FORMATS[name]
    x = sample(*shape, seed=1)
    x[0, :128] = 0.0  # a zero block: scale 1
    x[-1, -1], x[1, 5] = math.nan, -math.inf
    q = quantize_blocks(x, fmt, block)
    expected, inv = ref_blocks(x, fmt, block)
    same(q.data.float(), expected)
    np.testing.assert_array_equal(q.expanded_scale_inv().numpy(), inv)
    assert q.scale_inv.shape == (math.ceil(shape[0] / block[0]), math.ceil(shape[1] / block[1]))
    assert q.scale_inv[0, 0] == 1.0 or block[0] > 1


def test_square_blocks_are_transpose_invariant():
    w = sample(200, 130, seed=2)
    direct, transposed = quantize_blocks(w.t().contiguous(), E4M3, (128, 128)), quantize_blocks(w, E4M3, (128, 128)).t()
    assert torch.equal(direct.data.view(torch.uint8), transposed.data.contiguous().view(torch.uint8))
    assert torch.equal(direct.dequantize(), transposed.dequantize())


@pytest.mark.parametrize("name", FORMATS)
def test_mxfp8_bit_equal_to_reference(name):
    fmt = FORMATS[name]
    x = sample(4, 72, seed=3)  # blocks of 32, 32 and a partial 8
    x[0, :32] = 0.0
    x[1, :32] = torch.linspace(-480.0, 480.0, 32)  # amax/X in [256, 512): 480 saturates to 448 (E4M3)
    x[2, 32:64] = torch.full((32,), 3e-41)  # subnormal fp32 amax: exponent clamped at -127
    x[3, 5], x[3, 40] = math.nan, math.inf
    q = quantize_mxfp8(x, fmt)
    expected, exps = ref_mx(x, fmt)
    same(q.data.float(), expected)
    np.testing.assert_array_equal(q.scale_e8m0.numpy().astype(int), exps + 127)
    np.testing.assert_array_equal(q.scale_e8m0.view(torch.float8_e8m0fnu).float().numpy(), 2.0 ** exps)
    assert exps[2, 1] == -127 and exps[0, 0] == 0
    if fmt is E4M3:
        assert q.data[1, 0].float().item() == -448.0 and exps[1, 0] == 0


def test_mxfp8_scale_exponent_follows_the_spec():
    """X = 2**(floor(log2 amax) - emax): amax 1.0 -> 2**-8 for E4M3 (emax 8) and 2**-15 for E5M2 (emax 15)."""
    x = torch.zeros(1, 32)
    x[0, 0] = 1.0
    x[0, 1] = 1.5
    for fmt, emax in ((E4M3, 8), (E5M2, 15)):
        q = quantize_mxfp8(x, fmt)
        assert q.scale_inv.item() == 2.0 ** -emax
        assert q.data[0, 0].float().item() == 2.0 ** emax and q.dequantize()[0, 1].item() == 1.5


# -- delayed scaling -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("algo", ["most_recent", "max"])
def test_delayed_history_and_scales(algo):
    config = Fp8Config(fp8_recipe="delayed", fp8_amax_history_len=3, fp8_amax_compute_algo=algo, fp8_margin=1)
    state = Fp8ScalingState(config)
    assert state.fp8_scale.tolist() == [0.0, 0.0, 0.0]  # not calibrated: the first step runs unquantized
    assert state.view().ready("weight").item() is False
    steps = [[0.0, 2.0, 8.0], [1.0, 0.0, 16.0], [2.0, 0.5, math.inf], [0.5, 0.25, 1.0]]
    history, scale = [[0.0] * 3 for _ in range(3)], [0.0, 0.0, 0.0]
    maxima = (448.0, 448.0, 57344.0)
    for amax in steps:
        view = state.view()
        for role, value in zip(("input", "weight", "grad_output"), amax):
            view.record(role, torch.tensor(value / 2))  # the step's max wins
            view.record(role, torch.tensor(value))
        state.advance(state.fp8_amax_step.clone())
        for i, value in enumerate(amax):
            history[i] = [value] + history[i][:-1]
            chosen = history[i][0] if algo == "most_recent" else max(history[i])
            if chosen > 0 and math.isfinite(chosen):  # else the previous scale stays
                scale[i] = float(np.float32(np.float32(maxima[i]) / np.float32(chosen)) / np.float32(2.0))
        assert state.fp8_amax_history.tolist() == history
        assert state.fp8_scale.tolist() == scale
        assert (state.fp8_amax_step == 0).all()
        assert (state.view().ready("input") is None) == all(s > 0 for s in scale)
    assert {name for name, _ in state.named_buffers()} >= {"fp8_amax_history", "fp8_scale"}
    assert set(state.state_dict()) == {"fp8_amax_history", "fp8_scale"}  # the step's amaxes are not persistent


def test_delayed_quantizes_with_the_stored_scale():
    x = sample(6, 10, seed=4)
    q = quantize_with_scale(x, torch.tensor(3.0), E4M3)
    same(q.data.float(), ref_quantize(x.double().numpy(), np.float32(3.0), E4M3))
    assert q.scale_inv.item() == np.float32(1.0) / np.float32(3.0)


# -- the GEMM paths ------------------------------------------------------------------------------------------------

def test_scaled_mm_path_matches_the_emulation():
    a, b = quantize_tensorwise(sample(20, 48, 5), E5M2), quantize_tensorwise(sample(24, 48, 6), E4M3)
    bias = torch.randn(24)
    emulated = nt_gemm(a, b, out_dtype=torch.float32, bias=bias, backend="emulate")
    scaled = nt_gemm(a, b, out_dtype=torch.float32, bias=bias, backend="scaled_mm")  # torch's CPU kernel
    torch.testing.assert_close(scaled, emulated, rtol=1e-6, atol=1e-6)
    reference = a.dequantize() @ b.dequantize().t() + bias
    assert torch.equal(emulated, reference)


def test_block_operands_under_scaled_mm_warn_and_emulate():
    a, b = quantize_blocks(sample(4, 40), E4M3), quantize_blocks(sample(6, 40), E4M3, (128, 128))
    with pytest.warns(UserWarning, match="emulated"):
        out = nt_gemm(a, b, out_dtype=torch.bfloat16, backend="scaled_mm")
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, (a.dequantize() @ b.dequantize().t()).bfloat16())


@pytest.mark.parametrize("weight_block", [(128, 128), (1, 128)])
def test_blockwise_scaled_mm_scales_have_the_layout_torch_checks(weight_block):
    """The Hopper blockwise path (untested on a GPU here) hands F.scaled_mm scales in the shapes and strides
    torch's meta kernel demands (1x128: [rows, R/128] column-major; 128x128: [R/128 padded to 4, N/128])."""
    import dataclasses

    from megatron_core.fp8.gemm import _blockwise_scaled_mm

    def on_meta(q):
        return dataclasses.replace(q, data=q.data.to("meta"), scale_inv=q.scale_inv.to("meta"))
    a, b = quantize_blocks(sample(256, 640), E4M3), quantize_blocks(sample(384, 640, 2), E4M3, weight_block)
    out = _blockwise_scaled_mm(on_meta(a), on_meta(b))  # R/128 = 5: the 128x128 scales are padded to 8
    assert out.shape == (256, 384) and out.dtype == torch.float32


def test_auto_backend_makes_no_cuda_call_on_cpu(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("torch.cuda called on a CPU code path")
    monkeypatch.setattr(torch.cuda, "get_device_capability", refuse)
    monkeypatch.setattr(torch.cuda, "is_available", refuse)
    a, b = quantize_tensorwise(sample(4, 8), E4M3), quantize_tensorwise(sample(3, 8), E4M3)
    assert nt_gemm(a, b, out_dtype=torch.float32).shape == (4, 3)


def test_bad_settings_name_the_value():
    with pytest.raises(ValueError, match="fp8_gemm_backend"):
        Fp8Config(fp8_gemm_backend="cublas")
    with pytest.raises(ValueError, match="delayed recipe's state"):
        Fp8ScalingState(Fp8Config(fp8_recipe="tensorwise"))
