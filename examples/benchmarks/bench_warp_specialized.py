"""The warp-specialized Gluon tiles (Hopper) against what they replace: Triton tiles at 65-512
rows, cuBLAS's route at 513-2048.

For each weight shape and M, GPU times from CUDA graphs (ms): bf16 ``F.linear``; the table's route
for M (``static_nvfp4_linear``), as it runs (each warp-specialized program taking about its share
of the rows: ``gemm_warp_specialized.tokens_per_program``), with 192 rows per program (128 + 64)
where that leaves the programs as many, else the tile's ("table-192", without the programs of 144
and 80 rows) and with the whole tile's rows ("table-whole"); and the activation operand kernel
followed by one GEMM: the bucket's own table entry (``gemm.gemm_config(M)``; above 512 rows cuBLAS
after the weight's dequantization, its epilogue fused, as the table runs it where no tile replaces
it), the tall 256 x 128 tile in Triton (``gemm.TALL_TILE_IN_TRITON``), and the tall and square (128
x 128) tiles warp-specialized (``gemm.TALL_TILE``, ``gemm.SQUARE_TILE``), and each with its K split
for one program per SM over the bucket's row tiles (``gemm.SPLIT_SQUARE_TILES``,
``gemm.SPLIT_TALL_TILES``: the tall one above 128 rows; their split sum included). Each
warp-specialized output is checked equal to its Triton twin's, and the table's three forms to each
other, bit for bit, before they are timed; with ``--rounds R`` each time is the median of R rounds
over every column, interleaved. The table takes a wide tile where its programs fill most SMs
(``gemm.wide_tile``); the last column names the one it takes, if any, with its K split.

Usage: python bench_warp_specialized.py [--m 72 100 128 129 200 256 257 384 512 1024]
    [--shapes 8192x8192 ...] [--rounds 1]
"""

import argparse
import statistics
from dataclasses import replace
from unittest import mock

import torch
import torch.nn.functional as F
from bench_linear import captured
from triton.testing import do_bench
from tune_gemm import make_weight

from nvfp4_static.backends.triton_route import static_nvfp4_linear
from nvfp4_static.kernels import gemm, gemm_activation_operand, gemm_warp_specialized
from nvfp4_static.kernels.gemm import SPLIT_SQUARE_TILES, SPLIT_TALL_TILES, SQUARE_TILE, TALL_TILE, TALL_TILE_IN_TRITON
from nvfp4_static.kernels.launch import ceil_div

# Columns after bf16 and the table's route: the operand kernel followed by each tile.
TABLE_COLUMNS = ("table", "table-192", "table-whole")
TILE_COLUMNS = ("entry", "tall-triton", "tall-ws", "square-ws", "split-square-ws", "split-tall-ws")


def operand_then_gemm(x, weight, act_scale, config):
    """The operand kernel, then ``config``'s GEMM (what the table runs for a Triton entry or a wide tile)."""

    def run():
        operand = gemm_activation_operand(x, act_scale, mma_order=True)
        out = torch.empty((x.shape[0], weight.qdata.shape[0]), dtype=x.dtype, device=x.device)
        gemm.launch_nvfp4_gemm(operand, weight.qdata, weight.block_scales, act_scale, weight.scale, weight.bias, out, config)
        return out

    return run


def operand_then_cublas(x, weight, act_scale, output_scale):
    """The operand kernel (in ``x``'s dtype), then the weight's dequantization and cuBLAS with the
    epilogue fused: the table's route where cuBLAS runs the product."""

    def run():
        operand = gemm_activation_operand(x, act_scale, x.dtype)
        return gemm.cublas_with_fused_epilogue(operand, weight.qdata, weight.block_scales, output_scale, weight.bias)

    return run


def whole_tile_rows(M: int, tokens_per_tile: int) -> int:
    """Each program takes its tile's rows at every M."""
    return tokens_per_tile


def rows_192_or_whole_tile(M: int, tokens_per_tile: int) -> int:
    """Each program takes 192 rows (a wgmma of 128 tokens, one of 64) in place of the tall tile's
    256 where that leaves the programs as many, else its tile's rows."""
    if tokens_per_tile == 256 and ceil_div(M, 192) == ceil_div(M, 256):
        return 192
    return tokens_per_tile


