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

import torch


def run_interpreted(calls: list[tuple[str, tuple]]) -> list[tuple]:
    """Run each ``("package.module:launcher", args)`` in one interpreted child process.

    Launchers write into preallocated output tensors, so each call's ``args`` come back as they
    are after the call.
    """
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
