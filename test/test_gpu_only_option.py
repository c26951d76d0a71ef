"""conftest's ``--gpu-only``: a GPU machine runs exactly the tests that need a GPU."""

import os
import re
import subprocess
import sys

HERE = os.path.dirname(__file__)
SAMPLE = os.path.join(HERE, "test_triton_eager.py")  # its GPU tests are the ones named test_gpu_*


def collected_functions(*options) -> set:
    """The test functions ``pytest --collect-only`` lists for ``SAMPLE`` with ``options``."""
    listing = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *options, SAMPLE],
        capture_output=True, text=True, cwd=os.path.dirname(HERE), timeout=300,
    ).stdout
    return {match.group(1) for match in re.finditer(r"::(test_\w+)", listing)}


def test_gpu_only_collects_the_gpu_tests_and_nothing_else():
    with open(SAMPLE) as source:
        defined = set(re.findall(r"^def (test_\w+)", source.read(), flags=re.MULTILINE))
    gpu_tests = {name for name in defined if name.startswith("test_gpu_")}
    assert gpu_tests and gpu_tests != defined
    assert collected_functions() == defined
    assert collected_functions("--gpu-only") == gpu_tests
