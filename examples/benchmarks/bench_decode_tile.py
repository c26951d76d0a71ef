"""The warp-specialized decode tile (Hopper) against the table entries it replaces at 1-16 rows.

For each weight shape (K x N) and M, GPU times from CUDA graphs (ms) of the whole linear
(``static_nvfp4_linear``: the operand kernel, where the tiles take one, then the GEMM) with the
bucket's Triton entry and with the decode tile (``gemm.DECODE_TILE``) forced in its place, the
floor kernel that only reads the packed weight and its scales, and the decode tile's K split
(``gemm.split_k_for``) with the K tiles each split runs. The last column: the tile the table
takes in eager calls (``gemm.DECODE_TILE_MIN_K_TILES``) and in a graph
(``gemm.DECODE_TILE_MIN_K_TILES_IN_GRAPHS``; these times are a graph's, and eager calls pay a
host time the graph does not). Column
``no overlap``: the decode tile again, its operand kernel not letting it start before that kernel
ends (``act_quantize.overlaps_kernels`` off), which shows what starting early saves. Column
``across``: the decode tile again, its K splits summed across programs through global memory
(``gemm_decode_warp_specialized.sums_in_program`` off) where its programs would sum them
themselves (2 or 4 splits of as many K tiles; at one row of at most 8), which shows what summing
in the program saves. Before timing, the decode tile's output is checked equal, bit for bit, to
its Triton twin's (``gemm.DECODE_TILE_IN_TRITON``) and to its own with the splits summed across
programs. With ``--rounds R`` each cell is the median of R rounds, the columns interleaved in
each, for differences under a microsecond.

Usage: python bench_decode_tile.py [--m 1 4 16] [--shapes 8192x8192 ...] [--rounds 1]
"""

import argparse
import statistics
from unittest import mock

import torch
from bench_linear import bare_read_ms, graph_ms
from tune_gemm import make_weight

from nvfp4_static.backends.triton_route import static_nvfp4_linear
from nvfp4_static.kernels import act_quantize, gemm, gemm_activation_operand, gemm_decode_warp_specialized
from nvfp4_static.kernels.gemm import DECODE_TILE, DECODE_TILE_IN_TRITON

SHAPES = (
    "8192x8192 4096x14336 14336x4096 4096x4096 4096x6144 4096x28672 8192x28672 28672x8192 8192x10240 "
    "5120x5120 2048x8192 8192x2048"
)


def linear_ms(x, weight, act_scale, min_k_tiles: int) -> float:
    """The whole linear's graph time with the decode tile taken from ``min_k_tiles`` K tiles per
    split, eagerly and in graphs (a CUDA graph being captured takes the graphs' rule)."""
    output_scale = float(act_scale * weight.scale)
    rule = dict(DECODE_TILE_MIN_K_TILES=min_k_tiles, DECODE_TILE_MIN_K_TILES_IN_GRAPHS=min_k_tiles)
    with mock.patch.multiple(gemm, **rule):
        return graph_ms(
            lambda: static_nvfp4_linear(
                x, weight.qdata, weight.block_scales, weight.scale, act_scale, weight.bias, output_scale
            )
        )


def without_overlap(measure):
    """``measure()`` with the operand kernel never letting the kernel after it start early."""
    with mock.patch.object(act_quantize, "overlaps_kernels", lambda device: False):
        return measure()


def across_programs(measure):
    """``measure()`` with the decode tile's K splits summed across programs, never in one."""
    with mock.patch.object(gemm_decode_warp_specialized, "sums_in_program", lambda split_k, K, M: False):
        return measure()


def tiles_taken(M: int, N: int, K: int, device: torch.device) -> tuple:
    """The tiles an eager call and a graph take for ``M`` rows of an ``[N, K]`` weight."""
    graph = gemm.operand_config(gemm.gemm_bucket(M), N, K, device, in_graph=True)
    return gemm.table_config(M, None, N, K, device), graph


def tile_name(config) -> str:
    """``decode`` for the decode tile in either form (taking its operand, or quantizing its one
    row), else ``entry``."""
    return "decode" if gemm.is_decode_tile(config) else "entry"


