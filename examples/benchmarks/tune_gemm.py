"""Sweep tile configs of the Triton NVFP4 GEMM per M, to (re)fill ``kernels.gemm.GEMM_CONFIGS``.

For each weight shape and M, every candidate runs as the whole Triton linear
(``backends.triton_route.static_nvfp4_linear`` with the table replaced by that one config: the
activation kernel and the GEMM, or one GEMM that quantizes the activation itself), is checked
against a float32 product of the same dequantized operands, and is timed as a CUDA graph replay
(GPU time without Python launch overhead; do_bench median, L2 flushed between replays). Prints
the best per (K, N, M), and the bf16 ``F.linear`` time of the same shape for scale. Run on one GPU:

    python examples/benchmarks/tune_gemm.py
"""

import argparse

import torch
import torch.nn.functional as F
from bench_linear import graph_ms

from nvfp4_static.backends import triton_route
from nvfp4_static.backends.triton_route import static_nvfp4_linear
from nvfp4_static.kernels import gemm, gemm_activation_operand
from nvfp4_static.kernels.gemm import CublasAfterDequantize, GemmConfig
from nvfp4_static.numerics import dequantize_nvfp4, quantize_nvfp4

SHAPES = [(8192, 8192), (4096, 14336), (14336, 4096)]

# (block_m, block_n, block_k, num_warps, num_stages). Keep block_n * block_k / 16 >= 4 bytes per
# thread: smaller scale tiles are loaded in pieces too small for cp.async and stall every step.
DECODE_TILES = [
    (16, 64, 256, 4, 4),
    (16, 128, 256, 4, 3),
    (16, 128, 256, 8, 3),
    (16, 256, 128, 8, 3),
    (16, 64, 512, 4, 3),
]
MID_TILES = [(64, 128, 256, 4, 3), (64, 64, 256, 4, 4), (32, 128, 256, 4, 3), (64, 128, 256, 8, 3)]
# Transposed tiles (GemmConfig.weight_as_mma_a): the weight is the MMA's M side, so block_n >= 64.
MID_TILES_WEIGHT_AS_A = [(64, 256, 256, 8, 3), (64, 128, 256, 4, 3), (64, 128, 256, 8, 3), (64, 256, 128, 8, 3)]
PREFILL_CANDIDATES = [CublasAfterDequantize(), GemmConfig(128, 256, 128, 8, 3)]


def candidates(M: int) -> list:
    if M <= 16:
        # Each decode tile twice: after the activation kernel, and quantizing its rows itself.
        rows = 1 << (M - 1).bit_length()
        return [
            GemmConfig(*tile, programs_per_sm=p, activation_rows=r)
            for tile in DECODE_TILES
            for p in (1, 2, 3)
            for r in (0, rows)
        ]
    if M <= 64:
        return [GemmConfig(*tile, programs_per_sm=p) for tile in MID_TILES for p in (0, 1, 2)] + [
            GemmConfig(*tile, programs_per_sm=p, weight_as_mma_a=True) for tile in MID_TILES_WEIGHT_AS_A for p in (0, 1, 2)
        ]
    return PREFILL_CANDIDATES


def use_only(config) -> None:
    """Make ``config`` the whole tile table, in both modules that read it (the route imports
    the table by name, so patching ``gemm`` alone would leave the route on the shipped one)."""
    gemm.GEMM_CONFIGS = triton_route.GEMM_CONFIGS = ((None, config),)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--m", type=int, nargs="+", default=[1, 16, 64, 512, 4096])
    args = parser.parse_args()
    torch.manual_seed(0)
    print(f"device: {torch.cuda.get_device_name()}")
    best = []
    for K, N in SHAPES:
        weight = torch.randn(N, K, device="cuda")
        weight_scale = weight.abs().max() / 2688
        weight_qdata, weight_block_scales = quantize_nvfp4(weight, weight_scale)
        dequantized_weight = dequantize_nvfp4(weight_qdata, weight_block_scales)
        bias = torch.randn(N, device="cuda", dtype=torch.bfloat16)
        for M in args.m:
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            act_scale = x.abs().max().float() / 2688
            operand = gemm_activation_operand(x, act_scale)
            in_k_order = operand.float().reshape(M, -1, 2, 8).transpose(-1, -2).reshape(M, K)
            reference = (in_k_order @ dequantized_weight.t()) * (act_scale * weight_scale) + bias.float()
            bf16_weight = dequantized_weight.to(torch.bfloat16)
            bf16_ms = graph_ms(lambda: F.linear(x, bf16_weight, bias))
            results = []
            for config in candidates(M):
                use_only(config)
                run = lambda: static_nvfp4_linear(  # noqa: E731
                    x, weight_qdata, weight_block_scales, weight_scale, act_scale, bias
                )
                try:
                    out = run()
                except Exception as error:  # e.g. a tile that needs more shared memory than the GPU has
                    print(f"  skip {config}: {type(error).__name__}: {str(error)[:120]}")
                    continue
                error = ((out.float() - reference).norm() / reference.norm()).item()
                ms = graph_ms(run)
                results.append((ms, error, config))
            results.sort(key=lambda r: r[0])
            for ms, error, config in results[:6]:
                print(f"K={K:>5} N={N:>5} M={M:>4}  {ms:8.4f} ms  err {error:.1e}  bf16 {bf16_ms:.4f} ms  {config}")
            best.append((K, N, M, results[0][0], bf16_ms, results[0][2]))
    print("\nbest per shape (whole linear):")
    for K, N, M, ms, bf16_ms, config in best:
        print(f"K={K:>5} N={N:>5} M={M:>4}  {ms:8.4f} ms  bf16 {bf16_ms:8.4f} ms  {config}")


if __name__ == "__main__":
    main()
