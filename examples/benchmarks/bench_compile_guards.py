"""Decode under CUDA graphs with and without dynamo's guards on the NVFP4 weights
(``nvfp4_static.skip_nvfp4_weight_guards``), against bf16, in one run.

    python examples/benchmarks/bench_compile_guards.py [--layers 4] [--tokens 1]

The Llama-8B-shaped stack of ``bench_decode.py`` (its layers, conversion and input), compiled
with CUDA graphs each of these ways, one after another, each alone (``torch._dynamo.reset()``
first: stacks of one structure compiled by equal backends would otherwise share dynamo's compiled
entries):

- ``bf16``: the float stack, ``mode="reduce-overhead"``, first and again last (the host's drift);
- ``nvfp4``: the converted stack, ``mode="reduce-overhead"``;
- ``nvfp4, no weight guards``: the same through ``options`` with ``skip_nvfp4_weight_guards``;
- ``nvfp4 unwrapped``: after torchao's ``unwrap_tensor_subclass``, ``mode="reduce-overhead"``;
- ``siblings`` and ``siblings, no weight guards``: after ``fuse_sibling_linears``, through
  ``sibling_gemm_backend("reduce-overhead")``, without and with the filter.

A compiled call costs host time (dynamo's guards, the runtime wrappers, the graph's launch) and
GPU time (the replayed graph), and runs at the slower of the two. Each row gives all three, each
the least of 5 rounds of 100 calls:

- ``host us``: the calls issued while the GPU is kept busy by a sleep kernel, so the host never
  waits for it: the host's time per call alone;
- ``GPU us``: CUDA events around those same calls, which the GPU then runs back to back: its
  time per call alone;
- ``ms per call``: calls issued in a loop, the GPU synchronised after each round;

and the relative difference of the output from the eager converted stack's (a compiled graph
rounds some ops differently, and across the layers that moves activations to other E2M1 codes).
"""

import argparse
import copy
import time

import torch
from torchao.utils import unwrap_tensor_subclass

from bench_decode import DIM, converted, stack
from nvfp4_static import fuse_sibling_linears, sibling_gemm_backend, skip_nvfp4_weight_guards


def ms_per_call(fn, calls: int = 100, rounds: int = 5) -> float:
    """Wall time per call of ``fn`` called in a loop."""
    best = float("inf")
    for _ in range(rounds):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - start) / calls * 1e3)
    return best


def host_and_gpu_us(fn, calls: int = 100, rounds: int = 5) -> tuple[float, float]:
    """Host and GPU time per call of ``fn``, apart: the calls are issued behind a sleep kernel
    long enough that the host issues all of them before the GPU starts the first. Raises where
    the GPU had started them before the host finished (the launch queue full: fewer calls)."""
    host = gpu = float("inf")
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(rounds):
        torch.cuda.synchronize()
        torch.cuda._sleep(1_000_000_000)  # cycles: about half a second, far longer than the calls' issue
        start.record()
        began = time.perf_counter()
        for _ in range(calls):
            fn()
        issued = time.perf_counter()
        if start.query():
            raise RuntimeError(
                f"host_and_gpu_us: the GPU reached the calls before the host had issued all {calls} "
                f"(a full launch queue blocks the host); time fewer calls"
            )
        end.record()
        torch.cuda.synchronize()
        host = min(host, (issued - began) / calls * 1e6)
        gpu = min(gpu, start.elapsed_time(end) / calls * 1e3)
    return host, gpu


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=1, help="tokens per step (sequences decoded together)")
    args = parser.parse_args()
    token = torch.randn(args.tokens, DIM, device="cuda", dtype=torch.bfloat16)
    bf16 = stack(args.layers)
    nvfp4 = converted(bf16)
    siblings = copy.deepcopy(nvfp4)
    fuse_sibling_linears(siblings)
    variants = [
        ("bf16", bf16, dict(mode="reduce-overhead")),
        ("nvfp4", nvfp4, dict(mode="reduce-overhead")),
        ("nvfp4, no weight guards", nvfp4,
         dict(options={"triton.cudagraphs": True, "guard_filter_fn": skip_nvfp4_weight_guards})),
        ("nvfp4 unwrapped", unwrap_tensor_subclass(copy.deepcopy(nvfp4)), dict(mode="reduce-overhead")),
        ("siblings", siblings, dict(backend=sibling_gemm_backend("reduce-overhead"))),
        ("siblings, no weight guards", siblings,
         dict(backend=sibling_gemm_backend("reduce-overhead"), options={"guard_filter_fn": skip_nvfp4_weight_guards})),
        ("bf16 again", bf16, dict(mode="reduce-overhead")),
    ]
    print(f"device: {torch.cuda.get_device_name()}; {args.layers} layers, {args.tokens} token(s) per step")
    print(f"{'stack':<28} {'ms per call':>11} {'host us':>8} {'GPU us':>7} {'compile s':>9} {'vs eager':>9}")
    with torch.no_grad():
        eager = nvfp4(token).float()
        for name, model, how in variants:
            torch._dynamo.reset()
            start = time.perf_counter()
            compiled = torch.compile(model, fullgraph=True, **how)
            for _ in range(3):
                out = compiled(token)
            torch.cuda.synchronize()
            compile_s = time.perf_counter() - start
            # Before the timed calls: CUDA graphs write each call's output where the last one was.
            difference = "" if name.startswith("bf16") else f"{((out.float() - eager).norm() / eager.norm()).item():9.1e}"
            for _ in range(10):
                compiled(token)
            ms = ms_per_call(lambda: compiled(token))
            host, gpu = host_and_gpu_us(lambda: compiled(token))
            print(f"{name:<28} {ms:>11.3f} {host:>8.0f} {gpu:>7.0f} {compile_s:>9.0f} {difference:>9}", flush=True)


if __name__ == "__main__":
    main()
