"""Decode through a Llama-8B-shaped stack of linears: bf16 against NVFP4 static, eager and
compiled, measured in the same run.

    python examples/benchmarks/bench_decode.py [--layers 32] [--compiled-layers 8] [--tokens 1]

One token per step by default; ``--tokens N`` decodes N sequences together (each GEMM then has
N rows, as a serving batch of N has).

Each layer holds Llama-3-8B's seven linears (q, k, v, o 4096 x 4096; gate, up 4096 -> 14336;
down 14336 -> 4096), bf16, with RMS norms and residuals between them and no attention, so the
linears are all the work: what a decode step spends on weights. Rows:

- ``eager``: the model called from Python, as ``model.generate()`` runs without compile.
- ``eager, siblings fused``: the same after ``fuse_sibling_linears``: q/k/v run as one GEMM, and
  gate/up as another.
- ``eager, unwrapped``: the same after torchao's ``unwrap_tensor_subclass`` (below), called
  eagerly: each call rebuilds the weights from their plain tensors.
- ``eager via F.linear``: the same converted layers called through ``F.linear`` and the weight
  subclass's dispatch (the route a compiled graph traces), to show what the layer's direct eager
  call saves.
- ``reduce-overhead``: ``torch.compile(mode="reduce-overhead", fullgraph=True)`` (CUDA graphs)
  on a ``--compiled-layers`` stack, as a serving loop runs it.
- ``reduce-overhead, unwrapped``: the same after torchao's ``unwrap_tensor_subclass`` (each
  weight held as plain tensors, the NVFP4 tensor rebuilt inside the graph), which spares each
  call the guards and unwrapping of 7 weight subclasses per layer.
- ``reduce-overhead, siblings + unwrapped``: the unwrapped stack after ``fuse_sibling_linears``,
  compiled with ``sibling_gemm_backend("reduce-overhead")``, which runs q/k/v and gate/up as one
  GEMM each inside the graph.
- ``compiled, graph replay`` and ``compiled siblings, graph replay``: the default-mode compiled
  stack (the second through ``sibling_gemm_backend()``) captured into a CUDA graph by hand and
  replayed: GPU time alone, whatever the compiled call costs on the host.
- ``compiled each layer, graph replay``: the same with each layer compiled on its own
  (``layer.compile()``, PyTorch's regional compilation: one graph serves every layer, so
  compiling does not grow with depth), NVFP4 with ``skip_nvfp4_weight_guards``, bf16 alike.

Times are medians of ``triton.testing.do_bench``; the host-bound rows (every row but the graph
replay) are measured in ``--rounds`` interleaved rounds, bf16 then NVFP4, and the median round is
shown, so that drift of the host's speed moves both sides alike. Tokens/s counts ``--tokens`` per step. With
``--kernels``, where the GPU time of one step of the compiled stack goes: each kernel's launches
and microseconds per step, from a torch.profiler trace of CUDA-graph replays, for the
default-mode compiled NVFP4 stack (what ``reduce-overhead`` replays), the same with the siblings
merged, and for its layers' own eager launches captured the same way.
"""

import argparse
import collections
import copy
import statistics
import time

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile
from torchao.quantization import quantize_
from torchao.utils import unwrap_tensor_subclass
from triton.testing import do_bench

from bench_linear import captured, graph_ms
from nvfp4_static import (
    NVFP4StaticActivationConfig,
    NVFP4StaticLinear,
    fuse_sibling_linears,
    is_quantizable,
    sibling_gemm_backend,
    skip_nvfp4_weight_guards,
    tie_fused_layers,
)

DIM, HIDDEN = 4096, 14336


