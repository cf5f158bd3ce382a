"""Fused FP8 activation staging for the Hopper FP8 frontend: one kernel launch turns bf16 x [T, H] into the
e4m3 bytes and fp32 1x128 block scales that moe_ep's reference quantizer (`fp8_quantize_rows(x, 128,
reciprocal=False)`) produces for the same input on the same device, byte for byte.

    stage_fp8_blocks(x, q_out, s_out)       # rows [0, T) of q_out, columns [0, H/128) of rows [0, T) of s_out

On a CUDA device with Triton it launches one Triton kernel (no host sync, no allocation: CUDA-graph
capturable once compiled); elsewhere it runs the reference quantizer and copies (the CPU path, and the
definition the kernel is checked against). `simulate_fused` replays the kernel's arithmetic op by op in
torch on the CPU, so a change of the op order is caught without a GPU (tests/shim/sm90/fp8_staging_test.py);
tools/diag/fp8_staging_check.py compares kernel, simulation and reference on the GPU.

Bit-exactness: what the reference does per 1x128 block, and why the kernel rounds at the same places
--------------------------------------------------------------------------------------------------------
The reference (moe_ep.formats.codecs.fp8_quantize_rows), on any device:
  1. x32 = fp32(x)                          exact (bf16 is a prefix of fp32)
  2. amax = max |x32|                       exact (a max picks one of its inputs); NaN propagates
  3. s = amax * fl32(1/448)                 ONE rounding. Spelled as a multiply because torch's CUDA `div` by a
                                            Python scalar computes exactly that (BinaryDivTrueKernel.cu) while
                                            torch on the CPU divides; the two differ by one ulp for 15543 of the
                                            32640 finite bf16 amax values, so the format now names the multiply
                                            and the reference is the same on every device.
  4. s = max(s, fl32(1e-30))                exact; NaN stays NaN
  5. y = x32 / s                            ONE rounding: IEEE division (div.rn.f32)
  6. y = clamp(y, -448, 448)                exact; NaN stays NaN
  7. e4m3 = RNE(y)                          ONE rounding: c10's fp32->e4m3fn routine, or cvt.rn.satfinite
                                            where torch is built to use the intrinsic; the two agree for
                                            |y| <= 448 and give the NaN code 0x7F | sign for NaN.
The kernel (shim/sm90/fp8_staging_kernel.py; `simulate_fused` below is the same sequence in torch):
  1. bf16 -> fp32                           exact
  2. integer max of the fp32 bit patterns with the sign bit cleared: for non-negative floats the bit order is
     the value order and every NaN pattern lies above +inf, so this is max |x| with NaN propagating, and it
     does not depend on how `tl.max` treats NaN on floats (it does not promise to propagate it).
  3. s = amax * RCP_E4M3_MAX (fp32 multiply, round to nearest), RCP_E4M3_MAX = fl32(1/448): the same single
     rounding as the reference. (`scale_by_reciprocal=False` uses tl.math.div_rn(amax, 448.0), an IEEE
     division; the GPU check runs it to show the two really differ there.)
     448 * fl32(1/448) == 1.0 exactly, so a block whose amax is 448 * 2^k gets s = 2^k either way.
  4. s = where(s < fl32(1e-30), fl32(1e-30), s): NaN compares false and stays.
  5. y = tl.math.div_rn(x, s): llvm.nvvm.div.rn.f -> div.rn.f32, the IEEE quotient. (Triton's `/` on fp32
     lowers to div.full.f32, an approximation off by up to 2 ulp: the first suspect for the earlier attempt,
     together with step 3.)
  6-7. clamp and rounding in integer ops on y's bit pattern, the same algorithm as c10's
     fp8e4m3fn_from_fp32_value: NaN -> 0x7F | sign; |y| >= 448 (the clamp, and inf) -> 0x7E | sign;
     |y| < 2^-6 -> the e4m3 subnormal count from one fp32 addition of 2^14 (RNE at 2^-9 granularity);
     otherwise add 0x7FFFF + (bit 20) to the bits and shift right by 20 (RNE on the 20 dropped mantissa
     bits). One rounding from fp32, to nearest even; no fp16 intermediate, and no dependence on how a Triton
     version lowers fp32 -> fp8 (some paths there go through fp16, which rounds twice). `hw_cvt=True`
     switches to Triton's own `.to(tl.float8e4nv, fp_downcast_rounding="rtne")` for the GPU check only.
Flush-to-zero, if a compiler applied it, changes no output: a subnormal x gives |y| < 2^-126 / 1e-30 <
2^-10 (rounds to a signed zero either way), s >= 1e-30 is never subnormal, a subnormal amax * RCP is below the
floor either way, and zero keeps its sign. No multiply feeds an add, so FMA contraction cannot merge roundings.
-0.0: |.| clears the sign for the amax; x / s keeps it; the encoding gives 0x80. All-zero block: s = 1e-30.
"""

