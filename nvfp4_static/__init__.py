"""Static-activation NVFP4 quantization for PyTorch, as a torchao ``quantize_`` config.

    from torchao.quantization import quantize_
    from nvfp4_static import NVFP4StaticActivationConfig

    quantize_(model, NVFP4StaticActivationConfig(step="prepare"))
    for batch in calibration_batches:
        model(batch)
    quantize_(model, NVFP4StaticActivationConfig(step="convert"))
"""

from nvfp4_static.config import NVFP4StaticActivationConfig
from nvfp4_static.diagnostics import LayerDiagnostics, format_diagnostics, layer_diagnostics
from nvfp4_static.linear import NVFP4StaticLinear
from nvfp4_static.observed import NVFP4ObservedLinear
from nvfp4_static.observers import (
    BlockHessianAccumulator,
    MaxCalibrator,
    MseCalibrator,
    NVFP4ActMaxCalibrator,
    NVFP4MSECalibrator,
    PercentileCalibrator,
)
from nvfp4_static.tensor import NVFP4StaticTensor

__all__ = [
    "NVFP4StaticActivationConfig",
    "NVFP4StaticLinear",
    "NVFP4ObservedLinear",
    "NVFP4StaticTensor",
    "NVFP4ActMaxCalibrator",
    "MaxCalibrator",
    "PercentileCalibrator",
    "MseCalibrator",
    "NVFP4MSECalibrator",
    "BlockHessianAccumulator",
    "layer_diagnostics",
    "format_diagnostics",
    "LayerDiagnostics",
]
