"""Kernel backends: each a thin moe_ep.Backend over one shim frontend. Imported lazily by the registry."""
