"""The static NVFP4 linear on a CPU (the ``cpu`` backend) against float ``F.linear``.

    python examples/benchmarks/bench_cpu_linear.py [--m 1 16 256] [--shapes 576x1536 ...] [--rounds 3]

For each weight shape (K x N) and token count M, wall time per call (ms) of: ``F.linear`` in
float32 and in bfloat16 (the baselines), the converted layer (``NVFP4StaticLinear``, bfloat16
activation, the ``cpu`` backend as an eager model runs it: the C kernel, at every row count where
it is built with AVX2, else up to 16 rows, called with the arguments the layer prepared for its
weight, ``backends/cpu_eager.py``), the same kernel through the general route (``general``: the
weight subclass's linear and the backend's checks at every call, as a layer without prepared
calls takes it), and the same layer on the torch ops alone (``NVFP4_STATIC_CPU_KERNEL=0``: the
weight dequantized and multiplied in slices). Before timing, the kernel's output is checked to
equal the general route's bit for bit and to agree with the torch ops' within one bfloat16
rounding (they differ in the order of their float32 sums). Each cell is the best of ``--rounds``
rounds of repeated calls, the five columns interleaved in each round; the last columns are the
layer's time over the faster float baseline's, over the general route's and over the torch ops'.
"""

import argparse
import copy
import os
import time

import torch
import torch.nn.functional as F

from nvfp4_static.backends import cpu_kernel
from nvfp4_static.linear import NVFP4StaticLinear
from nvfp4_static.tensor import NVFP4StaticTensor

# SmolLM2-135M's linears, and Llama-3-8B's attention and MLP widths at a quarter of their K
SHAPES = "576x576 576x1536 1536x576 1024x4096 4096x1024 2048x8192"


def seconds_per_call(fn, budget_s: float = 0.3) -> float:
    """Wall time of one call of ``fn``, over as many calls as fit in about ``budget_s``."""
    fn()
    start = time.perf_counter()
    fn()
    calls = max(1, int(budget_s / max(time.perf_counter() - start, 1e-6)))
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def best_of_rounds(calls: dict, rounds: int) -> dict:
    """Each of ``calls``' least ``seconds_per_call`` over ``rounds`` rounds, the calls taken in
    turn in each round so that drift of the machine's speed moves them alike."""
    best = dict.fromkeys(calls, float("inf"))
    for _ in range(rounds):
        for name, fn in calls.items():
            best[name] = min(best[name], seconds_per_call(fn))
    return best


def on_torch_ops(fn):
    """``fn`` run with the CPU kernel switched off."""

    def run():
        os.environ[cpu_kernel.SWITCH_ENV_VAR] = "0"
        try:
            return fn()
        finally:
            del os.environ[cpu_kernel.SWITCH_ENV_VAR]

    return run


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--m", type=int, nargs="+", default=[1, 4, 16, 256])
    parser.add_argument("--shapes", nargs="+", default=SHAPES.split(), help="K x N weight shapes")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if cpu_kernel.library() is None:
        raise SystemExit("the CPU kernel is not built (see the warning above): nothing to compare")
    torch.manual_seed(0)
    print(f"{torch.get_num_threads()} threads, torch {torch.__version__}")
    names = ("fp32", "bf16", "nvfp4", "general", "torch ops")
    print(
        f"{'K':>5} {'N':>5} {'M':>4} | " + " ".join(f"{name:>9}" for name in names)
        + " (ms) | nvfp4/float | nvfp4/general | nvfp4/torch ops"
    )
    with torch.no_grad():
        for shape in args.shapes:
            K, N = (int(size) for size in shape.split("x"))
            weight = torch.randn(N, K)
            weight_bf16 = weight.to(torch.bfloat16)
            quantized = NVFP4StaticTensor.from_float(weight_bf16, torch.tensor(4.0), backend_override="cpu")
            layer = NVFP4StaticLinear(quantized, None, recipe={}, layer_name="bench")
            general = copy.copy(layer)  # the same weight, without prepared calls
            general._eager_cpu_calls = None
            for M in args.m:
                x = torch.randn(M, K)
                x_bf16 = x.to(torch.bfloat16)
                calls = {
                    "fp32": lambda: F.linear(x, weight),
                    "bf16": lambda: F.linear(x_bf16, weight_bf16),
                    "nvfp4": lambda: layer(x_bf16),
                    "general": lambda: general(x_bf16),
                    "torch ops": on_torch_ops(lambda: layer(x_bf16)),
                }
                out, reference = calls["nvfp4"]().float(), calls["torch ops"]().float()
                if not torch.equal(out, calls["general"]().float()):
                    raise AssertionError(f"{K} x {N}, M = {M}: the prepared call differs from the general route's")
                if not torch.allclose(out, reference, rtol=2**-8, atol=2**-8 * reference.abs().max().item()):
                    raise AssertionError(f"{K} x {N}, M = {M}: the kernel's output differs from the torch ops'")
                best = best_of_rounds(calls, args.rounds)
                cells = " ".join(f"{best[name] * 1e3:9.3f}" for name in names)
                print(
                    f"{K:>5} {N:>5} {M:>4} | {cells}      | {best['nvfp4'] / min(best['fp32'], best['bf16']):11.3g} |"
                    f" {best['nvfp4'] / best['general']:13.3g} | {best['nvfp4'] / best['torch ops']:15.3g}"
                )


if __name__ == "__main__":
    main()
