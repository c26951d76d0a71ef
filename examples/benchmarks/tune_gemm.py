"""Sweep tile configs of the Triton NVFP4 GEMM per M, to (re)fill ``kernels.gemm.GEMM_CONFIGS``.

For each weight shape and M, the shipped table and every candidate run as the whole Triton linear
(``backends.triton_route.static_nvfp4_linear`` with the table replaced by that one config, given
the host scale product an ``NVFP4StaticTensor`` carries: the activation kernel and the GEMM, or
one GEMM that quantizes the activation itself, or dequantize + cuBLAS), are checked against a
float32 product of the same dequantized operands (a candidate off by more than ``MAX_ERROR`` is
reported and left out), and are timed as a CUDA graph replay (GPU time without Python launch
overhead; do_bench median, L2 flushed between replays), beside bf16 ``F.linear`` on the same
shape. Prints the fastest candidates per (K, N, M), then a summary: per (K, N, M) bf16, the
table and the best candidate; per M, and per bucket of the shipped table where several of its Ms
ran, the one candidate whose slowest case against bf16 is fastest: the entry to put in the
table for that bucket. Run on one GPU:

    python examples/benchmarks/tune_gemm.py [--m 1 16 64 512 4096] [--candidates full|wide|decode-wide|programs|unfilled]
        [--shapes 4096x4096 8192x8192]

``--candidates wide`` times only the table and the wide MMA-order tiles (``WIDE_TILES``) from
M = 17 up, ``--candidates decode-wide`` the table and the decode tiles in the wide form
(``DECODE_WIDE_TILES``, after the activation kernel and quantizing their rows) up to M = 16,
``--candidates programs`` the table's split entries with their K split sized for 1 to 8
programs per SM (and unsplit), ``--candidates unfilled`` the table's entries that grow their
split to fill the SMs (``fill_programs_per_sm``) against the same entries without;
``--shapes`` replaces the three weight shapes; ``--budget-s`` starts no further M after that
many seconds (each M runs on every shape, so put the Ms that matter most first).
"""

import argparse
import time
from dataclasses import fields, replace
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
from bench_linear import graph_ms

from nvfp4_static.backends import triton_route
from nvfp4_static.backends.triton_route import static_nvfp4_linear
from nvfp4_static.kernels import gemm, gemm_activation_operand
from nvfp4_static.kernels.gemm import CublasAfterDequantize, GemmConfig
from nvfp4_static.kernels.launch import ceil_div, next_power_of_2
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
# The decode tiles in the wide form (``--candidates decode-wide``), and two with shorter K tiles:
# the weight as the MMA's first operand in the MMA order, the activation's operand (from the
# activation kernel, or quantized by the GEMM itself) as the wgmma's 16 columns, block_n a
# multiple of 64 (64 weight rows per warpgroup).
DECODE_WIDE_TILES = DECODE_TILES + [(16, 64, 128, 4, 5), (16, 128, 128, 8, 4)]
MID_TILES = [(64, 128, 256, 4, 3), (64, 64, 256, 4, 4), (32, 128, 256, 4, 3), (64, 128, 256, 8, 3)]
# Transposed tiles (GemmConfig.weight_as_mma_a): the weight is the MMA's M side, so block_n >= 64.
MID_TILES_WEIGHT_AS_A = [(64, 256, 256, 8, 3), (64, 128, 256, 4, 3), (64, 128, 256, 8, 3), (64, 256, 128, 8, 3)]
# Wide tiles: transposed, in the MMA order (GemmConfig.mma_order), up to 256 activation rows
# (the wgmma's N) sharing each dequantized weight tile, 64 weight rows per warpgroup; each with
# whether it is also tried with a split K. Every one compiles for sm_90 (Triton 3.6) within
# 227 KiB of shared memory and without register spills in its K loop; the split-K ones that
# would spill are not split. Not listed: 128 x 128 x 64 with 8 warps and 3 or 4 stages, of which
# two programs fit on one SM and then give different outputs launch to launch, some NaN (H100,
# Triton 3.6; test/test_gemm_hopper_code.py keeps such 8-warp tiles out of the table).
WIDE_TILES = [
    ((64, 256, 128, 8, 3), True),
    ((64, 128, 128, 4, 4), True),
    ((128, 128, 128, 8, 3), True),
    ((128, 128, 256, 8, 2), True),
    ((128, 256, 64, 8, 4), True),
    ((256, 128, 128, 8, 3), False),
    ((256, 128, 64, 8, 4), True),
    ((256, 64, 64, 4, 4), False),
    # One warpgroup per program, two or more programs per SM.
    ((32, 64, 128, 4, 4), True),
    ((32, 64, 256, 4, 3), True),
    ((64, 64, 128, 4, 3), True),
    ((64, 64, 128, 4, 4), True),
    ((128, 64, 128, 4, 3), True),
    ((128, 64, 128, 4, 2), True),
    ((128, 64, 64, 4, 4), True),
    ((128, 64, 64, 4, 3), True),
    ((256, 64, 64, 4, 3), False),
    ((256, 64, 64, 4, 2), False),
    ((128, 128, 64, 4, 4), False),
    ((128, 128, 64, 4, 3), False),
]
PREFILL_CANDIDATES = [CublasAfterDequantize(), GemmConfig(128, 256, 128, 8, 3)]
# Relative error against the float32 product above which a candidate counts as wrong: a bf16
# output's own rounding gives about 2^-9.
MAX_ERROR = 1e-2


