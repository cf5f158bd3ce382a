"""Deterministic problems (weights, tokens, routings) and the per-rank scenario the multi-rank tests, the GPU
suites and the main job run. CPU-safe; imports no kernel tree."""
