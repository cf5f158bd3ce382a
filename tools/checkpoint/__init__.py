"""Tools around moe_ep.checkpoint: synthetic checkpoints at full size, the loader's memory and time (CPU), and the
H200 run of a DeepSeek-V3-convention layer through the loader into the sm90 FP8 kernel."""
