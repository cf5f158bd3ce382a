"""moe_ep inside other libraries' models. Each integration imports its library lazily, inside its functions:
`import moe_ep` (and this package) works without any of them installed.

    moe_ep.integrations.transformers.swap_experts(model, ...)   # transformers 5 MoE models (docs/models.md)
"""

__all__ = []
