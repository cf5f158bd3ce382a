"""The Triton kernel behind shim/sm90/fp8_staging.py (read that module's docstring for the exactness argument).

Imports Triton at the top: only fp8_staging imports this module, and only when the fused path runs.
Keep the op order in lockstep with `fp8_staging.simulate_fused` (the CPU test holds that to the reference,
tools/diag/fp8_staging_check.py holds this kernel to it on the GPU).
"""

import triton
import triton.language as tl

__all__ = ["encode_e4m3", "fp8_stage_kernel", "fp8_stage_rows_kernel"]


@triton.jit
def encode_e4m3(y):
    """fp32 -> e4m3fn code (int32 in [0, 255]) by c10's fp32 -> e4m3fn algorithm on the bit pattern:
    NaN -> 0x7F | sign, |y| >= 448 (the reference's clamp, and inf) -> 0x7E | sign, |y| < 2^-6 -> subnormal
    count from one fp32 addition of 2^14, else round-to-nearest-even on the 20 dropped mantissa bits."""
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits >> 31) & 1
    mag = bits & 0x7FFFFFFF
    # (7 - 127) << 23 = -1006632960 rebiases the exponent; adding 0x7FFFF plus bit 20 rounds to nearest even.
    normal = (mag + (-1006632960) + 0x7FFFF + ((mag >> 20) & 1)) >> 20
    # 2^14 (bits 141 << 23 = 1182793728) has an ulp of 2^-9, the smallest e4m3 subnormal: the add rounds once.
    sub = (mag.to(tl.float32, bitcast=True) + 16384.0).to(tl.int32, bitcast=True) - 1182793728
    code = tl.where(mag < 1015021568, sub, normal)        # 121 << 23 is 2^-6, the smallest e4m3 normal
    code = tl.where(mag >= 0x43E00000, 0x7E, code)        # 448.0 and above, inf: saturate
    code = tl.where(mag > 0x7F800000, 0x7F, code)         # NaN
    return code | (sign << 7)


@triton.jit(do_not_specialize=["T"])
def fp8_stage_kernel(x_ptr, q_ptr, s_ptr, T, stride_x, stride_q, stride_sm, stride_sb, NB,
                     RCP: tl.constexpr, FLOOR: tl.constexpr, FMAX: tl.constexpr,
                     SCALE_BY_RCP: tl.constexpr, HW_CVT: tl.constexpr, SCALE_IN: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, KB: tl.constexpr):
    """Grid (cdiv(T, BLOCK_M), cdiv(NB, KB)): BLOCK_M rows x KB consecutive 1x128 blocks per program.
    x bf16 [T, >= NB*128] (row stride stride_x), q uint8 (row stride stride_q), s fp32 (strides sm, sb)."""
    pid_m = tl.program_id(0)
    pid_b = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rows64 = rows.to(tl.int64)
    cols = tl.arange(0, BLOCK_K)
    for i in tl.static_range(KB):
        blk = pid_b * KB + i
        row_ok = (rows < T) & (blk < NB)                                            # [BLOCK_M]
        mask = row_ok[:, None] & (cols[None, :] < BLOCK_K)                          # [BLOCK_M, BLOCK_K]
        col = blk * BLOCK_K + cols
        x = tl.load(x_ptr + rows64[:, None] * stride_x + col[None, :], mask=mask, other=0.0)
        x = x.to(tl.float32)                                                        # 1. exact
        s_addr = s_ptr + rows64 * stride_sm + blk * stride_sb
        if SCALE_IN:
            s = tl.load(s_addr, mask=row_ok, other=1.0)
        else:
            mag = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF
            amax = tl.max(mag, axis=1).to(tl.float32, bitcast=True)                 # 2. integer max, NaN on top
            if SCALE_BY_RCP:
                s = amax * RCP                                                      # 3. one rounding (torch CUDA)
            else:
                s = tl.math.div_rn(amax, tl.full([BLOCK_M], FMAX, tl.float32))      # 3'. IEEE quotient (CPU)
            s = tl.where(s < FLOOR, FLOOR, s)                                       # 4. NaN compares false
            tl.store(s_addr, s, mask=row_ok)
        y = tl.math.div_rn(x, tl.broadcast_to(s[:, None], (BLOCK_M, BLOCK_K)))      # 5. IEEE quotient
        if HW_CVT:
            code = y.to(tl.float8e4nv, fp_downcast_rounding="rtne").to(tl.uint8, bitcast=True)
        else:
            code = encode_e4m3(y).to(tl.uint8)                                      # 6-7. clamp + RNE
        tl.store(q_ptr + rows64[:, None] * stride_q + col[None, :], code, mask=mask)


@triton.jit(do_not_specialize=["T"])
def fp8_stage_rows_kernel(x_ptr, q_ptr, s_ptr, T, H, stride_x, stride_q, stride_s,
                          RCP: tl.constexpr, FLOOR: tl.constexpr, S_REP: tl.constexpr, BLOCK: tl.constexpr):
    """Grid (T,): one row per program, one scale over the whole row (the W4A8 kernel's per-token FC1 input).
    Steps 1-7 of the 1x128 kernel with the block = the row: a first pass takes the integer max of |x| over the
    row, a second divides and encodes; the scale is written S_REP times (the kernel's replicated scale row)."""
    row = tl.program_id(0)
    r64 = row.to(tl.int64)
    cols = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], tl.int32)
    for k0 in range(0, H, BLOCK):
        m = (k0 + cols) < H
        x = tl.load(x_ptr + r64 * stride_x + k0 + cols, mask=m, other=0.0).to(tl.float32)      # 1. exact
        acc = tl.maximum(acc, x.to(tl.int32, bitcast=True) & 0x7FFFFFFF)
    amax = tl.max(acc, axis=0).to(tl.float32, bitcast=True)                                   # 2. NaN on top
    s = amax * RCP                                                                            # 3. one rounding
    s = tl.where(s < FLOOR, FLOOR, s)                                                         # 4.
    tl.store(s_ptr + r64 * stride_s + tl.arange(0, S_REP), tl.zeros([S_REP], tl.float32) + s)
    sv = tl.zeros([BLOCK], tl.float32) + s
    for k0 in range(0, H, BLOCK):
        m = (k0 + cols) < H
        x = tl.load(x_ptr + r64 * stride_x + k0 + cols, mask=m, other=0.0).to(tl.float32)
        code = encode_e4m3(tl.math.div_rn(x, sv)).to(tl.uint8)                                # 5-7.
        tl.store(q_ptr + r64 * stride_q + k0 + cols, code, mask=m)
