"""The CPU workflow, and a child process that runs it where ``triton`` cannot be imported.

``pip install nvfp4_static`` does not bring Triton (CUDA builds of torch do), so a CPU-only
install has none, while the test environment does. ``test_without_triton.py`` runs this file as
a script: it hides Triton from the import system before anything imports it, runs
``cpu_workflow`` and saves what it returns, for the test to compare with the same workflow run
in its own process (with Triton importable).

Only the standard library is imported at module level, so that the child can hide Triton first.
"""

import importlib.machinery
import os
import sys


class _PathFinderWithoutTriton(importlib.machinery.PathFinder):
    """The standard path finder, except that it finds no ``triton`` (nor any ``triton.*``): to
    ``import`` and to ``importlib.util.find_spec`` Triton then looks not installed."""

    @classmethod
    def find_spec(cls, fullname, path=None, target=None):
        if fullname == "triton" or fullname.startswith("triton."):
            return None
        return super().find_spec(fullname, path, target)


def hide_triton() -> None:
    """Make ``triton`` unimportable in this process; call before anything imports it."""
    assert not any(name == "triton" or name.startswith("triton.") for name in sys.modules)
    sys.meta_path[:] = [
        _PathFinderWithoutTriton if finder is importlib.machinery.PathFinder else finder
        for finder in sys.meta_path
    ]
    importlib.invalidate_caches()


def cpu_workflow(directory: str) -> dict:
    """Prepare, calibrate and convert a small transformer block on CPU (``hessian_mse``: every
    calibration op runs), then run it eagerly, compiled, after a save/load and after an
    export/import; return each output by name. ``directory`` takes the files written."""
    import torch
    from torchao.quantization import quantize_

    from models import TransformerBlock
    from nvfp4_static import (
        NVFP4StaticActivationConfig,
        export_checkpoint,
        import_checkpoint,
        is_quantizable,
        load_quantized,
    )

    def float_model():
        torch.manual_seed(0)
        return TransformerBlock()

    generator = torch.Generator().manual_seed(1)
    batches = [torch.randn(2, 8, 64, generator=generator) for _ in range(4)]
    x = torch.randn(2, 8, 64, generator=generator)

    model = float_model()
    recipe = dict(weight_scale="hessian_mse")
    quantize_(model, NVFP4StaticActivationConfig(step="prepare", **recipe), filter_fn=is_quantizable)
    with torch.no_grad():
        for batch in batches:
            model(batch)
    quantize_(model, NVFP4StaticActivationConfig(step="convert", **recipe), filter_fn=is_quantizable)

    outputs = {}
    with torch.inference_mode():
        outputs["eager"] = model(x)
        outputs["compiled"] = torch.compile(model, fullgraph=True)(x)

    path = os.path.join(directory, "model_nvfp4.pt")
    torch.save(model.state_dict(), path)
    loaded = load_quantized(float_model(), torch.load(path, weights_only=True))
    export_checkpoint(model, os.path.join(directory, "export"))
    imported = import_checkpoint(os.path.join(directory, "export"), float_model())
    with torch.inference_mode():
        outputs["loaded"] = loaded(x)
        outputs["imported"] = imported(x)
    return outputs


def _run_without_triton(results_path: str) -> None:
    """``cpu_workflow`` with Triton hidden, into ``results_path``; also check the errors that
    the Triton routes give there."""
    hide_triton()
    try:
        importlib.import_module("triton")
    except ImportError:
        pass
    else:
        raise AssertionError("triton is still importable")

    import pytest
    import torch

    from nvfp4_static.backends import linear_function
    from nvfp4_static.kernels import ops

    assert not ops.HAS_TRITON
    outputs = cpu_workflow(os.path.dirname(results_path))
    # A weight on a CUDA device picks the triton route (blackwell on sm100+); forced, on any device.
    for backend in ("triton", "blackwell"):
        with pytest.raises(ModuleNotFoundError, match=f"backend '{backend}'.*'triton' package is not installed"):
            linear_function(backend)
    # What a CUDA tensor reaches in place of a launcher.
    with pytest.raises(ModuleNotFoundError, match="fp8_scale_sweep on a CUDA tensor.*'triton' package"):
        ops.launch_fp8_scale_sweep(torch.zeros(16, 16), torch.tensor(1.0))
    assert not any(name == "triton" or name.startswith("triton.") for name in sys.modules)
    torch.save(outputs, results_path)


if __name__ == "__main__":
    _run_without_triton(sys.argv[1])
