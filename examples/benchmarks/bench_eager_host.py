"""Where an eager decode step's time goes on the host: microseconds per call of a converted
linear and of its pieces, beside bf16's linear and the decoder layer's other ops, one token.

    python examples/benchmarks/bench_eager_host.py [--rounds 40]

An eager model at decode is host-bound: each op's Python and launch cost more than its kernel.
This script times, on one layer of ``bench_decode.py``'s Llama-8B-shaped stack (q/k/v/o 4096 x
4096, gate/up 4096 -> 14336, down 14336 -> 4096), the host's time per call of each row: a batch
of calls issued after a synchronization and timed without waiting for the GPU, few enough that
the launch queue never fills (so a kernel slower than its launch does not show its GPU time
instead), the median over ``--rounds`` batches. Rows:

- the whole decoder layer, bf16 and NVFP4 (eager), with its GPU time alone (a CUDA graph of
  the same calls);
- a 4096 x 4096 linear: bf16 ``nn.Linear``; ours as a module call, ``forward``, the replay of
  its kernel launches (``backends.triton_eager``: the checks and the output allocation), the
  bare launch through Triton's launcher (``kernels.launch.PreparedLaunch``) and the output's
  ``new_empty`` alone;
- the layer's other ops: ``RMSNorm``, ``x + y``, ``silu``, ``x * y``.

It ends with what ``1.5x bf16's speed`` leaves for each linear: the bf16 layer's time over 1.5,
less the layer's other ops (2 norms, 4 adds, a SiLU and a product), over its 7 linears.
"""

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from bench_decode import DIM, converted, stack
from bench_linear import graph_ms


LAUNCHER = "  Triton launcher, its first launch"


def host_us(fn, calls: int, rounds: int) -> float:
    """Median host microseconds per call of ``fn`` over ``rounds`` batches of ``calls`` calls,
    each batch issued after a synchronization and timed without waiting for the GPU."""
    for _ in range(calls):
        fn()
    per_call = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        per_call.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(per_call)


# Calls per timed batch: at most a few hundred kernel launches queued (a layer makes about 15).
LAYER_CALLS, OP_CALLS = 16, 200


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=40, help="timed batches per row")
    args = parser.parse_args()
    bf16 = stack(1)
    nvfp4 = converted(bf16)
    bf16_layer, layer = bf16[0], nvfp4[0]
    x = torch.randn(1, DIM, device="cuda", dtype=torch.bfloat16)
    y = torch.randn_like(x)

    def us(fn, calls: int = OP_CALLS) -> float:
        return host_us(fn, calls, args.rounds)

    with torch.no_grad():
        linear = layer.q_proj
        linear(x)  # records the launches the replay repeats
        weight, bias = linear._parameters["weight"], linear._parameters["bias"]
        launches = linear._eager_launches
        device = x.get_device()
        stream = torch._C._cuda_getCurrentRawStream(device)
        replayed = launches._linears[(x.shape, x.dtype, device, stream)]
        output = x.new_empty(replayed._out_shape, dtype=replayed._out_dtype)
        first_launch = replayed._launches[0]
        rows = [
            ("bf16 decoder layer", us(lambda: bf16_layer(x), LAYER_CALLS), graph_ms(lambda: bf16_layer(x)) * 1e3),
            ("NVFP4 decoder layer", us(lambda: layer(x), LAYER_CALLS), graph_ms(lambda: layer(x)) * 1e3),
            ("bf16 nn.Linear 4096 x 4096", us(lambda: bf16_layer.q_proj(x)), None),
            ("NVFP4StaticLinear call", us(lambda: linear(x)), None),
            ("  its forward()", us(lambda: linear.forward(x)), None),
            ("  replay of its launches", us(lambda: launches(x, weight, bias)), None),
            (LAUNCHER,
             us(lambda: first_launch(stream, (x, output, *replayed._scratch))), None),
            ("  output new_empty", us(lambda: x.new_empty(replayed._out_shape, dtype=replayed._out_dtype)), None),
            ("RMSNorm", us(lambda: bf16_layer.norm1(x)), None),
            ("x + y", us(lambda: x + y), None),
            ("silu(x)", us(lambda: F.silu(x)), None),
            ("x * y", us(lambda: x * y), None),
        ]
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, one token, median of {args.rounds} batches a row\n")
    print(f"{'call':<34} {'us per call':>11} {'GPU us':>7}")
    for name, host, gpu in rows:
        print(f"{name:<34} {host:11.2f} {'' if gpu is None else f'{gpu:7.1f}':>7}")
    times = {name: host for name, host, _ in rows}
    gpu_times = {name: gpu for name, _, gpu in rows}
    others = 2 * times["RMSNorm"] + 4 * times["x + y"] + times["silu(x)"] + times["x * y"]
    # An eager bf16 layer takes its host time or its GPU time, whichever is longer.
    budget = max(times["bf16 decoder layer"], gpu_times["bf16 decoder layer"]) / 1.5
    print(f"\n1.5x bf16 leaves {budget:.1f} us per layer; its other ops take {others:.1f}, leaving "
          f"{(budget - others) / 7:.2f} us per linear (ours: {times['NVFP4StaticLinear call']:.2f}, "
          f"of which Triton's launcher {times[LAUNCHER]:.2f})")


if __name__ == "__main__":
    main()
