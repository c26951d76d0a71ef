"""Eager decode through the Llama-8B-shaped stack with the decode tile taken eagerly from a given
number of K tiles per split: what its host cost does to an eager (host-bound) model.

    python examples/benchmarks/bench_eager_decode_tile.py [--from 6 16] [--tokens 1 4 16] [--layers 8]

``bench_decode.py``'s stack (32 layers of Llama-3-8B's seven linears by default there, ``--layers``
here), converted once, called eagerly with ``--tokens`` rows per step, unfused and with q/k/v and
gate/up fused (``fuse_sibling_linears``). For each threshold of ``--from``, the eager rule
``gemm.DECODE_TILE_MIN_K_TILES`` is set to it and each model's launches recorded anew (a copy of
it), then bf16 and every model are timed in ``--rounds`` interleaved rounds (``do_bench``,
host time included); each cell is the median round's ms per step and its speed against bf16.
The table's own threshold is the default's second value.
"""

import argparse
import copy
import statistics
from unittest import mock

import torch
from bench_decode import DIM, converted, ms_per_step, stack

from nvfp4_static import fuse_sibling_linears
from nvfp4_static.kernels import gemm


def recorded(model: torch.nn.Module, token: torch.Tensor, min_k_tiles: int) -> torch.nn.Module:
    """A copy of ``model`` whose eager launches were recorded with the decode tile taken eagerly
    from ``min_k_tiles`` K tiles per split (a copy records anew; replays keep what was recorded)."""
    copied = copy.deepcopy(model)
    with mock.patch.object(gemm, "DECODE_TILE_MIN_K_TILES", min_k_tiles), torch.no_grad():
        for _ in range(3):
            copied(token)
    torch.cuda.synchronize()
    return copied


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--from", dest="thresholds", type=int, nargs="+", default=[6, gemm.DECODE_TILE_MIN_K_TILES],
                        help="K tiles per split from which eager calls take the decode tile")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (median)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_eager_decode_tile.py needs a CUDA GPU")
    bf16 = stack(args.layers)
    models = {"unfused": converted(bf16)}
    models["fused"] = copy.deepcopy(models["unfused"])
    fuse_sibling_linears(models["fused"])
    print(f"device: {torch.cuda.get_device_name()}; {args.layers} layers, eager, ms per step "
          f"(median of {args.rounds} interleaved rounds) and speed against bf16")
    columns = [(name, k) for name in models for k in args.thresholds]
    print(f"{'tokens':>6} {'bf16':>8} | " + " | ".join(f"{name}, from {k:>2} K tiles" for name, k in columns))
    for tokens in args.tokens:
        token = torch.randn(tokens, DIM, device="cuda", dtype=torch.bfloat16)
        steps = [lambda: bf16(token)] + [
            (lambda model=recorded(models[name], token, k): model(token)) for name, k in columns
        ]
        rounds = [[ms_per_step(step) for step in steps] for _ in range(args.rounds)]
        ms = [statistics.median(column) for column in zip(*rounds)]
        cells = [f"{t:>8.3f} {ms[0] / t:>5.2f}x" for t in ms[1:]]
        print(f"{tokens:>6} {ms[0]:>8.3f} | " + " | ".join(f"{cell:>23}" for cell in cells))


if __name__ == "__main__":
    main()
