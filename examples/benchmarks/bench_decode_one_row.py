"""The decode tile at one row (Hopper): quantizing its row itself against the operand kernel first.

For each weight shape (K x N), GPU times from CUDA graphs (ms) of the whole linear at M = 1
(``static_nvfp4_linear``, bf16 activation with bias), the decode tile forced for every split as
``bench_decode_tile.py`` forces it, in four forms (``FORMS``):

- ``entry``: the table's one-row Triton entry, which quantizes its row in its K loop;
- ``after operand``: the operand kernel, then the decode tile started while it runs;
- ``quantizing``: the decode tile's load warpgroup quantizing the row into each stage's operand
  tile (``gemm.DECODE_TILE_AT_ONE_ROW``): one kernel;
- ``quantizing across``: the same with the K splits summed across programs, each program
  quantizing one split's K tiles, where the program would sum 2 or 4 splits itself.

``read`` is the floor kernel's time (it only reads the packed weight and its scales); ``takes``
the form the table runs (``gemm.decode_tile_for_one_row``). Before timing, the quantizing form's
output is checked equal, bit for bit, to the decode tile's after the operand kernel. Each cell
is the median of ``--rounds`` rounds, the forms interleaved in each. The last columns: the form
the table takes over ``after operand``, and over the read floor.

Usage: python bench_decode_one_row.py [--shapes 8192x8192 ...] [--rounds 3]
"""

import contextlib
import statistics
from unittest import mock

import torch
from bench_decode_tile import hopper_device, linear_ms, shapes_and_rounds_parser, weights_with_read_floor

from nvfp4_static.backends.triton_route import static_nvfp4_linear
from nvfp4_static.kernels import gemm

EVERYWHERE, NOWHERE = 1, 1 << 30  # the decode tile from this many K tiles per split


@contextlib.contextmanager
def one_row_form(tile, splits_across: bool = False):
    """The route at one row taking the decode tile in ``tile``'s form, with its K splits summed
    across programs where ``splits_across``."""
    with mock.patch.object(gemm, "decode_tile_for_one_row", lambda split, K: tile):
        if splits_across:
            with mock.patch.object(gemm.gemm_decode_warp_specialized, "sums_in_program", lambda split_k, K, M: False):
                yield
        else:
            yield


# form: (decode tile from this many K tiles per split, context it runs in)
FORMS = {
    "entry": (NOWHERE, contextlib.nullcontext),
    "after operand": (EVERYWHERE, lambda: one_row_form(gemm.DECODE_TILE)),
    "quantizing": (EVERYWHERE, lambda: one_row_form(gemm.DECODE_TILE_AT_ONE_ROW)),
    "quantizing across": (EVERYWHERE, lambda: one_row_form(gemm.DECODE_TILE_AT_ONE_ROW, splits_across=True)),
}


def form_ms(name: str, x, weight, act_scale) -> float:
    min_k_tiles, context = FORMS[name]
    with context():
        return linear_ms(x, weight, act_scale, min_k_tiles)


def form_output(name: str, x, weight, act_scale) -> torch.Tensor:
    """The linear's output in form ``name``, called eagerly."""
    min_k_tiles, context = FORMS[name]
    rule = dict(DECODE_TILE_MIN_K_TILES=min_k_tiles, DECODE_TILE_MIN_K_TILES_IN_GRAPHS=min_k_tiles)
    output_scale = float(act_scale * weight.scale)
    with context(), mock.patch.multiple(gemm, **rule):
        return static_nvfp4_linear(
            x, weight.qdata, weight.block_scales, weight.scale, act_scale, weight.bias, output_scale
        )


def main():
    shapes = "8192x8192 4096x14336 14336x4096 4096x12288 4096x4096 8192x28672 28672x8192".split()
    args = shapes_and_rounds_parser(__doc__.splitlines()[0], shapes).parse_args()
    device = hopper_device("bench_decode_one_row.py")
    names = list(FORMS)
    print(f"{'K':>6} {'N':>6} | {'read':>7} " + " ".join(f"{name:>17}" for name in names)
          + f" | {'takes':>13} {'takes/after':>11} {'takes/read':>10}")
    for K, N, weight, read in weights_with_read_floor(args.shapes):
        x = torch.randn(1, K, device=device, dtype=torch.bfloat16)
        act_scale = x.abs().max().float() / 2688
        after = form_output("after operand", x, weight, act_scale)
        for name in ("quantizing", "quantizing across"):
            if not torch.equal(form_output(name, x, weight, act_scale), after):
                raise SystemExit(f"{K} x {N}: the decode tile ({name}) differs from it after the operand kernel")
        rounds = [[form_ms(name, x, weight, act_scale) for name in names] for _ in range(args.rounds)]
        ms = dict(zip(names, (statistics.median(column) for column in zip(*rounds))))
        split = gemm.split_k_for(gemm.DECODE_TILE, N, K, device)
        takes = "quantizing" if gemm.decode_tile_for_one_row(split, K) == gemm.DECODE_TILE_AT_ONE_ROW else "after operand"
        print(f"{K:>6} {N:>6} | {read:>7.4f} " + " ".join(f"{ms[name]:>17.4f}" for name in names)
              + f" | {takes:>13} {ms[takes] / ms['after operand']:>11.3f} {ms[takes] / read:>10.3f}", flush=True)


if __name__ == "__main__":
    main()
