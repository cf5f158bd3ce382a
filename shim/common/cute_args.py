"""Turns torch tensors into CuTe kernel arguments, for real launches and for CPU-only compiles.

The same builder serves both: `real=True` wraps the tensor's memory (DLPack),
`real=False` makes a fake tensor of the same dtype, rank and leading dimension,
with every other extent and stride symbolic. That is the type signature
`mark_layout_dynamic` gives a real tensor, so a compile on a machine with no
GPU checks the very program a GPU run would build.
"""

from __future__ import annotations

import torch

__all__ = ["ArgBuilder"]


def _cutlass_dtype(dtype: torch.dtype):
    import cutlass

    table = {
        torch.float8_e4m3fn: cutlass.Float8E4M3FN,
        torch.float8_e5m2: cutlass.Float8E5M2,
        torch.float32: cutlass.Float32,
        torch.bfloat16: cutlass.BFloat16,
        torch.float16: cutlass.Float16,
        torch.int64: cutlass.Int64,
        torch.int32: cutlass.Int32,
        torch.uint8: cutlass.Uint8,
        # Blackwell block-scaled formats: e2m1 pairs (two values a byte; CuTe counts logical elements) and
        # the e8m0 power-of-two scales of MXFP8.
        torch.float4_e2m1fn_x2: cutlass.Float4E2M1FN,
        torch.float8_e8m0fnu: cutlass.Float8E8M0FNU,
    }
    try:
        return table[dtype]
    except KeyError:
        raise TypeError(f"no CuTe dtype for torch dtype {dtype}") from None


def _leading_dim(t: torch.Tensor) -> int:
    dims = [i for i, s in enumerate(t.stride()) if s == 1 and t.shape[i] != 1] or [
        i for i, s in enumerate(t.stride()) if s == 1
    ]
    if not dims:
        raise ValueError(f"tensor of shape {tuple(t.shape)} stride {t.stride()} has no unit-stride dimension")
    return dims[-1]


class ArgBuilder:
    def __init__(self, real: bool):
        self.real = real

    def tensor(self, t: torch.Tensor, align: int = 16):
        import cutlass.cute as cute

        lead = _leading_dim(t)
        if self.real:
            from cutlass.torch import from_dlpack

            return from_dlpack(t, assumed_align=align).mark_layout_dynamic(leading_dim=lead)
        shape = tuple(cute.sym_int() for _ in t.shape)
        stride = tuple(1 if i == lead else cute.sym_int64() for i in range(t.dim()))
        return cute.runtime.make_fake_tensor(_cutlass_dtype(t.dtype), shape, stride, assumed_align=align)

    def static_tensor(self, t: torch.Tensor, align: int = 16):
        """A tensor whose extents and strides are compiled in (no dynamic marking): the way the drop's
        runners pass a workspace tensor whose size is fixed by the kernel's own configuration."""
        import cutlass.cute as cute

        if self.real:
            from cutlass.torch import from_dlpack

            return from_dlpack(t, assumed_align=align)
        return cute.runtime.make_fake_tensor(_cutlass_dtype(t.dtype), tuple(int(x) for x in t.shape),
                                             tuple(int(x) for x in t.stride()), assumed_align=align)

    def byte_ptr(self, t: torch.Tensor, align: int = 16):
        """Raw uint8 global pointer: workspaces pass this way so no 32-bit extent is built for them."""
        import cutlass
        import cutlass.cute as cute
        from cutlass.cute.typing import AddressSpace

        addr = t.data_ptr() if self.real else (1 << 20)
        return cute.runtime.make_ptr(cutlass.Uint8, addr, AddressSpace.gmem, assumed_align=align)

    def stream(self):
        import cuda.bindings.driver as cuda

        if self.real:
            return cuda.CUstream(torch.cuda.current_stream().cuda_stream)
        return cuda.CUstream(0)