from __future__ import annotations

import functools
import warnings
from typing import Optional, Tuple

import torch

from moe_ep.formats import codecs as _ref  # the reference quantizer (fp8_quantize_rows, to_e4m3) and constants

__all__ = [
    "BLOCK_K", "E4M3_MAX", "SCALE_FLOOR", "RCP_E4M3_MAX", "DEFAULT_CONFIG",
    "available", "unavailable_reason", "stage_fp8_blocks", "stage_fp8_blocks_reference", "launch_fused",
    "simulate_fused", "encode_e4m3_bits", "edge_case_rows", "stage_fp8_rows_reference", "launch_fused_rows",
    "simulate_fused_rows",
]

BLOCK_K: int = _ref.FP8_ACT_BLOCK_K            # 128: one fp32 scale per 1x128 block of a row
E4M3_MAX: float = float(_ref.E4M3_MAX)         # 448
SCALE_FLOOR: float = float(_ref.FP8_BLOCK_EPS)  # 1e-30 (rounded to fp32 where it is used, as torch does)
# fl32(1/448), computed the way torch's CUDA division by a scalar computes its reciprocal (in fp32).
RCP_E4M3_MAX: float = float(torch.tensor(1.0, dtype=torch.float32) / torch.tensor(E4M3_MAX, dtype=torch.float32))

# Launch shape: BLOCK_M rows x KB blocks of 128 columns per program (KB blocks one after the other).
DEFAULT_CONFIG = dict(block_m=32, blocks_per_program=1, num_warps=4)

_BACKENDS = ("auto", "triton", "torch")

# fp32 bit patterns used by the encoding: 448.0 (saturation: the reference clamps before its cast, so c10's own
# NaN threshold at 480 is never reached), 2^-6 (smallest e4m3 normal), 2^14 (the subnormal rounding magic), and
# the exponent rebias (7 - 127) << 23.
_F32_448 = 0x43E00000
_F32_2M6 = 121 << 23
_F32_2P14 = 141 << 23
_REBIAS = (7 - 127) << 23


