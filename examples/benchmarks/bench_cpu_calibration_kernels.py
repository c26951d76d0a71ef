"""Convert's weight searches and final quantize on a CPU, their C kernels against the torch references.

    python examples/benchmarks/bench_cpu_calibration_kernels.py [--shapes 576x1536 1536x576 2048x2048] [--rounds 2]

For each weight shape (N x K, a bfloat16 ``randn`` weight, blocks of gains 2^-4 .. 1) and each
search: the FP8 block-scale sweep unweighted (``sweep``) and weighted by the block Hessian of 64
``randn`` tokens (``sweep, Hessian``), and GPTQ under the full Hessian of those tokens
(``gptq``: ``gptq.gptq_quantize_nvfp4``, whose per-block scale search and rounding is the
kernel's part), and the weight's quantize under the sweep's block scales (``quantize``: its packed
codes, ``backends.cpu_quantize``), seconds per call on the whole weight: with the torch reference
(``references.fp8_scale_sweep`` on one thread, as the package runs it where the kernel is not
built; ``references.gptq_block`` in GPTQ; ``numerics.quantize_nvfp4`` on torch's threads), with
the C kernel on one thread (``kernel, 1
thread``) and on torch's thread count (``kernel, N threads``, what convert runs). Each cell is the
best of ``--rounds`` interleaved rounds (``bench_cpu_linear.best_of_rounds``); the results of all
three are checked equal bit for bit first. The last column is the reference's time over the kernel's on N threads.
"""

import argparse

import torch

from bench_cpu_linear import best_of_rounds, on_torch_ops
from nvfp4_static import references
from nvfp4_static.backends import cpu_kernel, cpu_quantize, cpu_sweep
from nvfp4_static.gptq import gptq_quantize_nvfp4
from nvfp4_static.numerics import per_tensor_amax_to_scale


def on_threads(threads: int, fn):
    """``fn`` run with torch's thread count set to ``threads``."""

    def run():
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            return fn()
        finally:
            torch.set_num_threads(before)

    return run


def as_bits(result):
    """A search's result as tensors compared bit for bit."""
    if isinstance(result, torch.Tensor):
        return [result.view(torch.uint8)]
    if hasattr(result, "_fields"):  # GPTQ's result
        return [getattr(result, name) for name in result._fields]
    return [t.view(torch.uint8) for t in result]  # the quantize's codes and block scales


def searches(weight: torch.Tensor, tokens: torch.Tensor) -> dict:
    global_amax = weight.abs().max().float()
    hessian = references.block_hessian(tokens)
    sweep_scales = cpu_sweep.fp8_scale_sweep(weight, global_amax)
    return {
        "sweep": lambda: cpu_sweep.fp8_scale_sweep(weight, global_amax),
        "sweep, Hessian": lambda: cpu_sweep.fp8_scale_sweep(weight, global_amax, hessian),
        "gptq": lambda: gptq_quantize_nvfp4(weight, tokens.T @ tokens, global_amax, dampening=0.01, name=""),
        "quantize": lambda: cpu_quantize.quantize_nvfp4(weight, per_tensor_amax_to_scale(global_amax), sweep_scales),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["576x1536", "1536x576", "2048x2048"], help="N x K weight shapes")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--searches", nargs="+", default=None, help="a subset of: sweep, 'sweep, Hessian', gptq, quantize")
    args = parser.parse_args()
    if cpu_kernel.library() is None:
        raise SystemExit("the CPU kernels are not built here (no C compiler, or NVFP4_STATIC_CPU_KERNEL=0)")
    threads = torch.get_num_threads()
    generator = torch.Generator().manual_seed(0)
    header = f"| N x K | search | reference | kernel, 1 thread | kernel, {threads} threads | reference / kernel |"
    rows = []
    for shape in args.shapes:
        n, k = map(int, shape.split("x"))
        gains = 2.0 ** torch.randint(-4, 1, (n, k // 16, 1), generator=generator).float()
        weight = (torch.randn(n, k // 16, 16, generator=generator) * gains).reshape(n, k).to(torch.bfloat16)
        tokens = torch.randn(64, k, generator=generator)
        for search, run in searches(weight, tokens).items():
            if args.searches is not None and search not in args.searches:
                continue
            forms = {"reference": on_torch_ops(run), "kernel, 1 thread": on_threads(1, run), "kernel, N threads": run}
            results = [as_bits(form()) for form in forms.values()]
            assert all(
                all(torch.equal(a, b) for a, b in zip(results[0], other)) for other in results[1:]
            ), f"{shape} {search}: results differ"
            best = best_of_rounds(forms, args.rounds)
            rows.append(
                f"| {n} x {k} | {search} | {best['reference']:.3f} | {best['kernel, 1 thread']:.3f} | "
                f"{best['kernel, N threads']:.3f} | {best['reference'] / best['kernel, N threads']:.1f} |"
            )
            print(rows[-1], flush=True)
    print()
    print(header)
    print("|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
