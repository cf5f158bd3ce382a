"""moe_ep's runtime: spec, weights, validation, registry, backend contract, layer. Imports no kernel tree."""
