"""How long ``torch.compile`` takes on a converted stack against bf16, compile after compile.

    python examples/benchmarks/bench_compile_time.py [--layers 4] [--compiles 3] [--regional]

The Llama-8B-shaped stack of ``bench_decode.py`` (its layers, conversion and input), bf16 and
converted, each compiled ``--compiles`` times in turn in one process (``torch._dynamo.reset()``
before each, as a serving process that compiles several models or shapes does), default mode,
``fullgraph=True``; each time the first call, which compiles, is timed to its end. With
``--regional`` each layer is compiled on its own instead (``layer.compile()``, PyTorch's
regional compilation): the layers differ in their weights' values only, so one graph serves
them all. Also printed: the graphs dynamo compiled, the entries of torch's Triton kernel side
table after each compile (Inductor walks that global table at every graph it compiles, so it
must not grow with the compiles before), and whether each compiled stack's output equals the
first one of its kind bit for bit.
"""

import argparse
import time

import torch
from torch._dynamo.utils import counters
from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table

from bench_decode import DIM, converted, stack


def compile_seconds(
    model: torch.nn.Sequential, x: torch.Tensor, regional: bool
) -> tuple[float, int, torch.Tensor]:
    """Seconds from ``torch.compile`` (of the stack, or with ``regional`` of each layer) to the
    end of the first call, the graphs dynamo compiled, and that call's output."""
    torch._dynamo.reset()
    graphs_before = counters["stats"]["unique_graphs"]
    torch.cuda.synchronize()
    start = time.perf_counter()
    if regional:
        for layer in model:
            layer.compile(fullgraph=True)
        out = model(x)
    else:
        out = torch.compile(model, fullgraph=True)(x)
    torch.cuda.synchronize()
    return time.perf_counter() - start, counters["stats"]["unique_graphs"] - graphs_before, out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--compiles", type=int, default=3, help="compiles of each stack, in turn")
    parser.add_argument("--tokens", type=int, default=1)
    parser.add_argument("--regional", action="store_true", help="compile each layer on its own")
    args = parser.parse_args()

    bf16 = stack(args.layers)
    models = {"bf16": bf16, "nvfp4": converted(bf16)}
    x = torch.randn(args.tokens, DIM, device="cuda", dtype=torch.bfloat16)
    first = {}
    rows = []
    with torch.no_grad():
        for attempt in range(args.compiles):
            for name, model in models.items():
                seconds, graphs, out = compile_seconds(model, x, args.regional)
                same = torch.equal(out, first.setdefault(name, out))
                rows.append((attempt + 1, name, seconds, graphs, len(kernel_side_table.id_to_kernel), same))
                print(f"compile {attempt + 1} {name}: {seconds:.1f} s", flush=True)

    how = "each layer compiled on its own" if args.regional else "the stack compiled whole"
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}, {args.layers} layers, M = {args.tokens}, {how}")
    print(f"{'compile':>7} {'stack':>6} {'seconds':>8} {'graphs':>6} {'side table':>10} {'same output':>11}")
    for attempt, name, seconds, graphs, entries, same in rows:
        print(f"{attempt:7d} {name:>6} {seconds:8.1f} {graphs:6d} {entries:10d} {str(same):>11}")


if __name__ == "__main__":
    main()
