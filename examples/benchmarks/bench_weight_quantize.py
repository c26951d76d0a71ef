"""Quantizing a weight at convert: the torch reference against the Triton kernel.

    python examples/benchmarks/bench_weight_quantize.py      # needs a CUDA GPU

For Llama-8B's MLP weights (14336 x 4096 and 4096 x 14336, bf16, Gaussian), under the FP8 weight
sweep's block scales and under block scales computed from block maxes: whether
``numerics.quantize_nvfp4`` (torch ops) and ``kernels.ops.quantize_weight_nvfp4`` (one Triton
kernel) give the same codes and scales, the median time of each (CUDA events around each call,
20 calls after 3 warm-up ones, L2 not flushed), and the GPU memory each takes beyond its inputs.
"""
import argparse

import torch

from nvfp4_static.kernels.ops import fp8_scale_sweep, quantize_weight_nvfp4
from nvfp4_static.numerics import per_tensor_amax_to_scale, quantize_nvfp4


def timed(fn, reps=20):
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def extra_peak_mib(fn):
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    return peak / 2**20


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    print(torch.cuda.get_device_name())
    for N, K in [(14336, 4096), (4096, 14336)]:
        measure(N, K)


def measure(N: int, K: int) -> None:
    """One line per block-scale source for an ``N x K`` bf16 weight."""
    weight = (torch.randn(N, K, device="cuda") * 0.02).to(torch.bfloat16)
    amax = weight.abs().amax().float()
    scale = per_tensor_amax_to_scale(amax)
    swept = fp8_scale_sweep(weight, amax)
    for label, given in (("sweep scales", swept), ("computed scales", None)):
        ref = quantize_nvfp4(weight, scale, given)
        ker = quantize_weight_nvfp4(weight, scale, given)
        equal = torch.equal(ref[0], ker[0]) and torch.equal(ref[1].view(torch.uint8), ker[1].view(torch.uint8))
        t_ref = timed(lambda: quantize_nvfp4(weight, scale, given))
        t_ker = timed(lambda: quantize_weight_nvfp4(weight, scale, given))
        m_ref = extra_peak_mib(lambda: quantize_nvfp4(weight, scale, given))
        m_ker = extra_peak_mib(lambda: quantize_weight_nvfp4(weight, scale, given))
        print(f"{N}x{K} bf16, {label}: bit-equal={equal}  reference {t_ref:.3f} ms / {m_ref:.0f} MiB peak extra"
              f"  kernel {t_ker:.3f} ms / {m_ker:.0f} MiB peak extra  ({t_ref / t_ker:.1f}x)")


if __name__ == "__main__":
    main()