class DecoderLinears(torch.nn.Module):
    """One decoder layer's linears: attention projections (their sum stands in for attention)
    and a SwiGLU MLP, each behind an RMS norm and a residual."""

    def __init__(self):
        super().__init__()
        self.norm1, self.norm2 = torch.nn.RMSNorm(DIM), torch.nn.RMSNorm(DIM)
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (
            torch.nn.Linear(DIM, DIM, bias=False) for _ in range(4)
        )
        self.gate_proj = torch.nn.Linear(DIM, HIDDEN, bias=False)
        self.up_proj = torch.nn.Linear(DIM, HIDDEN, bias=False)
        self.down_proj = torch.nn.Linear(HIDDEN, DIM, bias=False)

    def forward(self, x):
        h = self.norm1(x)
        x = x + self.o_proj(self.q_proj(h) + self.k_proj(h) + self.v_proj(h))
        h = self.norm2(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


def stack(layers: int) -> torch.nn.Sequential:
    torch.manual_seed(0)
    with torch.device("cuda"):
        return torch.nn.Sequential(*[DecoderLinears() for _ in range(layers)]).to(torch.bfloat16)


def converted(model: torch.nn.Module) -> torch.nn.Module:
    """A copy quantized by the default recipe, calibrated on 64 random tokens, its q/k/v and
    gate/up tied (``tie_fused_layers``), as a model to be served fused is."""
    quantized = copy.deepcopy(model)
    quantize_(quantized, NVFP4StaticActivationConfig(step="prepare"), filter_fn=is_quantizable)
    with torch.no_grad():
        quantized(torch.randn(64, DIM, device="cuda", dtype=torch.bfloat16))
    tie_fused_layers(quantized)
    quantize_(quantized, NVFP4StaticActivationConfig(step="convert"), filter_fn=is_quantizable)
    return quantized


def each_layer_compiled(model: torch.nn.Sequential, **how) -> torch.nn.Sequential:
    """``model`` with each layer compiled on its own, in place."""
    for layer in model:
        layer.compile(fullgraph=True, **how)
    return model


def through_f_linear(layer: NVFP4StaticLinear, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, layer.weight, layer.bias)


def kernels_per_step(fn, steps: int = 5) -> list[tuple[str, float, float]]:
    """``(kernel, launches, microseconds)`` per call of ``fn`` replayed from a CUDA graph,
    the most time first."""
    graph = captured(fn)
    graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as trace:
        for _ in range(steps):
            graph.replay()
        torch.cuda.synchronize()
    launches, microseconds = collections.Counter(), collections.Counter()
    for event in trace.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            launches[event.name] += 1
            microseconds[event.name] += event.device_time_total
    return [(name, launches[name] / steps, us / steps) for name, us in microseconds.most_common()]


def print_kernels(label: str, kernels: list[tuple[str, float, float]]) -> None:
    total = sum(us for _, _, us in kernels)
    print(f"\n{label}: {total:.1f} us of kernels per step")
    print(f"{'launches':>8} {'us each':>8} {'us':>8} {'share':>6}  kernel")
    for name, count, us in kernels:
        print(f"{count:8.1f} {us / count:8.2f} {us:8.1f} {us / total:6.1%}  {name[:70]}")


def ms_per_step(fn) -> float:
    with torch.no_grad():
        return do_bench(fn, return_mode="median")


def interleaved_ms(fns: list, rounds: int) -> list[float]:
    """``ms_per_step`` of each of ``fns``, taken in turn ``rounds`` times; the median of each."""
    times = [[ms_per_step(fn) for fn in fns] for _ in range(rounds)]
    return [statistics.median(round_[i] for round_ in times) for i in range(len(fns))]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=32, help="layers of the eager stack")
    parser.add_argument("--compiled-layers", type=int, default=8, help="layers compiled (0: skip)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds of the host-bound rows")
    parser.add_argument("--tokens", type=int, default=1, help="tokens per step (sequences decoded together)")
    parser.add_argument("--kernels", action="store_true",
                        help="also list the kernels of one step of the compiled stacks")
    args = parser.parse_args()
    torch._dynamo.config.recompile_limit = 32  # several stacks and backends, one forward code object
    if args.tokens < 1:
        parser.error(f"--tokens must be at least 1, got {args.tokens}")
    token = torch.randn(args.tokens, DIM, device="cuda", dtype=torch.bfloat16)
    rows, kernel_tables = [], []

    bf16 = stack(args.layers)
    start = time.perf_counter()
    nvfp4 = converted(bf16)
    print(f"device: {torch.cuda.get_device_name()}; quantized {args.layers} layers in "
          f"{time.perf_counter() - start:.1f} s (backend {nvfp4[0].q_proj.weight.linear_backend})")
    siblings_fused = copy.deepcopy(nvfp4)
    fuse_sibling_linears(siblings_fused)
    unwrapped = unwrap_tensor_subclass(copy.deepcopy(nvfp4))
    bf16_ms, nvfp4_ms, fused_ms, unwrapped_ms = interleaved_ms(
        [lambda: bf16(token), lambda: nvfp4(token), lambda fused=siblings_fused: fused(token),
         lambda plain=unwrapped: plain(token)],
        args.rounds,
    )
    rows.append(("eager", args.layers, bf16_ms, nvfp4_ms))
    rows.append(("eager, siblings fused", args.layers, bf16_ms, fused_ms))
    rows.append(("eager, unwrapped", args.layers, bf16_ms, unwrapped_ms))
    del siblings_fused, unwrapped
    linears = [m for m in nvfp4.modules() if isinstance(m, NVFP4StaticLinear)]
    for layer in linears:
        layer.forward = through_f_linear.__get__(layer)
    rows.append(("eager via F.linear", args.layers, bf16_ms, ms_per_step(lambda: nvfp4(token))))
    del bf16, nvfp4, linears
    torch.cuda.empty_cache()

    if args.compiled_layers:
        bf16 = stack(args.compiled_layers)
        nvfp4 = converted(bf16)
        # Copies unwrapped (torchao changes the layers it unwraps), compiled beside the others.
        unwrapped = unwrap_tensor_subclass(copy.deepcopy(nvfp4))
        siblings = copy.deepcopy(nvfp4)
        fuse_sibling_linears(siblings)
        siblings_unwrapped = unwrap_tensor_subclass(copy.deepcopy(siblings))
        compiles = [
            (bf16, dict(mode="reduce-overhead")),
            (nvfp4, dict(mode="reduce-overhead")),
            (unwrapped, dict(mode="reduce-overhead")),
            (siblings_unwrapped, dict(backend=sibling_gemm_backend("reduce-overhead"))),
        ]
        overhead_reduced = []
        for model, how in compiles:
            compiled = torch.compile(model, fullgraph=True, **how)
            start = time.perf_counter()
            with torch.no_grad():
                for _ in range(3):
                    compiled(token)
            torch.cuda.synchronize()
            print(f"compiled {type(model[0].q_proj).__name__} stack ({how}) in {time.perf_counter() - start:.0f} s")
            overhead_reduced.append(lambda compiled=compiled: compiled(token).clone())
        default_modes = {
            "bf16": torch.compile(bf16, fullgraph=True),
            "nvfp4": torch.compile(nvfp4, fullgraph=True),
            "nvfp4 siblings": torch.compile(siblings, fullgraph=True, backend=sibling_gemm_backend()),
            "bf16 each layer": each_layer_compiled(copy.deepcopy(bf16)),
            "nvfp4 each layer": each_layer_compiled(
                copy.deepcopy(nvfp4), options={"guard_filter_fn": skip_nvfp4_weight_guards}
            ),
        }
        with torch.no_grad():
            replayed = {name: graph_ms(lambda fn=fn: fn(token)) for name, fn in default_modes.items()}
        if args.kernels:
            with torch.no_grad():
                kernel_tables = [
                    ("default-mode compiled", kernels_per_step(lambda: default_modes["nvfp4"](token))),
                    ("siblings merged", kernels_per_step(lambda: default_modes["nvfp4 siblings"](token))),
                    ("the layers' eager launches", kernels_per_step(lambda: nvfp4(token))),
                ]
        bf16_ms, nvfp4_ms, unwrapped_ms, siblings_ms = interleaved_ms(overhead_reduced, args.rounds)
        rows.append(("reduce-overhead", args.compiled_layers, bf16_ms, nvfp4_ms))
        rows.append(("reduce-overhead, unwrapped", args.compiled_layers, bf16_ms, unwrapped_ms))
        rows.append(("reduce-overhead, siblings + unwrapped", args.compiled_layers, bf16_ms, siblings_ms))
        rows.append(("compiled, graph replay", args.compiled_layers, replayed["bf16"], replayed["nvfp4"]))
        rows.append(
            ("compiled siblings, graph replay", args.compiled_layers, replayed["bf16"], replayed["nvfp4 siblings"])
        )
        rows.append((
            "compiled each layer, graph replay",
            args.compiled_layers,
            replayed["bf16 each layer"],
            replayed["nvfp4 each layer"],
        ))

    print(f"\n{args.tokens} token(s) per step")
    print(f"{'mode':<38} {'layers':>6} {'bf16 ms':>8} {'nvfp4 ms':>9} {'bf16 tok/s':>10} "
          f"{'nvfp4 tok/s':>11} {'speed vs bf16':>13}")
    for mode, layers, bf16_ms, nvfp4_ms in rows:
        print(f"{mode:<38} {layers:>6} {bf16_ms:>8.3f} {nvfp4_ms:>9.3f} {1e3 * args.tokens / bf16_ms:>10.0f} "
              f"{1e3 * args.tokens / nvfp4_ms:>11.0f} {bf16_ms / nvfp4_ms:>12.2f}x")
    for label, kernels in kernel_tables:
        print_kernels(f"nvfp4 {args.compiled_layers} layers, {label}", kernels)


if __name__ == "__main__":
    main()
