"""Hopper (sm90) shim: serves the drop's `moe_hopper_fp8` MegaMoE kernel to moe_ep.

Importing this package does not import cutlass; the FP8 frontend does, lazily.
"""
