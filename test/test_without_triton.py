"""The CPU workflow without Triton: ``triton`` is not a dependency (CUDA builds of torch bring
it), so a CPU-only install must import and run the whole workflow without it, with the same
results as where Triton is installed (the CPU route never runs a Triton kernel)."""

import os
import subprocess
import sys

import torch

from without_triton import cpu_workflow


def test_cpu_workflow_without_triton_matches_the_one_with_it(tmp_path):
    (tmp_path / "without").mkdir()
    (tmp_path / "with").mkdir()
    results_path = tmp_path / "without" / "outputs.pt"
    child = subprocess.run(
        [sys.executable, os.path.join(os.path.dirname(__file__), "without_triton.py"), str(results_path)],
        capture_output=True,
        text=True,
    )
    assert child.returncode == 0, child.stderr[-4000:]
    assert "Triton not available" not in child.stderr  # torch's triton_op warns so without Triton
    without_triton = torch.load(results_path, weights_only=True)
    with_triton = cpu_workflow(str(tmp_path / "with"))
    assert set(without_triton) == set(with_triton) == {"eager", "compiled", "loaded", "imported"}
    for name, out in with_triton.items():
        assert torch.equal(without_triton[name], out), name
