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
    script = os.path.join(os.path.dirname(__file__), "without_triton.py")
    # The child runs while this process computes the same workflow with Triton: two cores, not one.
    with open(tmp_path / "child_stderr.txt", "w+") as stderr:
        child = subprocess.Popen([sys.executable, script, str(results_path)], stdout=subprocess.DEVNULL, stderr=stderr)
        try:
            with_triton = cpu_workflow(str(tmp_path / "with"))
            returncode = child.wait(timeout=600)
        finally:
            child.kill()
        stderr.seek(0)
        child_stderr = stderr.read()
    assert returncode == 0, child_stderr[-4000:]
    assert "Triton not available" not in child_stderr  # torch's triton_op warns so without Triton
    without_triton = torch.load(results_path, weights_only=True)
    assert set(without_triton) == set(with_triton) == {"eager", "compiled", "loaded", "imported"}
    for name, out in with_triton.items():
        assert torch.equal(without_triton[name], out), name
