"""A compiled block over changing token counts: how many graphs, how long the first calls take,
and the time per call, for whichever ``nvfp4_static`` is on the path.

Written to compare the tile choice by ``cond`` inside one graph (this package) with one graph
per tile bucket (the package before it): run once as is and once with the older package first
on the path, on the same machine:

    python examples/benchmarks/bench_dynamic_m.py
    git archive 0bed0e6 nvfp4_static | tar -x -C /tmp/per_bucket
    PYTHONPATH=/tmp/per_bucket python examples/benchmarks/bench_dynamic_m.py

The block is ``bench_block.py``'s (Llama-shaped, max-calibrated weights), compiled with
``fullgraph=True`` both with ``dynamic=True`` and in the default mode. ``graphs`` counts dynamo's
graphs after the first call at each of eight token counts from 1 to 300 (each output checked
against the eager block's); ``first calls`` is their wall time, compiles included.
"""

import argparse
import time

import torch

import nvfp4_static
from bench_block import _host_cpu_ms, _python_ms, bf16_and_converted_blocks, decode_or_prefill_input
from bench_linear import graph_ms

WARM_UP_TOKENS = (1, 2, 5, 16, 17, 33, 64, 300)
TIMED_TOKENS = (1, 16, 64)


def main():
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()
    _, quantized = bf16_and_converted_blocks(4096, 32, 14336)
    print(f"device: {torch.cuda.get_device_name()}, package: {nvfp4_static.__file__}")
    print(f"{'mode':>8} {'tokens':>7} {'python ms':>10} {'host cpu ms':>12} {'graph ms':>9}")
    with torch.no_grad():
        for mode, options in [("dynamic", {"dynamic": True}), ("default", {})]:
            torch._dynamo.reset()
            torch._dynamo.utils.counters.clear()
            compiled = torch.compile(quantized, fullgraph=True, **options)
            start = time.perf_counter()
            for tokens in WARM_UP_TOKENS:
                x = decode_or_prefill_input(tokens, 4096)
                out, eager = compiled(x).float(), quantized(x).float()
                # Compiled norms may round differently and flip a few FP4 codes: close, not equal.
                if (out - eager).norm() > 0.1 * eager.norm():
                    raise AssertionError(f"compiled block differs from eager at {tokens} tokens")
            first_calls_s = time.perf_counter() - start
            graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
            print(f"{mode:>8}: {graphs} graphs, first calls at {len(WARM_UP_TOKENS)} token counts {first_calls_s:.1f} s")
            for tokens in TIMED_TOKENS:
                x = decode_or_prefill_input(tokens, 4096)
                times = [timer(lambda: compiled(x)) for timer in (_python_ms, _host_cpu_ms, graph_ms)]
                print(f"{mode:>8} {tokens:>7} {times[0]:>10.4f} {times[1]:>12.4f} {times[2]:>9.4f}")


if __name__ == "__main__":
    main()
