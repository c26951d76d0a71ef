"""Which route runs a static NVFP4 linear on a given device, chosen once per tensor.

- ``blackwell`` (``backends/blackwell.py``): sm100+ with FP4 ``torch._scaled_mm`` (real FP4
  tensor cores);
- ``triton`` (``backends/triton_route.py``): other CUDA GPUs (Hopper, Ampere): fused Triton
  kernels, faithful emulation;
- ``cpu`` (``backends/cpu.py``): torch ops; runs on any device and defines the numerics.

Every route has the same signature as ``backends.cpu.static_nvfp4_linear``.
"""

import os
from typing import Optional

import torch

from nvfp4_static.kernels.ops import require_triton

BACKENDS = ("cpu", "triton", "blackwell")
BACKEND_ENV_VAR = "NVFP4_STATIC_BACKEND"


def has_fp4_scaled_mm(device: torch.device) -> bool:
    return (
        device.type == "cuda"
        and hasattr(torch, "float4_e2m1fn_x2")
        and torch.cuda.is_available()
        and torch.cuda.get_device_capability(device) >= (10, 0)
    )


def resolve_backend(device: torch.device, override: Optional[str] = None) -> str:
    """The backend for tensors on ``device``: ``override``, else ``$NVFP4_STATIC_BACKEND``, else auto
    (an empty variable means auto; an empty or false ``override`` is refused, not read as auto)."""
    requested = override if override is not None else os.environ.get(BACKEND_ENV_VAR) or None
    if requested is not None:
        if requested not in BACKENDS:
            source = "the backend argument" if override is not None else f"${BACKEND_ENV_VAR}"
            raise ValueError(
                f"nvfp4_static: unknown backend {requested!r} (from {source}); choose one of {BACKENDS}"
            )
        return requested
    if device.type != "cuda":
        return "cpu"
    return "blackwell" if has_fp4_scaled_mm(device) else "triton"


def check_runs_on(backend: str, device: torch.device, what: str) -> None:
    """Refuse the ``blackwell`` route for ``what`` on a device without FP4 ``_scaled_mm``: its
    first forward would fail deep in the GEMM."""
    if backend == "blackwell" and not has_fp4_scaled_mm(device):
        raise ValueError(
            f"nvfp4_static: {what}: backend 'blackwell' (from the backend argument or "
            f"${BACKEND_ENV_VAR}) needs a CUDA GPU with FP4 torch._scaled_mm (sm100+), but it is "
            f"on {device}; choose backend 'cpu' or 'triton', or leave it unset"
        )


_LINEAR_FUNCTIONS = {}


def linear_function(backend: str):
    """The ``static_nvfp4_linear`` of ``backend``.

    Imported on first use when a tensor picks its backend (the triton module imports Triton,
    which a CPU machine may lack), so that a compiled forward only reads this dict.
    """
    if backend not in _LINEAR_FUNCTIONS:
        _LINEAR_FUNCTIONS[backend] = _import_linear_function(backend)
    return _LINEAR_FUNCTIONS[backend]


def _import_linear_function(backend: str):
    """Import the module of ``backend`` (one of ``BACKENDS``) and return its linear; the
    ``triton`` and ``blackwell`` routes need the ``triton`` package (a clear error here, when a
    weight picks its backend, rather than at the first forward)."""
    if backend == "cpu":
        from nvfp4_static.backends.cpu import static_nvfp4_linear
    elif backend == "triton":
        require_triton("backend 'triton'")
        from nvfp4_static.backends.triton_route import static_nvfp4_linear
    elif backend == "blackwell":
        require_triton("backend 'blackwell' (its activation quantization)")
        from nvfp4_static.backends.blackwell import static_nvfp4_linear
    else:
        raise ValueError(f"nvfp4_static: unknown backend {backend!r}; choose one of {BACKENDS}")
    return static_nvfp4_linear
