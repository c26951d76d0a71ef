"""Which route runs a static NVFP4 linear on a given device, chosen once per tensor.

- ``blackwell``: sm100+ with FP4 ``torch._scaled_mm`` (real FP4 tensor cores);
- ``triton``: other CUDA GPUs (Hopper, Ampere): fused Triton kernels, faithful emulation;
- ``cpu``: torch ops; runs on any device and defines the numerics.

Every route has the same signature as ``backends.cpu.static_nvfp4_linear``.
"""

import importlib
import os
from typing import Optional

import torch

BACKENDS = ("cpu", "triton", "blackwell")
BACKEND_ENV_VAR = "NVFP4_STATIC_BACKEND"


def _has_fp4_scaled_mm(device: torch.device) -> bool:
    return (
        hasattr(torch, "float4_e2m1fn_x2")
        and torch.cuda.is_available()
        and torch.cuda.get_device_capability(device) >= (10, 0)
    )


def resolve_backend(device: torch.device, override: Optional[str] = None) -> str:
    """The backend for tensors on ``device``: ``override``, else ``$NVFP4_STATIC_BACKEND``, else auto."""
    requested = override or os.environ.get(BACKEND_ENV_VAR) or None
    if requested is not None:
        if requested not in BACKENDS:
            raise ValueError(
                f"nvfp4_static: unknown backend {requested!r} (from "
                f"{'the config' if override else '$' + BACKEND_ENV_VAR}); choose one of {BACKENDS}"
            )
        return requested
    if device.type != "cuda":
        return "cpu"
    return "blackwell" if _has_fp4_scaled_mm(device) else "triton"


_LINEAR_FUNCTIONS = {}


def linear_function(backend: str):
    """The ``static_nvfp4_linear`` of ``backend``.

    Imported on first use (triton may be absent) when a tensor picks its backend, so that a
    compiled forward only reads this dict.
    """
    if backend not in _LINEAR_FUNCTIONS:
        module = importlib.import_module(f"nvfp4_static.backends.{backend}")
        _LINEAR_FUNCTIONS[backend] = module.static_nvfp4_linear
    return _LINEAR_FUNCTIONS[backend]