def with_rows_per_program(route, rows):
    """``route`` with the warp-specialized programs' rows given by ``rows(M, tokens_per_tile)``
    in place of ``gemm_warp_specialized.tokens_per_program``."""

    def run():
        with mock.patch.object(gemm_warp_specialized, "tokens_per_program", rows):
            return route()

    return run


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--m", type=int, nargs="+", default=[72, 100, 128, 129, 200, 256, 257, 384, 512, 1024])
    parser.add_argument("--shapes", nargs="+", default=["8192x8192", "4096x14336", "14336x4096", "4096x4096"],
                        help="weights as KxN")
    parser.add_argument("--rounds", type=int, default=1, help="interleaved rounds per cell (median)")
    args = parser.parse_args()
    device = torch.device("cuda")
    if not gemm.gemm_warp_specialized.available(device):
        raise SystemExit("bench_warp_specialized: needs a Hopper GPU and a Triton with Gluon's Hopper API")
    print(f"device: {torch.cuda.get_device_name()}")
    print(f"     K      N     M |   bf16  {'  '.join(TABLE_COLUMNS + TILE_COLUMNS)} | bf16 / each | table takes")
    for shape in args.shapes:
        K, N = (int(side) for side in shape.split("x"))
        weight = make_weight(K, N)
        for M in args.m:
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            act_scale = x.abs().max().float() / 2688
            output_scale = float(act_scale * weight.scale)
            entry = gemm.gemm_config(M)
            bucket = gemm.GEMM_CONFIGS[gemm.gemm_bucket(M)][0]
            split_square, split_tall = SPLIT_SQUARE_TILES.get(bucket), SPLIT_TALL_TILES.get(bucket)
            routes = {
                "entry": (
                    operand_then_gemm(x, weight, act_scale, entry)
                    if isinstance(entry, gemm.GemmConfig)
                    else operand_then_cublas(x, weight, act_scale, output_scale)
                ),
                "tall-triton": operand_then_gemm(x, weight, act_scale, TALL_TILE_IN_TRITON),
                "tall-ws": operand_then_gemm(x, weight, act_scale, TALL_TILE),
                "square-ws": operand_then_gemm(x, weight, act_scale, SQUARE_TILE),
                "split-square-ws": operand_then_gemm(x, weight, act_scale, split_square) if split_square else None,
                "split-tall-ws": operand_then_gemm(x, weight, act_scale, split_tall) if split_tall else None,
            }
            checked = {
                "tall-ws": TALL_TILE,
                "square-ws": SQUARE_TILE,
                "split-square-ws": split_square,
                "split-tall-ws": split_tall,
            }
            for name, tile in checked.items():
                if tile is None:
                    continue
                twin = operand_then_gemm(x, weight, act_scale, replace(tile, warp_specialized=False))
                if not torch.equal(twin(), routes[name]()):
                    raise SystemExit(f"bench_warp_specialized: {name} differs from its Triton twin at {K} x {N}, M = {M}")
            def table():
                return static_nvfp4_linear(
                    x, weight.qdata, weight.block_scales, weight.scale, act_scale, weight.bias, output_scale
                )

            tables = {
                "table": table,
                "table-192": with_rows_per_program(table, rows_192_or_whole_tile),
                "table-whole": with_rows_per_program(table, whole_tile_rows),
            }
            if not all(torch.equal(tables["table"](), form()) for form in tables.values()):
                raise SystemExit(f"bench_warp_specialized: the table's forms differ at {K} x {N}, M = {M}")
            timed = {
                "bf16": lambda: F.linear(x, weight.bf16, weight.bias),
                **tables,
                **{name: route for name, route in routes.items() if route},
            }
            graphs = {name: captured(run) for name, run in timed.items()}
            rounds = [
                {name: do_bench(graph.replay, return_mode="median") for name, graph in graphs.items()}
                for _ in range(args.rounds)
            ]
            ms = {name: statistics.median(times[name] for times in rounds) for name in graphs}
            ms.update({name: float("nan") for name, route in routes.items() if not route})
            wide = gemm.wide_tile(bucket, N, K, device)
            takes = {TALL_TILE: "tall", SQUARE_TILE: "square", split_square: "split-square", split_tall: "split-tall"}
            takes = f"{takes[wide]} ({gemm.split_k_for(wide, N, K, device)} splits)" if wide else "-"
            times = " ".join(f"{ms[name]:.4f}" for name in ("bf16", *TABLE_COLUMNS, *TILE_COLUMNS))
            ratios = " ".join(f"{ms['bf16'] / ms[name]:.2f}" for name in (*TABLE_COLUMNS, *TILE_COLUMNS))
            print(f"{K:6d} {N:6d} {M:5d} | {times} | {ratios} | {takes}", flush=True)


if __name__ == "__main__":
    main()
