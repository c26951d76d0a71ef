"""A compiled static NVFP4 linear at decode sizes, followed by a residual add, against the same
linear called eagerly.

For each weight shape (K x N) and M, GPU times from CUDA graphs (ms) of
``static_nvfp4_linear(x, ...) + r`` compiled (``torch.compile``, fullgraph, default mode), where
the GEMM's K splits are summed and scaled by Inductor inside the kernel that adds ``r``, and of
the same function called eagerly (the GEMM sums its splits itself, then ``r`` is added). Both are
timed from CUDA graphs, so both take the tiles of a graph (``gemm.DECODE_TILE_MIN_K_TILES_IN_GRAPHS``:
an eager call captured into a graph takes them too); column ``takes``: that tile, then the one
an eager call takes when not captured (the warp-specialized decode tile or the Triton entry),
with their K splits.

Usage: python bench_compiled_decode.py [--m 4 16] [--shapes 8192x8192 ...]
"""

import argparse

import torch
from bench_decode_tile import tile_name, tiles_taken
from bench_linear import graph_ms
from tune_gemm import make_weight

from nvfp4_static.backends.triton_route import static_nvfp4_linear
from nvfp4_static.kernels import gemm

SHAPES = "8192x8192 4096x14336 14336x4096 4096x4096 4096x28672"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--m", type=int, nargs="+", default=[4, 16])
    parser.add_argument("--shapes", nargs="+", default=SHAPES.split(), help="K x N weight shapes")
    args = parser.parse_args()
    torch._dynamo.config.recompile_limit = 64  # one compile per shape and M
    device = torch.device("cuda")
    print(f"device: {torch.cuda.get_device_name()}")
    print(f"{'K':>6} {'N':>6} {'M':>3} | {'takes':>12} {'split':>5} | {'compiled':>8} {'eager':>8}")
    for shape in args.shapes:
        K, N = (int(size) for size in shape.split("x"))
        weight = make_weight(K, N)
        for M in args.m:
            x = torch.randn(M, K, device=device, dtype=torch.bfloat16)
            residual = torch.randn(M, N, device=device, dtype=torch.bfloat16)
            act_scale = x.abs().max().float() / 2688
            output_scale = float(act_scale * weight.scale)

            def linear_and_add(x, residual):
                out = static_nvfp4_linear(
                    x, weight.qdata, weight.block_scales, weight.scale, act_scale, weight.bias, output_scale
                )
                return out + residual

            torch._dynamo.reset()
            compiled = torch.compile(linear_and_add, fullgraph=True)
            with torch.no_grad():
                compiled(x, residual)
                compiled_ms = graph_ms(lambda: compiled(x, residual))
                eager_ms = graph_ms(lambda: linear_and_add(x, residual))
            tiles = tiles_taken(M, N, K, device)[::-1]  # the graph's, then the eager call's
            takes = "/".join(tile_name(tile) for tile in tiles)
            splits = "/".join(str(gemm.split_k_for(tile, N, K, device)) for tile in tiles)
            print(f"{K:>6} {N:>6} {M:>3} | {takes:>12} {splits:>5} | {compiled_ms:>8.4f} {eager_ms:>8.4f}")


if __name__ == "__main__":
    main()