# ------------------------------------------------------------------------------------------------ availability
@functools.lru_cache(maxsize=None)
def unavailable_reason() -> Optional[str]:
    """None when the fused path can run here, else why not."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception as e:  # ImportError, or a broken install
        return f"triton is not importable ({type(e).__name__}: {e})"
    if not torch.cuda.is_available():
        return "no CUDA device"
    return None


def available() -> bool:
    """Triton importable and a CUDA device present."""
    return unavailable_reason() is None


def check_fused(frontend, name: str, *, seed: int, decades: Tuple[int, int]) -> str:
    """"fused" when the fused kernel gives the format quantizer's bytes on this device, else "torch" (with a warning
    saying why). `frontend` stages a probe batch with its `stage_fused(x)` into its own input buffers (so the dtypes
    and strides the forwards stage into; the rows are restaged before the next launch reads them) and says with
    `fused_matches(x)` whether they hold the quantizer's bytes; the probe rows span 10^decades[0] .. 10^decades[1].
    Runs once compiled on a device, outside any graph capture."""
    if not available():
        return "torch"
    gen = torch.Generator().manual_seed(seed)
    t, h = min(64, frontend.max_tokens_per_rank), frontend.hidden_size
    x = torch.randn(t, h, generator=gen) * torch.logspace(*decades, t).unsqueeze(1)
    x = x.to(torch.bfloat16).to(frontend.device)
    # stacklevel 4: the warning points at whoever called compile() (-> check_on_device -> here).
    try:
        frontend.stage_fused(x)
        same = frontend.fused_matches(x)
    except Exception as e:  # noqa: BLE001 - any failure of the optional kernel means the torch path
        warnings.warn(f"fused {name} unavailable here ({type(e).__name__}: {e}); staging with torch ops",
                      RuntimeWarning, stacklevel=4)
        return "torch"
    if not same:
        warnings.warn(f"the fused {name} kernel's bytes differ from the format quantizer's on this device; staging "
                      "with torch ops", RuntimeWarning, stacklevel=4)
        return "torch"
    return "fused"


# --------------------------------------------------------------------------------------------------- checks
def _check(x: torch.Tensor, q_out: torch.Tensor, s_out: torch.Tensor) -> Tuple[int, int, int]:
    if not isinstance(x, torch.Tensor) or not isinstance(q_out, torch.Tensor) or not isinstance(s_out, torch.Tensor):
        raise TypeError("x, q_out and s_out must be torch tensors")
    if x.dtype != torch.bfloat16:
        raise TypeError(f"x must be bfloat16, got {x.dtype}")
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D [T, H], got shape {tuple(x.shape)}")
    t, h = x.shape
    if h == 0 or h % BLOCK_K:
        raise ValueError(f"H={h} must be a positive multiple of {BLOCK_K}")
    if t > 0 and x.stride(1) != 1:
        raise ValueError(f"x rows must be contiguous (stride(1) == 1), got strides {x.stride()}")
    if q_out.dtype not in (torch.float8_e4m3fn, torch.uint8):
        raise TypeError(f"q_out must be float8_e4m3fn or its uint8 view, got {q_out.dtype}")
    if q_out.dim() != 2 or q_out.shape[1] != h or q_out.shape[0] < t:
        raise ValueError(f"q_out must be [>= {t}, {h}], got shape {tuple(q_out.shape)}")
    if t > 0 and q_out.stride(1) != 1:
        raise ValueError(f"q_out rows must be contiguous (stride(1) == 1), got strides {q_out.stride()}")
    nb = h // BLOCK_K
    if s_out.dtype != torch.float32:
        raise TypeError(f"s_out must be float32, got {s_out.dtype}")
    if s_out.dim() != 2 or s_out.shape[0] < t or s_out.shape[1] < nb:
        raise ValueError(f"s_out must be [>= {t}, >= {nb}], got shape {tuple(s_out.shape)}")
    if not (x.device == q_out.device == s_out.device):
        raise ValueError(f"x, q_out and s_out must be on one device, got {x.device}, {q_out.device}, {s_out.device}")
    return t, h, nb


# ---------------------------------------------------------------------------------------------- public API
def stage_fp8_blocks(x: torch.Tensor, q_out: torch.Tensor, s_out: torch.Tensor, *, backend: str = "auto") -> None:
    """Quantize bf16 x [T, H] into q_out[:T] (e4m3 bytes) and s_out[:T, :H/128] (fp32 block scales).

    backend: "auto" (the fused kernel when x is on a CUDA device and Triton is importable, else the reference),
    "triton" (the fused kernel or an error) or "torch" (the reference quantizer, then two copies).
    Nothing outside those rows and columns is written; T = 0 writes nothing and launches nothing."""
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
    t, _, _ = _check(x, q_out, s_out)
    use_triton = backend == "triton" or (backend == "auto" and x.is_cuda and available())
    if backend == "triton":
        if unavailable_reason() is not None:
            raise RuntimeError(f"fused FP8 staging unavailable: {unavailable_reason()}")
        if not x.is_cuda:
            raise ValueError(f"backend='triton' needs CUDA tensors, got {x.device}")
    if t == 0:
        return
    if use_triton:
        launch_fused(x, q_out, s_out)
    else:
        stage_fp8_blocks_reference(x, q_out, s_out)


def stage_fp8_blocks_reference(x: torch.Tensor, q_out: torch.Tensor, s_out: torch.Tensor) -> None:
    """The definition: moe_ep's reference quantizer on x's device, copied into the outputs."""
    t, _, nb = _check(x, q_out, s_out)
    if t == 0:
        return
    q, s = _ref.fp8_quantize_rows(x, BLOCK_K, reciprocal=False)
    q_out[:t].view(torch.uint8).copy_(q.view(torch.uint8))
    s_out[:t, :nb].copy_(s)


def launch_fused(x: torch.Tensor, q_out: torch.Tensor, s_out: torch.Tensor, *, scale_by_reciprocal: bool = True,
                 hw_cvt: bool = False, scale_in: bool = False, block_m: Optional[int] = None,
                 blocks_per_program: Optional[int] = None, num_warps: Optional[int] = None) -> None:
    """The fused kernel with its knobs (stage_fp8_blocks uses the defaults; the GPU check varies them).

    scale_by_reciprocal: s = amax * fl32(1/448) (torch on CUDA) or IEEE amax / 448 (torch on the CPU).
    hw_cvt: Triton's own fp32 -> e4m3 cast instead of the integer RNE encoding (diagnostic).
    scale_in: read the scales from s_out instead of computing them (diagnostic: isolates steps 5-7)."""
    t, _, nb = _check(x, q_out, s_out)
    if not x.is_cuda:
        raise ValueError(f"the fused kernel needs CUDA tensors, got {x.device}")
    if t == 0:
        return
    bm = block_m or DEFAULT_CONFIG["block_m"]
    kb = blocks_per_program or DEFAULT_CONFIG["blocks_per_program"]
    nw = num_warps or DEFAULT_CONFIG["num_warps"]
    if bm & (bm - 1) or kb < 1:
        raise ValueError(f"block_m must be a power of two and blocks_per_program >= 1, got {bm}, {kb}")
    kernel = _kernel()
    q8 = q_out if q_out.dtype == torch.uint8 else q_out.view(torch.uint8)
    grid = ((t + bm - 1) // bm, (nb + kb - 1) // kb)
    with torch.cuda.device(x.device):
        kernel[grid](
            x, q8, s_out, t, x.stride(0), q8.stride(0), s_out.stride(0), s_out.stride(1), nb,
            RCP=RCP_E4M3_MAX, FLOOR=SCALE_FLOOR, FMAX=E4M3_MAX,
            SCALE_BY_RCP=bool(scale_by_reciprocal), HW_CVT=bool(hw_cvt), SCALE_IN=bool(scale_in),
            BLOCK_M=bm, BLOCK_K=BLOCK_K, KB=kb, num_warps=nw,
        )


# --------------------------------------------------------------------------------- one scale per row (W4A8)
def _check_rows(x: torch.Tensor, q_out: torch.Tensor, s_out: torch.Tensor) -> Tuple[int, int]:
    if x.dtype != torch.bfloat16 or x.dim() != 2:
        raise TypeError(f"x must be bfloat16 [T, H], got {x.dtype} {tuple(x.shape)}")
    t, h = x.shape
    if t > 0 and x.stride(1) != 1:
        raise ValueError(f"x rows must be contiguous (stride(1) == 1), got strides {x.stride()}")
    if q_out.dtype not in (torch.float8_e4m3fn, torch.uint8) or q_out.dim() != 2 or q_out.shape[1] != h \
            or q_out.shape[0] < t or (t > 0 and q_out.stride(1) != 1):
        raise ValueError(f"q_out must be e4m3 (or uint8) [>= {t}, {h}] with contiguous rows, got {q_out.dtype} "
                         f"{tuple(q_out.shape)}")
    if s_out.dtype != torch.float32 or s_out.dim() != 2 or s_out.shape[0] < t or s_out.shape[1] < 1 \
            or (t > 0 and s_out.stride(1) != 1):
        raise ValueError(f"s_out must be float32 [>= {t}, >= 1] with contiguous rows, got {s_out.dtype} "
                         f"{tuple(s_out.shape)}")
    return t, h


def stage_fp8_rows_reference(x: torch.Tensor, q_out: torch.Tensor, s_out: torch.Tensor) -> None:
    """The definition of the per-row staging: moe_ep's quantizer with one block spanning the row, the scale
    written into every column of s_out's rows (the W4A8 kernel's replicated scale row)."""
    t, h = _check_rows(x, q_out, s_out)
    if t == 0:
        return
    q, s = _ref.fp8_quantize_rows(x, h, reciprocal=False)
    q_out[:t].view(torch.uint8).copy_(q.view(torch.uint8))
    s_out[:t].copy_(s.expand(t, s_out.shape[1]))


def launch_fused_rows(x: torch.Tensor, q_out: torch.Tensor, s_out: torch.Tensor, *, block: int = 1024,
                      num_warps: int = 4) -> None:
    """One Triton launch: stage_fp8_rows_reference's bytes (one program per row)."""
    t, h = _check_rows(x, q_out, s_out)
    if not x.is_cuda:
        raise ValueError(f"the fused kernel needs CUDA tensors, got {x.device}")
    if t == 0:
        return
    rep = s_out.shape[1]
    if rep & (rep - 1) or block & (block - 1):
        raise ValueError(f"s_out's width ({rep}) and block ({block}) must be powers of two")
    q8 = q_out if q_out.dtype == torch.uint8 else q_out.view(torch.uint8)
    with torch.cuda.device(x.device):
        _rows_kernel()[(t,)](x, q8, s_out, t, h, x.stride(0), q8.stride(0), s_out.stride(0),
                             RCP=RCP_E4M3_MAX, FLOOR=SCALE_FLOOR, S_REP=rep, BLOCK=block, num_warps=num_warps)


