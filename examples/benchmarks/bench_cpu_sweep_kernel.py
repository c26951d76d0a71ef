"""The CPU weight-scale sweep's C kernel against its torch reference, plain and Hessian-weighted.

    python examples/benchmarks/bench_cpu_sweep_kernel.py [--shapes 576x1536 1536x576 2048x2048] [--rounds 2]

For each weight shape (N x K, a bfloat16 ``randn`` weight, blocks of gains 2^-4 .. 1) and each
weighting (none, and the block Hessian of 64 ``randn`` tokens), seconds per sweep of the whole
weight: ``references.fp8_scale_sweep`` (``reference``: the torch ops, on one thread as the
package runs them), ``backends.cpu_sweep.fp8_scale_sweep`` on one thread (``kernel, 1 thread``)
and on torch's thread count (``kernel, N threads``, what convert runs). Each cell is the best of
``--rounds`` interleaved rounds; the scales of all three are checked equal bit for bit first. The
last column is the reference's time over the kernel's on N threads.
"""

import argparse
import time

import torch

from nvfp4_static import references
from nvfp4_static.backends import cpu_kernel, cpu_sweep


def seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def on_threads(threads: int, fn):
    def run():
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            return fn()
        finally:
            torch.set_num_threads(before)

    return run


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["576x1536", "1536x576", "2048x2048"], help="N x K weight shapes")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    if cpu_kernel.library() is None:
        raise SystemExit("the CPU kernel is not built here (no C compiler, or NVFP4_STATIC_CPU_KERNEL=0)")
    threads = torch.get_num_threads()
    generator = torch.Generator().manual_seed(0)
    header = f"| N x K | weighting | reference | kernel, 1 thread | kernel, {threads} threads | reference / kernel |"
    rows = []
    for shape in args.shapes:
        n, k = map(int, shape.split("x"))
        gains = 2.0 ** torch.randint(-4, 1, (n, k // 16, 1), generator=generator).float()
        weight = (torch.randn(n, k // 16, 16, generator=generator) * gains).reshape(n, k).to(torch.bfloat16)
        global_amax = weight.abs().max().float()
        for weighting, hessian in (("none", None), ("Hessian", references.block_hessian(torch.randn(64, k, generator=generator)))):
            forms = {
                "reference": lambda: references.fp8_scale_sweep(weight, global_amax, hessian),
                "kernel, 1 thread": on_threads(1, lambda: cpu_sweep.fp8_scale_sweep(weight, global_amax, hessian)),
                "kernel, N threads": lambda: cpu_sweep.fp8_scale_sweep(weight, global_amax, hessian),
            }
            scales = [form().view(torch.uint8) for form in forms.values()]
            assert all(torch.equal(scales[0], other) for other in scales[1:]), f"{shape} {weighting}: scales differ"
            times = {name: [] for name in forms}
            for _ in range(args.rounds):
                for name, form in forms.items():
                    times[name].append(seconds(form))
            best = {name: min(each) for name, each in times.items()}
            rows.append(
                f"| {n} x {k} | {weighting} | {best['reference']:.3f} | {best['kernel, 1 thread']:.3f} | "
                f"{best['kernel, N threads']:.3f} | {best['reference'] / best['kernel, N threads']:.1f} |"
            )
            print(rows[-1], flush=True)
    print()
    print(header)
    print("|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
