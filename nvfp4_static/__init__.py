"""Static-activation NVFP4 quantization for PyTorch, as a torchao ``quantize_`` config.

    from torchao.quantization import quantize_
    from nvfp4_static import NVFP4StaticActivationConfig, is_quantizable

    quantize_(model, NVFP4StaticActivationConfig(step="prepare"), filter_fn=is_quantizable)
    for batch in calibration_batches:
        model(batch)
    quantize_(model, NVFP4StaticActivationConfig(step="convert"), filter_fn=is_quantizable)

For an LLM, ``calibrate_model(model, batches)`` also smooths the norms' outputs first (the
default recipe), and ``calibrate_layer_by_layer`` does the same for models bigger than the GPU.
"""

from nvfp4_static.calibrate_model import calibrate_model
from nvfp4_static.checkpoint import load_quantized
from nvfp4_static.clip_monitor import ClipCounts, clip_counts, disable_clip_monitor, enable_clip_monitor
from nvfp4_static.compile_guards import skip_nvfp4_weight_guards
from nvfp4_static.config import NVFP4StaticActivationConfig
from nvfp4_static.data_parallel_convert import convert_data_parallel
from nvfp4_static.diagnostics import LayerDiagnostics, format_diagnostics, layer_diagnostics
from nvfp4_static.distributed import (
    calibrate_in_shards,
    data_parallel_calibration,
    sync_calibration,
    sync_mse_anchors,
)
from nvfp4_static.experts import ExpertsLayout, NVFP4StaticExperts, NVFP4StaticObservedExperts, register_experts
from nvfp4_static.export import export_checkpoint
from nvfp4_static.fused_layers import STANDARD_FUSION_GROUPS, find_fusion_groups, tie_fused_layers
from nvfp4_static.layerwise import calibrate_layer_by_layer
from nvfp4_static.linear import NVFP4StaticLinear
from nvfp4_static.norm_smoothing import smooth_norm_inputs
from nvfp4_static.observed import NVFP4StaticObservedLinear
from nvfp4_static.observers import (
    BlockHessianAccumulator,
    MaxCalibrator,
    MseCalibrator,
    NVFP4ActMaxCalibrator,
    NVFP4BMinCalibrator,
    NVFP4MSECalibrator,
    PercentileCalibrator,
)
from nvfp4_static.quantized_activation_hessian import calibrate_hessians_under_quantized_activations
from nvfp4_static.serving_import import import_checkpoint
from nvfp4_static.sibling_gemm_backend import sibling_gemm_backend
from nvfp4_static.sibling_linears import fuse_sibling_linears
from nvfp4_static.tensor import NVFP4StaticTensor
from nvfp4_static.workflow import is_quantizable

__all__ = [
    "NVFP4StaticActivationConfig",
    "is_quantizable",
    "load_quantized",
    "tie_fused_layers",
    "find_fusion_groups",
    "fuse_sibling_linears",
    "sibling_gemm_backend",
    "skip_nvfp4_weight_guards",
    "STANDARD_FUSION_GROUPS",
    "export_checkpoint",
    "import_checkpoint",
    "NVFP4StaticLinear",
    "NVFP4StaticObservedLinear",
    "NVFP4StaticTensor",
    "register_experts",
    "ExpertsLayout",
    "NVFP4StaticExperts",
    "NVFP4StaticObservedExperts",
    "NVFP4BMinCalibrator",
    "NVFP4ActMaxCalibrator",
    "MaxCalibrator",
    "PercentileCalibrator",
    "MseCalibrator",
    "NVFP4MSECalibrator",
    "BlockHessianAccumulator",
    "enable_clip_monitor",
    "disable_clip_monitor",
    "clip_counts",
    "ClipCounts",
    "layer_diagnostics",
    "format_diagnostics",
    "LayerDiagnostics",
    "sync_calibration",
    "sync_mse_anchors",
    "data_parallel_calibration",
    "calibrate_in_shards",
    "convert_data_parallel",
    "calibrate_layer_by_layer",
    "calibrate_model",
    "calibrate_hessians_under_quantized_activations",
    "smooth_norm_inputs",
]
