"""Adapters between moe_ep and the verbatim CuTe DSL MegaMoE kernel drops.

The only code in this repository allowed to import the drop's kernel packages.
One sub-package per tree (`sm90`, `sm100`); `common` holds what both share and
never imports a kernel module itself.
"""
