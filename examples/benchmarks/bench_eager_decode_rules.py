"""Eager decode through the Llama-8B-shaped stack under the tile table's eager rules and with one of
them changed: what each rule's host and GPU cost does to an eager model.

    python examples/benchmarks/bench_eager_decode_rules.py [--rules table decode-from-6 two-launches]
        [--tokens 1 2 4 8 16] [--layers 8] [--rounds 5]

``bench_decode.py``'s stack (``--layers`` layers of Llama-3-8B's seven linears), converted once,
called eagerly with ``--tokens`` rows per step, unfused and with q/k/v and gate/up fused
(``fuse_sibling_linears``). The rules (``--rules``):

- ``table``: the table as it is;
- ``decode-from-6``: eager calls take the decode tile from 6 K tiles per split, as graphs do,
  instead of ``gemm.DECODE_TILE_MIN_K_TILES``;
- ``two-launches``: eager calls of 2-16 rows run the operand kernel and the table's entry, as
  graphs do, instead of quantizing their rows in the GEMM (``gemm.quantizes_eagerly``).

For each rule each model's launches are recorded anew (a copy of it), then bf16 and every model
are timed in ``--rounds`` interleaved rounds (``do_bench``, host time included): each cell the
median round's ms per step, its speed against bf16, and the fastest and slowest rounds (eager
steps are bound by the host, whose speed moves within a run). ``GPU`` is the GPU time of a step
on the same tiles, from a CUDA graph (each rule applied while capturing, captured calls taking
the eager tiles).
"""

import argparse
import contextlib
import copy
import statistics
from unittest import mock

import torch
from bench_decode import DIM, converted, ms_per_step, stack
from bench_linear import graph_ms

from nvfp4_static import fuse_sibling_linears
from nvfp4_static.kernels import gemm

RULES = {
    "table": {},
    "decode-from-6": {"DECODE_TILE_MIN_K_TILES": gemm.DECODE_TILE_MIN_K_TILES_IN_GRAPHS},
    "two-launches": {"EAGER_QUANTIZING_MAX_ROWS": 1},
}


@contextlib.contextmanager
def eager_rule(rule: str, captured_as_eager: bool = False):
    """The table with ``rule`` applied; with ``captured_as_eager`` calls captured into a CUDA graph
    take the eager tiles too."""
    with contextlib.ExitStack() as stack_:
        for name, value in RULES[rule].items():
            stack_.enter_context(mock.patch.object(gemm, name, value))
        if captured_as_eager:
            stack_.enter_context(mock.patch.object(gemm, "captured_into_a_graph", lambda device: False))
        yield


def recorded(model: torch.nn.Module, token: torch.Tensor, rule: str) -> torch.nn.Module:
    """A copy of ``model`` whose eager launches were recorded under ``rule`` (a copy records anew;
    replays keep what was recorded)."""
    copied = copy.deepcopy(model)
    with eager_rule(rule), torch.no_grad():
        for _ in range(3):
            copied(token)
    torch.cuda.synchronize()
    return copied


def gpu_ms(model: torch.nn.Module, token: torch.Tensor, rule: str) -> float:
    """GPU ms of one step of a fresh copy of ``model`` on ``rule``'s eager tiles, from a CUDA graph."""
    copied = copy.deepcopy(model)
    with eager_rule(rule, captured_as_eager=True), torch.no_grad():
        return graph_ms(lambda: copied(token))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rules", nargs="+", choices=list(RULES), default=list(RULES))
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (median)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_eager_decode_rules.py needs a CUDA GPU")
    bf16 = stack(args.layers)
    models = {"unfused": converted(bf16)}
    models["fused"] = copy.deepcopy(models["unfused"])
    fuse_sibling_linears(models["fused"])
    print(f"device: {torch.cuda.get_device_name()}; {args.layers} layers, eager, ms per step (median of "
          f"{args.rounds} interleaved rounds [fastest-slowest]), speed against bf16, GPU ms per step")
    columns = [(name, rule) for name in models for rule in args.rules]
    for tokens in args.tokens:
        token = torch.randn(tokens, DIM, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            bf16_gpu = graph_ms(lambda: bf16(token))
        steps = [lambda: bf16(token)] + [
            (lambda model=recorded(models[name], token, rule): model(token)) for name, rule in columns
        ]
        gpu = [bf16_gpu] + [gpu_ms(models[name], token, rule) for name, rule in columns]
        rounds = [[ms_per_step(step) for step in steps] for _ in range(args.rounds)]
        bf16_ms = statistics.median(round_[0] for round_ in rounds)
        print(f"\n{tokens} token(s) per step")
        print(f"{'model':<8} {'rule':<14} {'ms':>7} {'rounds':>15} {'vs bf16':>7} {'GPU ms':>7}")
        for (name, rule), times, gpu_time in zip([("bf16", "")] + columns, zip(*rounds), gpu):
            ms = statistics.median(times)
            print(f"{name:<8} {rule:<14} {ms:>7.3f} [{min(times):.3f}-{max(times):.3f}] "
                  f"{bf16_ms / ms:>6.2f}x {gpu_time:>7.3f}")


if __name__ == "__main__":
    main()