def same_as_the_triton_twin(x, weight, act_scale) -> bool:
    """Whether the decode tile's output equals its Triton twin's, and its own with the K splits
    summed across programs, bit for bit."""
    operand = gemm_activation_operand(x, act_scale, mma_order=True)

    def output(config):
        out = torch.empty((x.shape[0], weight.qdata.shape[0]), dtype=x.dtype, device=x.device)
        scales = (weight.block_scales, act_scale, weight.scale)
        gemm.launch_nvfp4_gemm(operand, weight.qdata, *scales, weight.bias, out, config)
        return out

    ours = output(DECODE_TILE)
    across = across_programs(lambda: output(DECODE_TILE))
    return torch.equal(ours, output(DECODE_TILE_IN_TRITON)) and torch.equal(ours, across)


def weights_with_read_floor(shapes: list[str]):
    """``(K, N, weight, read)`` for each ``"KxN"`` of ``shapes``: a random weight
    (``tune_gemm.make_weight``) and the floor kernel's time reading it (ms)."""
    for shape in shapes:
        K, N = (int(size) for size in shape.split("x"))
        weight = make_weight(K, N)
        yield K, N, weight, bare_read_ms(graph_ms, weight.qdata, weight.block_scales)


def shapes_and_rounds_parser(description: str, shapes: list[str]) -> argparse.ArgumentParser:
    """The decode benchmarks' arguments: ``--shapes`` (K x N, by default ``shapes``) and
    ``--rounds`` (interleaved rounds per cell, whose median it prints)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--shapes", nargs="+", default=shapes, help="K x N weight shapes")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds per cell (median)")
    return parser


def hopper_device(script: str) -> torch.device:
    """The CUDA device (named on stdout), or an exit naming ``script`` where there is no Hopper
    GPU or Gluon's Hopper API."""
    device = torch.device("cuda")
    if not (torch.cuda.is_available() and gemm.gemm_warp_specialized.available(device)):
        raise SystemExit(f"{script} needs a Hopper GPU and Gluon's Hopper API")
    print(f"device: {torch.cuda.get_device_name()}")
    return device


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--m", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--shapes", nargs="+", default=SHAPES.split(), help="K x N weight shapes")
    parser.add_argument("--rounds", type=int, default=1, help="interleaved rounds per cell (median)")
    args = parser.parse_args()
    device = hopper_device("bench_decode_tile.py")
    print(f"{'K':>6} {'N':>6} {'M':>3} | {'split':>5} {'K tiles':>7} | {'read':>7} {'entry':>7} {'decode':>7} "
          f"{'no overlap':>10} {'across':>7} | {'entry/decode':>12} {'eager/graph':>13}")
    everywhere, nowhere = 1, 1 << 30
    for K, N, weight, read in weights_with_read_floor(args.shapes):
        split = gemm.split_k_for(DECODE_TILE, N, K, device)
        k_tiles = -(-K // DECODE_TILE.block_k) / split
        for M in args.m:
            x = torch.randn(M, K, device=device, dtype=torch.bfloat16)
            act_scale = x.abs().max().float() / 2688
            if not same_as_the_triton_twin(x, weight, act_scale):
                raise SystemExit(f"{K} x {N} at M = {M}: the decode tile's output differs from its Triton twin's")
            rounds = [
                (
                    linear_ms(x, weight, act_scale, nowhere),
                    linear_ms(x, weight, act_scale, everywhere),
                    without_overlap(lambda: linear_ms(x, weight, act_scale, everywhere)),
                    across_programs(lambda: linear_ms(x, weight, act_scale, everywhere)),
                )
                for _ in range(args.rounds)
            ]
            entry, decode, apart, across = (statistics.median(column) for column in zip(*rounds))
            takes = [tile_name(config) for config in tiles_taken(M, N, K, device)]
            print(f"{K:>6} {N:>6} {M:>3} | {split:>5} {k_tiles:>7.1f} | {read:>7.4f} {entry:>7.4f} {decode:>7.4f} "
                  f"{apart:>10.4f} {across:>7.4f} | {entry / decode:>12.2f} {'/'.join(takes):>13}")


if __name__ == "__main__":
    main()
