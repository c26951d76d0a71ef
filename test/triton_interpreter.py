"""Run Triton kernel launchers under ``TRITON_INTERPRET=1`` in a child process (CPU-only CI).

Triton chooses between compiling and interpreting a kernel when ``@triton.jit`` runs, i.e. when
its module is imported, so interpreted kernels need a process that had the variable set from the
start; setting it in the test process instead would flip every other test's kernels too.
"""

import importlib
import os
import subprocess
import sys
import tempfile

import numpy
import pytest
import torch
import triton


def skip_if_interpreter_unusable() -> None:
    """Skip where Triton's interpreter cannot run our kernels: before Triton 3.9 it turns a
    kernel's scalar arguments into 1-element arrays and converts them with ``int()``, which
    NumPy 2.5 refuses (seen with Triton 3.6, the version torch 2.11 pins). CI runs Triton 3.9."""
    triton_version = tuple(int(part) for part in triton.__version__.split(".")[:2])
    numpy_version = tuple(int(part) for part in numpy.__version__.split(".")[:2])
    if triton_version < (3, 9) and numpy_version >= (2, 5):
        pytest.skip(
            f"Triton {triton.__version__}'s interpreter fails on loop bounds under NumPy "
            f"{numpy.__version__}; run the interpreter tests with 'numpy<2.5' (or Triton >= 3.9)"
        )


def run_interpreted(calls: list[tuple[str, tuple]]) -> list[tuple]:
    """Run each ``("package.module:launcher", args)`` in one interpreted child process.

    Launchers write into preallocated output tensors, so each call's ``args`` come back as they
    are after the call.
    """
    skip_if_interpreter_unusable()
    with tempfile.TemporaryDirectory() as tmp:
        calls_path = os.path.join(tmp, "calls.pt")
        results_path = os.path.join(tmp, "results.pt")
        torch.save(calls, calls_path)
        child = subprocess.run(
            [sys.executable, __file__, calls_path, results_path],
            env=dict(os.environ, TRITON_INTERPRET="1"),
            capture_output=True,
            text=True,
        )
        if child.returncode != 0:
            raise RuntimeError(f"interpreted Triton launches failed:\n{child.stderr[-4000:]}")
        return torch.load(results_path, weights_only=False)


def _run_calls(calls_path: str, results_path: str) -> None:
    results = []
    for target, args in torch.load(calls_path, weights_only=False):
        module_name, function_name = target.split(":")
        getattr(importlib.import_module(module_name), function_name)(*args)
        results.append(args)
    torch.save(results, results_path)


if __name__ == "__main__":
    _run_calls(*sys.argv[1:])
