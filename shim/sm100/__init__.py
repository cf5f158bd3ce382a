"""Blackwell (sm100) shim: serves the drop's NVFP4, MXFP8 and BF16 MegaMoE kernels to moe_ep.

Importing this package imports neither cutlass nor the kernel tree; `kernel_symbols` puts the sm100 tree
on sys.path (and refuses if the Hopper tree is already loaded), the frontends import cutlass lazily.
"""
