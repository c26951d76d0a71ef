"""Run Triton kernel launchers under ``TRITON_INTERPRET=1`` in a child process (CPU-only CI).

Triton chooses between compiling and interpreting a kernel when ``@triton.jit`` runs, i.e. when
its module is imported, so interpreted kernels need a process that had the variable set from the
start; setting it in the test process instead would flip every other test's kernels too. A test
file gathers its launches, runs them all in one child with ``run_interpreted`` (from a
module-scoped fixture), and asserts on what comes back.
"""

import importlib
import os
import subprocess
import sys
import tempfile
from typing import Any, NamedTuple

import numpy
import pytest
import torch
import triton


class Launched(NamedTuple):
    """One launch, after it ran: its arguments as the launcher left them (outputs written in
    place) and what it returned."""

    args: tuple
    returned: Any


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


def run_interpreted(launches: dict[str, tuple[str, tuple]]) -> dict[str, Launched]:
    """Run each ``name: ("package.module:launcher", args)``, in order, in one interpreted child
    process; return each name's ``Launched``.

    The launches travel in one ``torch.save``, so a tensor passed to several of them is one
    tensor in the child too: a later launch sees what an earlier one wrote into it.
    """
    skip_if_interpreter_unusable()
    with tempfile.TemporaryDirectory() as tmp:
        launches_path = os.path.join(tmp, "launches.pt")
        results_path = os.path.join(tmp, "results.pt")
        torch.save(launches, launches_path)
        child = subprocess.run(
            [sys.executable, __file__, launches_path, results_path],
            env=dict(os.environ, TRITON_INTERPRET="1"),
            capture_output=True,
            text=True,
        )
        if child.returncode != 0:
            raise RuntimeError(f"interpreted Triton launches failed:\n{child.stderr[-4000:]}")
        return {name: Launched(*result) for name, result in torch.load(results_path, weights_only=False).items()}


def _run_launches(launches_path: str, results_path: str) -> None:
    results = {}
    for name, (target, args) in torch.load(launches_path, weights_only=False).items():
        module_name, function_name = target.split(":")
        returned = getattr(importlib.import_module(module_name), function_name)(*args)
        results[name] = (args, returned)
    torch.save(results, results_path)


if __name__ == "__main__":
    _run_launches(*sys.argv[1:])