def simulate_fused_rows(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """fp8_stage_rows_kernel's arithmetic, op for op, in torch on the CPU -> (q uint8 [T, H], s fp32 [T])."""
    xb = x.detach().cpu().to(torch.float32)                                         # 1.
    amax = (xb.view(torch.int32) & 0x7FFFFFFF).amax(dim=-1).view(torch.float32)    # 2.
    s = amax * torch.tensor(RCP_E4M3_MAX, dtype=torch.float32)                      # 3.
    floor = torch.tensor(SCALE_FLOOR, dtype=torch.float32)
    s = torch.where(s < floor, floor, s)                                            # 4.
    return encode_e4m3_bits(xb / s.unsqueeze(-1)), s                                # 5-7.


# ------------------------------------------------------------------------------------------------- the kernel
@functools.lru_cache(maxsize=None)
def _rows_kernel():
    from shim.sm90 import fp8_staging_kernel

    return fp8_staging_kernel.fp8_stage_rows_kernel


@functools.lru_cache(maxsize=None)
def _kernel():
    """The Triton kernel (shim/sm90/fp8_staging_kernel.py), imported on first use: Triton is never imported at
    module import, and the jit functions live at that module's top level, where Triton resolves their names."""
    from shim.sm90 import fp8_staging_kernel

    return fp8_staging_kernel.fp8_stage_kernel


# ------------------------------------------------------------------------------------------ CPU simulation
def encode_e4m3_bits(y: torch.Tensor) -> torch.Tensor:
    """fp32 -> e4m3fn codes (uint8) by the kernel's integer algorithm (steps 6-7), in torch on y's device."""
    if y.dtype != torch.float32:
        raise TypeError(f"y must be float32, got {y.dtype}")
    bits = y.contiguous().view(torch.int32).to(torch.int64)  # int64: no wrap-around in the unused lanes
    sign = (bits >> 31) & 1
    mag = bits & 0x7FFFFFFF
    normal = (mag + _REBIAS + 0x7FFFF + ((mag >> 20) & 1)) >> 20
    mag32 = mag.to(torch.int32)
    sub_f = torch.where(mag32 < _F32_2M6, mag32, torch.zeros_like(mag32)).view(torch.float32)
    sub = (sub_f + 16384.0).view(torch.int32).to(torch.int64) - _F32_2P14
    code = torch.where(mag < _F32_2M6, sub, normal)
    code = torch.where(mag >= _F32_448, torch.full_like(code, 0x7E), code)
    code = torch.where(mag > 0x7F800000, torch.full_like(code, 0x7F), code)
    return (code | (sign << 7)).to(torch.uint8)


def simulate_fused(x: torch.Tensor, *, scale_by_reciprocal: bool = True) -> Tuple[torch.Tensor, torch.Tensor]:
    """The kernel's arithmetic, op for op, in torch fp32 / integer ops on the CPU -> (q uint8 [T, H],
    s fp32 [T, H/128]). Keep in lockstep with fp8_staging_kernel.fp8_stage_kernel: the CPU test holds this to
    the reference, the GPU check holds the kernel to this."""
    if x.dtype != torch.bfloat16 or x.dim() != 2 or x.shape[1] % BLOCK_K:
        raise ValueError(f"x must be bf16 [T, H] with H a multiple of {BLOCK_K}, got {x.dtype} {tuple(x.shape)}")
    t, h = x.shape
    nb = h // BLOCK_K
    xb = x.detach().cpu().to(torch.float32).reshape(t, nb, BLOCK_K)                 # 1. exact
    mag = xb.view(torch.int32) & 0x7FFFFFFF
    amax = mag.amax(dim=-1).view(torch.float32)                                     # 2. integer max
    if scale_by_reciprocal:
        s = amax * torch.tensor(RCP_E4M3_MAX, dtype=torch.float32)                  # 3. one rounding
    else:
        s = amax / torch.tensor(E4M3_MAX, dtype=torch.float32)                      # 3'. IEEE quotient
    floor = torch.tensor(SCALE_FLOOR, dtype=torch.float32)                          # fl32(1e-30)
    s = torch.where(s < floor, floor, s)                                            # 4. NaN stays
    y = xb / s.unsqueeze(-1)                                                        # 5. IEEE quotient
    q = encode_e4m3_bits(y.reshape(t, h))                                           # 6-7.
    return q, s


# --------------------------------------------------------------------------------------------- test inputs
def _e4m3_values() -> torch.Tensor:
    """The 127 non-negative finite e4m3 values (codes 0x00..0x7E), ascending, as fp32."""
    return torch.arange(0, 0x7F, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).to(torch.float32)


def edge_case_rows(h: int, seed: int = 0) -> torch.Tensor:
    """bf16 rows [R, h] whose 1x128 blocks exercise every rounding path: exact ties between adjacent e4m3 values
    (amax = 448 * 2^k, so s = 2^k under either scale op and x / s is the midpoint itself), their bf16
    neighbours, the e4m3 subnormal range, all-zero and all-negative-zero blocks, a single huge outlier, bf16
    subnormals, blocks under the scale floor, the bf16 extremes, +-inf and NaN (the default quiet NaN and its
    negative). Block (r, b) gets kind (r + b) % kinds, so every kind appears at every block position."""
    if h % BLOCK_K:
        raise ValueError(f"h={h} must be a multiple of {BLOCK_K}")
    g = torch.Generator().manual_seed(seed)
    vals = _e4m3_values()
    mids = (vals[:-1] + vals[1:]) / 2                                                # 126 exact midpoints

    def rnd_sign(n):
        return torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)

    def with_amax(body, k):
        # body: 127 fp32 values with |v| <= 448; slot 0 holds the amax 448 * 2^k (random sign)
        blk = torch.cat([torch.tensor([448.0]) * rnd_sign(1), body[:127]]) * (2.0 ** k)
        return blk[torch.randperm(BLOCK_K, generator=g)]

    def kind(i):
        k = int(torch.randint(-24, 24, (1,), generator=g))
        if i == 0:    # exact ties, both signs
            return with_amax(torch.cat([mids, mids[:1]]) * rnd_sign(127), k)
        if i == 1:    # bf16 neighbours of the ties (just above / below): rounding direction away from the tie
            body = torch.cat([mids, mids[:1]]) * rnd_sign(127)
            b16 = body.to(torch.bfloat16).view(torch.int16)
            step = torch.where(torch.rand(127, generator=g) < 0.5, 1, -1).to(torch.int16)
            return with_amax(torch.where(body == 0, body, (b16 + step).view(torch.bfloat16).float()), k)
        if i == 2:    # e4m3 subnormal range: exact subnormals, their midpoints, and random values below 2^-6
            sub = torch.cat([vals[:8], mids[:8], torch.rand(111, generator=g) * 2.0 ** -6])
            return with_amax(sub * rnd_sign(127), k)
        if i == 3:    # every e4m3 value exactly (no rounding)
            return with_amax(vals[:127] * rnd_sign(127), k)
        if i == 4:    # all +0
            return torch.zeros(BLOCK_K)
        if i == 5:    # all -0
            return torch.full((BLOCK_K,), -0.0)
        if i == 6:    # one huge outlier among ordinary values: most y underflow to (signed) zero or subnormals
            blk = torch.randn(BLOCK_K, generator=g)
            blk[int(torch.randint(0, BLOCK_K, (1,), generator=g))] = 3.0e38 * float(rnd_sign(1))
            return blk
        if i == 7:    # bf16 subnormals only (fp32 subnormals): amax below the floor
            return torch.randn(BLOCK_K, generator=g) * 1e-39
        if i == 8:    # tiny normals under the floor: s = 1e-30, y = x / 1e-30 is ordinary
            return torch.randn(BLOCK_K, generator=g) * 1e-29
        if i == 9:    # bf16 extremes: max finite both signs, min normal, a mix
            blk = torch.randn(BLOCK_K, generator=g)
            blk[:4] = torch.tensor([3.3895e38, -3.3895e38, 1.1755e-38, -1.1755e-38])
            return blk
        if i == 10:   # +inf with ordinary values
            blk = torch.randn(BLOCK_K, generator=g)
            blk[int(torch.randint(0, BLOCK_K, (1,), generator=g))] = float("inf")
            return blk
        if i == 11:   # -inf and +inf
            blk = torch.randn(BLOCK_K, generator=g) * 1e3
            blk[3], blk[77] = float("-inf"), float("inf")
            return blk
        if i == 12:   # NaN with ordinary values
            blk = torch.randn(BLOCK_K, generator=g)
            blk[int(torch.randint(0, BLOCK_K, (1,), generator=g))] = float("nan")
            return blk
        if i == 13:   # negative NaN, inf and -0 in one block
            blk = torch.randn(BLOCK_K, generator=g)
            blk[5], blk[6], blk[7] = -float("nan"), float("inf"), -0.0
            return blk
        if i == 14:   # values whose y lands just past 448 when the scale rounds down (clamp path), k random
            a = torch.tensor([1.0 + j / 128.0 for j in range(1, 128)]) * 448.0
            body = a.to(torch.bfloat16).float()
            blk = torch.cat([body, body[-1:]]) * (2.0 ** k)
            return blk * rnd_sign(BLOCK_K)
        # i == 15: ordinary normal data at a random scale
        return torch.randn(BLOCK_K, generator=g) * 10.0 ** float(torch.empty(1).uniform_(-6, 4, generator=g))

    kinds = 16
    nb = h // BLOCK_K
    rows = []
    for r in range(kinds):
        rows.append(torch.cat([kind((r + b) % kinds) for b in range(nb)]))
    return torch.stack(rows).to(torch.bfloat16)
