"""The decode tile's MMA forms (Hopper): the wgmma's N and the parts a K tile is multiplied in.

For each weight shape (K x N) and M, GPU times from CUDA graphs (ms) of the whole linear
(``static_nvfp4_linear``: the operand kernel, then the decode tile, forced for every split as
``bench_decode_tile.py`` forces it) with the decode tile in five forms:

- ``n16 whole``: a 16-column wgmma at every M, each K tile dequantized whole, then multiplied;
- ``n8 whole``: an 8-column wgmma up to 8 rows (``gemm_decode_warp_specialized.tokens_for``);
- ``n16 halves``: each K tile in two parts, the first part's wgmmas issued before the second
  part is dequantized (``gemm_decode_warp_specialized.MMA_CHUNKS``);
- ``n8 halves``: both (what the kernel runs);
- ``n8 quarters``: the 8-column wgmma with each K tile in four parts.

``read`` is the floor kernel's time (it only reads the packed weight and its scales). Before
timing, each form's output is checked equal, bit for bit, to the decode tile's Triton twin's.
Each cell is the median of ``--rounds`` rounds, the forms interleaved in each. The last columns:
the kernel's own form (``KERNEL_FORM``) over ``n16 whole``, and both over the read floor.

Usage: python bench_decode_mma_forms.py [--m 1 4 16] [--shapes 8192x8192 ...] [--rounds 3]
"""

import contextlib
import statistics
from unittest import mock

import torch
from bench_decode_tile import (
    hopper_device,
    linear_ms,
    same_as_the_triton_twin,
    shapes_and_rounds_parser,
    weights_with_read_floor,
)

from nvfp4_static.kernels import gemm_decode_warp_specialized

# form: (wgmma N at every M, or None for the kernel's own rule; parts of a K tile)
FORMS = {
    "n16 whole": (16, 1),
    "n8 whole": (None, 1),
    "n16 halves": (16, 2),
    "n8 halves": (None, 2),
    "n8 quarters": (None, 4),
}
KERNEL_FORM = "n8 halves"


@contextlib.contextmanager
def decode_tile_form(name: str):
    """The decode tile launched in ``FORMS[name]``'s form while the block runs."""
    tokens, parts = FORMS[name]
    rule = gemm_decode_warp_specialized.tokens_for if tokens is None else (lambda M: tokens)
    with mock.patch.object(gemm_decode_warp_specialized, "MMA_CHUNKS", parts), mock.patch.object(
        gemm_decode_warp_specialized, "tokens_for", rule
    ):
        yield


def main():
    shapes = "8192x8192 4096x14336 14336x4096 4096x4096 8192x28672".split()
    parser = shapes_and_rounds_parser(__doc__.splitlines()[0], shapes)
    parser.add_argument("--m", type=int, nargs="+", default=[1, 4, 16])
    args = parser.parse_args()
    device = hopper_device("bench_decode_mma_forms.py")
    names = list(FORMS)
    print(f"{'K':>6} {'N':>6} {'M':>3} {'read':>7} | " + " ".join(f"{name:>11}" for name in names)
          + f" | {'kernel/n16 whole':>16} | {'n16 whole/read':>14} {'kernel/read':>11}")
    for K, N, weight, read in weights_with_read_floor(args.shapes):
        for M in args.m:
            x = torch.randn(M, K, device=device, dtype=torch.bfloat16)
            act_scale = x.abs().max().float() / 2688
            for name in names:
                with decode_tile_form(name):
                    if not same_as_the_triton_twin(x, weight, act_scale):
                        raise SystemExit(f"{K} x {N} at M = {M}: {name}'s output differs from the Triton twin's")
            times = {name: [] for name in names}
            for _ in range(args.rounds):
                for name in names:
                    with decode_tile_form(name):
                        times[name].append(linear_ms(x, weight, act_scale, 1))
            median = {name: statistics.median(column) for name, column in times.items()}
            kernel, before = median[KERNEL_FORM], median[names[0]]
            print(f"{K:>6} {N:>6} {M:>3} {read:>7.4f} | " + " ".join(f"{median[name]:>11.4f}" for name in names)
                  + f" | {kernel / before:>16.3f} | {before / read:>14.2f} {kernel / read:>11.2f}")


if __name__ == "__main__":
    main()