def wide_candidates(M: int) -> list:
    """The wide tiles for M: those with at most max(64, M rounded up to a power of 2) rows and
    at most 4 row tiles (from 1024 rows on, the 256-row ones); each also with K split within two
    programs per SM where the tile allows it, the split sized for M's row tiles and, where M
    spans several, also for twice as many (half the split: fewer partial products to sum).
    A split entry's split is fixed (``GemmConfig.row_tiles_for_split``), so in the table it
    serves its whole bucket with the split chosen here for M."""
    rows = next_power_of_2(M)
    configs = []
    for tile, splits in WIDE_TILES:
        block_m = tile[0]
        if block_m > max(64, rows) or block_m < min(rows // 4, 256):
            continue
        wide = dict(weight_as_mma_a=True, mma_order=True)
        configs.append(GemmConfig(*tile, **wide))
        if splits:
            row_tiles = ceil_div(M, block_m)
            for planned in (row_tiles, 2 * row_tiles) if row_tiles > 1 else (1,):
                configs.append(GemmConfig(*tile, programs_per_sm=2, row_tiles_for_split=planned, **wide))
    return configs


def full_candidates(M: int) -> list:
    if M <= 16:
        # Each decode tile twice: after the activation kernel, and quantizing its rows itself;
        # then the decode tiles in the wide form.
        rows = next_power_of_2(M)
        return [
            GemmConfig(*tile, programs_per_sm=p, activation_rows=r)
            for tile in DECODE_TILES
            for p in (1, 2, 3)
            for r in (0, rows)
        ] + decode_wide_candidates(M)
    if M <= 64:
        return (
            [GemmConfig(*tile, programs_per_sm=p) for tile in MID_TILES for p in (0, 1, 2)]
            + [
                GemmConfig(*tile, programs_per_sm=p, weight_as_mma_a=True)
                for tile in MID_TILES_WEIGHT_AS_A
                for p in (0, 1, 2)
            ]
            + wide_candidates(M)
        )
    return PREFILL_CANDIDATES + wide_candidates(M)


def decode_wide_candidates(M: int) -> list:
    """The decode tiles in the wide form up to M = 16, K split to 1-3 programs per SM, each
    after the activation kernel and quantizing its rows itself."""
    if M > 16:
        return []
    wide = dict(weight_as_mma_a=True, mma_order=True)
    return [
        GemmConfig(*tile, programs_per_sm=p, activation_rows=r, **wide)
        for tile in DECODE_WIDE_TILES
        for p in (1, 2, 3)
        for r in (0, next_power_of_2(M))
    ]


def programs_candidates(M: int) -> list:
    """The table's entry for M with its K split for 1 to 8 programs per SM (without
    ``fill_programs_per_sm``), and unsplit where it plans one row tile (``gemm.split_k_for``):
    the split that entry should take."""
    entry = gemm.gemm_config(M)
    if not isinstance(entry, GemmConfig) or not entry.programs_per_sm:
        return []
    plain = replace(entry, fill_programs_per_sm=0)
    unsplit = [replace(plain, programs_per_sm=0)] if entry.row_tiles_for_split == 1 else []
    return unsplit + [replace(plain, programs_per_sm=p) for p in range(1, 9)]


def unfilled_candidates(M: int) -> list:
    """The table's entry for M without ``fill_programs_per_sm`` (its split always sized for
    ``programs_per_sm``), where it has one: the baseline of the split grown to fill the SMs."""
    entry = gemm.gemm_config(M)
    if not isinstance(entry, GemmConfig) or not entry.fill_programs_per_sm:
        return []
    return [replace(entry, fill_programs_per_sm=0)]


def candidates(M: int, which: str) -> list:
    if which == "programs":
        return programs_candidates(M)
    if which == "unfilled":
        return unfilled_candidates(M)
    if which == "decode-wide":
        return decode_wide_candidates(M)
    if which == "wide":
        return wide_candidates(M) if M > 16 else []
    return full_candidates(M)


SHIPPED_TABLE = gemm.GEMM_CONFIGS


def use_table(table) -> None:
    """Make ``table`` the tile table, in both modules that read it (the route imports the table
    by name, so patching ``gemm`` alone would leave the route on the shipped one)."""
    gemm.GEMM_CONFIGS = triton_route.GEMM_CONFIGS = table


def describe(config) -> str:
    """A config as the Python that builds it, defaults left out: pasteable into the table."""
    if isinstance(config, CublasAfterDequantize):
        return "CublasAfterDequantize()"
    tile = [str(getattr(config, field.name)) for field in fields(GemmConfig)[:5]]
    options = [
        f"{field.name}={getattr(config, field.name)!r}"
        for field in fields(GemmConfig)[5:]
        if getattr(config, field.name) != field.default
    ]
    return f"GemmConfig({', '.join(tile + options)})"


class Weight(NamedTuple):
    """One weight shape's operands: packed, dequantized (float32) and as bf16, with a bias."""

    qdata: torch.Tensor
    block_scales: torch.Tensor
    scale: torch.Tensor
    dequantized: torch.Tensor
    bf16: torch.Tensor
    bias: torch.Tensor


def make_weight(K: int, N: int) -> Weight:
    weight = torch.randn(N, K, device="cuda")
    scale = weight.abs().max() / 2688
    qdata, block_scales = quantize_nvfp4(weight, scale)
    dequantized = dequantize_nvfp4(qdata, block_scales)
    bias = torch.randn(N, device="cuda", dtype=torch.bfloat16)
    return Weight(qdata, block_scales, scale, dequantized, dequantized.to(torch.bfloat16), bias)


def tune(weight: Weight, M: int, configs: list) -> tuple[float, Optional[float], list]:
    """bf16's time, the shipped table's (None if wrong) and ``[(ms, error, config)]`` of the
    correct ``configs``, fastest first, at M rows."""
    K = weight.qdata.shape[1] * 2
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    act_scale = x.abs().max().float() / 2688
    output_scale = float(act_scale * weight.scale)
    operand = gemm_activation_operand(x, act_scale)
    in_k_order = operand.float().reshape(M, -1, 2, 8).transpose(-1, -2).reshape(M, K)
    reference = (in_k_order @ weight.dequantized.t()) * (act_scale * weight.scale) + weight.bias.float()
    bf16_ms = graph_ms(lambda: F.linear(x, weight.bf16, weight.bias))

    def run():
        return static_nvfp4_linear(
            x, weight.qdata, weight.block_scales, weight.scale, act_scale, weight.bias, output_scale
        )

    where = f"K={K} N={weight.qdata.shape[0]} M={M}"

    def measure(label):
        try:
            out = run()
        except Exception as error:  # e.g. a tile that needs more shared memory than the GPU has
            print(f"  skip {where} {label}: {type(error).__name__}: {str(error)[:120]}")
            return None
        error = ((out.float() - reference).norm() / reference.norm()).item()
        if not error <= MAX_ERROR:
            print(f"  WRONG {where} {label}: relative error {error:.1e}")
            return None
        return graph_ms(run), error

    use_table(SHIPPED_TABLE)
    table = measure("the shipped table")
    results = []
    for config in configs:
        use_table(((None, config),))
        measured = measure(config)
        if measured is not None:
            results.append((*measured, config))
    use_table(SHIPPED_TABLE)
    results.sort(key=lambda r: r[0])
    return bf16_ms, table[0] if table else None, results


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--m", type=int, nargs="+", default=[1, 16, 64, 512, 4096])
    parser.add_argument("--candidates", choices=["full", "wide", "decode-wide", "programs", "unfilled"], default="full")
    parser.add_argument("--shapes", nargs="+", default=[f"{K}x{N}" for K, N in SHAPES],
                        help="weight shapes as KxN (in_features x out_features)")
    parser.add_argument("--budget-s", type=float, default=None, help="start no M after this many seconds")
    args = parser.parse_args()
    torch.manual_seed(0)
    print(f"device: {torch.cuda.get_device_name()}")
    start = time.monotonic()
    shapes = [tuple(int(size) for size in shape.split("x")) for shape in args.shapes]
    weights = {(K, N): make_weight(K, N) for K, N in shapes}
    summary = []  # (K, N, M, bf16 ms, table ms, [(ms, config), ...] of the correct candidates)
    with torch.no_grad():
        # M by M, every shape for each, so that a budget cuts whole Ms (the later ones).
        for M in args.m:
            if args.budget_s is not None and time.monotonic() - start > args.budget_s:
                print(f"budget spent: M = {M} not run")
                continue
            for (K, N), weight in weights.items():
                bf16_ms, table_ms, results = tune(weight, M, candidates(M, args.candidates))
                for ms, error, config in results[:6]:
                    print(f"K={K:>5} N={N:>5} M={M:>4}  {ms:8.4f} ms  err {error:.1e}  bf16 {bf16_ms:.4f} ms", end="  ")
                    print(describe(config))
                table_ms = float("nan") if table_ms is None else table_ms
                summary.append((K, N, M, bf16_ms, table_ms, [(ms, config) for ms, _, config in results]))
    print(f"\n{time.monotonic() - start:.0f} s")
    print_summary(summary)


def print_summary(summary) -> None:
    """Per (K, N, M): bf16, the shipped table and the best candidate, with bf16 / ours; then per
    M and per bucket the candidate whose slowest case against bf16 is fastest, against the
    table's."""
    print("\nsummary, CUDA-graph ms; ratio = bf16 time / ours (above 1: ours faster)")
    columns = f"{'bf16':>8} {'table':>8} {'best':>8} | {'table x':>7} {'best x':>7}"
    print(f"{'K':>6} {'N':>6} {'M':>5} | {columns} | best config")
    for K, N, M, bf16_ms, table_ms, results in sorted(summary, key=lambda row: row[2]):
        best_ms, best = results[0] if results else (float("nan"), None)
        print(
            f"{K:>6} {N:>6} {M:>5} | {bf16_ms:8.4f} {table_ms:8.4f} {best_ms:8.4f} | "
            f"{bf16_ms / table_ms:7.2f} {bf16_ms / best_ms:7.2f} | {describe(best) if best else '-'}"
        )
    print("\nper M, one config for all shapes: the smallest bf16 / ours over the shapes")
    for M in sorted({row[2] for row in summary}):
        print_one_config_for(f"M={M:>5}", [row for row in summary if row[2] == M])
    print("\nper bucket of the shipped table, one config for its Ms and shapes: the smallest bf16 / ours")
    for bucket in sorted({gemm.gemm_bucket(row[2]) for row in summary}):
        rows = [row for row in summary if gemm.gemm_bucket(row[2]) == bucket]
        if len({row[2] for row in rows}) > 1:
            rows.sort(key=lambda row: row[2])
            print_one_config_for(f"bucket {bucket} (M {', '.join(str(M) for M in sorted({row[2] for row in rows}))})", rows)


def print_one_config_for(label: str, rows: list) -> None:
    """Of the candidates that ran on every row of ``rows`` (summary rows), the one whose smallest
    bf16 / ours is largest, beside the shipped table's smallest; its ratios in the rows' order."""
    table_worst = min(bf16_ms / table_ms for _, _, _, bf16_ms, table_ms, _ in rows)
    ratios: dict = {}
    for _, _, _, bf16_ms, _, results in rows:
        for ms, config in results:
            ratios.setdefault(config, []).append(bf16_ms / ms)
    complete = {config: min(r) for config, r in ratios.items() if len(r) == len(rows)}
    if not complete:
        print(f"{label}  table {table_worst:.2f}x  (no candidate ran on every shape)")
        return
    config = max(complete, key=complete.get)
    each = " / ".join(f"{r:.2f}" for r in ratios[config])
    print(f"{label}  table {table_worst:.2f}x  best {complete[config]:.2f}x ({each})  {describe(config)}")


if __name__ == "__main__":
    main()
