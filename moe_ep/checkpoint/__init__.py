"""Real checkpoints in: routed experts from safetensors checkpoints, converted to moe_ep's formats without a
bf16 round trip, this rank's experts only, one expert at a time (docs/checkpoints.md).

    from moe_ep import checkpoint
    layer = checkpoint.load_layer("/models/DeepSeek-V3", 3, spec, allow_inexact=True)   # collective
    # or, to see what was converted and how exactly:
    ckpt = checkpoint.Checkpoint("/models/DeepSeek-V3")
    loaded = ckpt.load_experts(3, rank, world_size)          # .weights, .report, .extras
    layer = moe_ep.MoELayer(spec, loaded.weights)

The converters are plain functions of the checkpoint's tensors (convert_fp8, convert_fp4, convert_bf16); the
conventions (their names, dtypes, layouts and exactness) are CONVENTIONS. Importing this package imports neither
safetensors nor transformers: safetensors is imported when a file is read.
"""

from moe_ep.checkpoint.conventions import CONVENTIONS, Convention, detect, get_convention
from moe_ep.checkpoint.convert_bf16 import fused_bf16, per_expert_bf16
from moe_ep.checkpoint.convert_fp4 import GptOssExtras, gpt_oss_mxfp4, modelopt_nvfp4, unpack_e2m1_pairs
from moe_ep.checkpoint.convert_fp8 import deepseek_fp8_block, deepseek_fp8_mxfp8, layer_input_scale, modelopt_fp8_tensor
from moe_ep.checkpoint.layer import load_layer
from moe_ep.checkpoint.loader import Checkpoint, LayerPlan, LoadedExperts
from moe_ep.checkpoint.report import ExactnessReport

__all__ = ["Checkpoint", "LayerPlan", "LoadedExperts", "ExactnessReport", "load_layer", "CONVENTIONS", "Convention",
           "detect", "get_convention", "deepseek_fp8_block", "deepseek_fp8_mxfp8", "modelopt_fp8_tensor",
           "layer_input_scale", "modelopt_nvfp4", "gpt_oss_mxfp4", "GptOssExtras", "unpack_e2m1_pairs",
           "per_expert_bf16", "fused_bf16"]
