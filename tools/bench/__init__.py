"""The benchmark: moe_ep's kernel backend against what a user would pick instead and against the floors."""
