"""Hopper (sm90) shim: serves the drop's FP8 (`moe_hopper_fp8`) and BF16 (`moe_hopper_bf16`) MegaMoE kernels
to moe_ep as the backends in shim/sm90/backend.py.

Importing this package imports neither cutlass nor the kernel tree; `kernel_symbols` puts the sm90 tree on
sys.path (and refuses if the Blackwell tree is already loaded), the frontends import cutlass lazily.
"""
