"""Where a prefill-sized static NVFP4 linear spends its time on a GPU without FP4 tensor cores.

From 513 tokens (on Hopper from 2049, or where the tall tile would leave SMs idle) the Triton
route runs three kernels: the activation's quantization into a bf16 operand
(``gemm_activation_operand``), the weight's dequantization (``launch_weight_dequantize``) and a
cuBLAS GEMM with both global scales and the bias in its epilogue. This script times each part
alone beside bf16's ``F.linear`` and the whole linear, in one run, and the floor of each
memory-bound part: its bytes read and written at the device-to-device copy rate measured in the
same run. Times are medians of CUDA-graph replays (``bench_linear.graph_ms``); each column is
measured in ``--rounds`` interleaved rounds and the median round is shown, so that clock drift
over the run lands on every column alike. Run:

    python examples/benchmarks/bench_prefill.py [--m 4096] [--rounds 3]
"""

import argparse
import statistics

import torch
import torch.nn.functional as F

from bench_linear import SHAPES, copy_bandwidth_gbs, graph_ms
from nvfp4_static.backends.triton_route import static_nvfp4_linear
from nvfp4_static.kernels.gemm import launch_weight_dequantize
from nvfp4_static.kernels.ops import gemm_activation_operand
from nvfp4_static.numerics import per_tensor_amax_to_scale, quantize_nvfp4

COLUMNS = ["bf16", "ours", "operand", "dequantize", "cublas"]


def part_timers(M: int, K: int, N: int) -> dict:
    """The five timed calls for one shape, each a zero-argument function."""
    weight = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(N, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    weight_scale = per_tensor_amax_to_scale(weight.abs().amax().float())
    act_scale = per_tensor_amax_to_scale(x.abs().amax().float())
    qdata, block_scales = quantize_nvfp4(weight, weight_scale)
    output_scale = float(act_scale * weight_scale)
    operand = gemm_activation_operand(x, act_scale, torch.bfloat16)
    dequantized = torch.empty(N, K, device="cuda", dtype=torch.bfloat16)
    launch_weight_dequantize(qdata, block_scales, dequantized)
    return {
        "bf16": lambda: F.linear(x, weight, bias),
        "ours": lambda: static_nvfp4_linear(x, qdata, block_scales, weight_scale, act_scale, bias, output_scale),
        "operand": lambda: gemm_activation_operand(x, act_scale, torch.bfloat16),
        "dequantize": lambda: launch_weight_dequantize(qdata, block_scales, dequantized),
        "cublas": lambda: torch.addmm(bias, operand, dequantized.t(), alpha=output_scale),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--m", type=int, nargs="+", default=[4096])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    copy_gbs = copy_bandwidth_gbs()
    print(f"device: {torch.cuda.get_device_name()}, device-to-device copy {copy_gbs:.0f} GB/s")
    header = f"{'K':>6} {'N':>6} {'M':>5} | " + " ".join(f"{name:>10}" for name in COLUMNS) + " (ms)"
    print(header + f" | {'bf16/ours':>9} {'operand floor':>13} {'dequant floor':>13}")
    with torch.no_grad():
        for K, N in SHAPES:
            for M in args.m:
                timers = part_timers(M, K, N)
                rounds = [{name: graph_ms(fn) for name, fn in timers.items()} for _ in range(args.rounds)]
                ms = {name: statistics.median(r[name] for r in rounds) for name in COLUMNS}
                # Operand: bf16 activation read, bf16 operand written. Dequantize: packed codes
                # and FP8 scales read, the bf16 weight written.
                operand_floor = 2 * (2 * M * K) / copy_gbs / 1e6
                dequant_floor = (N * K // 2 + N * K // 16 + 2 * N * K) / copy_gbs / 1e6
                print(
                    f"{K:>6} {N:>6} {M:>5} | " + " ".join(f"{ms[name]:10.4f}" for name in COLUMNS) + "      | "
                    f"{ms['bf16'] / ms['ours']:9.2f} {operand_floor:13.4f} {dequant_floor:13.4f}"
                )


if __name__ == "__main__":
    main()
