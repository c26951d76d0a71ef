"""The grouped static NVFP4 GEMM of a mixture-of-experts layer against a bf16 grouped matmul.

One Qwen3-30B-A3B-shaped experts layer (128 experts, top-8, hidden 2048, expert intermediate
768), random weights and routing, for several token counts T, in one run on one GPU:

- ``gemm``: the layer's two grouped GEMMs (gate/up ``[1536, 2048]`` and down ``[2048, 768]`` per
  expert) on the same T * 8 expert-sorted rows: ``bf16`` is ``torch.nn.functional.grouped_mm``
  with the bf16 weights (what transformers' ``grouped_mm`` experts run), ``ours`` the op
  ``grouped_static_nvfp4_linear`` (the routed rows quantized once, then the grouped GEMM on the
  packed rows);
- ``layer``: the whole experts forward (routing, both GEMMs, the activation, the weighted sum):
  ``bf16`` transformers' ``Qwen3MoeExperts`` with ``experts_implementation="grouped_mm"``,
  ``ours`` ``NVFP4StaticExperts`` holding the same weights in NVFP4.

Each is timed eagerly (triton.testing.do_bench median, L2 flushed between runs) and replayed
from a CUDA graph (GPU time alone, as a served model runs). ``bf16/ours`` is the speedup of the
graph replays. ``rel err`` is the layer output's relative distance from bf16 (the W4A4
quantization error, about 0.1: a broken kernel gives order 1).

A second table times the whole layer as an eager decode loop runs it, host-bound: 200 calls
back to back, then one synchronize, microseconds per call, the median of 5 interleaved rounds,
for the token counts whose calls are replayed (``experts.eager.MOST_REPLAYED_PAIRS``): bf16,
ours with the routing and the weighted sum as torch ops (as a compiled graph has them), ours
with them as kernels but every call through the forward, and ours as an eager call runs (its
kernels' launches replayed, ``experts.eager``); the three outputs of ours are checked equal
first.

A third table times the layer compiled (``torch.compile(fullgraph=True, dynamic=True)``, Inductor,
one graph per layer for every token count) and replayed from a CUDA graph (ms): bf16, ours with
the routing and the weighted sum traced as torch ops, and ours as a compiled graph has them, the
routing kernels as two opaque ops (``kernels.ops.route_experts``, ``combine_experts``); "diff" is
the relative distance between the two outputs of ours (Inductor may fuse the torch ops' weighted
sum and round it once, where the kernel rounds each add as eager torch does). Run:

    python examples/benchmarks/bench_moe.py [--tokens 1 16 128 1024 4096]
"""

import argparse
import contextlib
import statistics
from unittest import mock

import torch
import torch.nn.functional as F
from bench_compile_guards import ms_per_call
from bench_linear import graph_ms
from triton.testing import do_bench

from nvfp4_static.experts import ExpertsLayout, NVFP4StaticExperts, NVFP4StaticGroupedLinear
from nvfp4_static.experts import routing as experts_routing
from nvfp4_static.experts.eager import MOST_REPLAYED_PAIRS, EagerExpertsLaunches
from nvfp4_static.experts.routing import route
from nvfp4_static.numerics import per_tensor_amax_to_scale, quantize_nvfp4

EXPERTS, TOP_K, HIDDEN, INTERMEDIATE = 128, 8, 2048, 768
# Static activation global amaxes for the random layer: above the largest inputs it sees (about 5
# for the hidden states, a few units for the intermediate), so nothing clips.
HIDDEN_AMAX, INTERMEDIATE_AMAX = 8.0, 16.0
# The bf16 grouped GEMM transformers' grouped_mm experts call (older torch: the private name).
grouped_mm = getattr(F, "grouped_mm", None) or torch._grouped_mm


def nvfp4_grouped(weights: torch.Tensor, act_amax: float) -> NVFP4StaticGroupedLinear:
    """``[E, N, K]`` bf16 weights as NVFP4 (max-based block scales), one static activation
    global amax for every expert."""
    weight_scales = per_tensor_amax_to_scale(weights.float().abs().amax(dim=(1, 2)))
    packed = [quantize_nvfp4(w, s) for w, s in zip(weights, weight_scales)]
    act_scales = per_tensor_amax_to_scale(torch.full((len(weights),), act_amax, device=weights.device))
    return NVFP4StaticGroupedLinear(
        torch.stack([p[0] for p in packed]), torch.stack([p[1] for p in packed]), weight_scales, act_scales
    )


def float_experts():
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    config = Qwen3MoeConfig(
        hidden_size=HIDDEN, moe_intermediate_size=INTERMEDIATE, num_experts=EXPERTS, num_experts_per_tok=TOP_K
    )
    config._experts_implementation = "grouped_mm"
    with torch.device("cuda"):
        experts = Qwen3MoeExperts(config).to(torch.bfloat16)
    with torch.no_grad():
        experts.gate_up_proj.normal_(std=0.02)
        experts.down_proj.normal_(std=0.02)
    return experts


def token_counts(description: str) -> list[int]:
    """The ``--tokens`` this script and ``tune_grouped_gemm.py`` run at, from the command line."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 128, 1024, 4096])
    return parser.parse_args().tokens


def main():
    tokens_to_run = token_counts(__doc__.splitlines()[0])
    torch.manual_seed(0)
    print(f"device: {torch.cuda.get_device_name()}; {EXPERTS} experts, top-{TOP_K}, hidden {HIDDEN}, intermediate {INTERMEDIATE}")
    bf16 = float_experts()
    ours = NVFP4StaticExperts(
        nvfp4_grouped(bf16.gate_up_proj.detach(), HIDDEN_AMAX),
        nvfp4_grouped(bf16.down_proj.detach(), INTERMEDIATE_AMAX),
        bf16.act_fn,
        ExpertsLayout(),
        torch.bfloat16,
        {"act_calibration": "max", "weight_scale": "max"},
        "bench",
    )
    gate_up_t, down_t = bf16.gate_up_proj.detach().transpose(1, 2), bf16.down_proj.detach().transpose(1, 2)
    names = ["gemm bf16", "gemm ours", "gemm bf16 g", "gemm ours g", "layer bf16", "layer ours", "layer bf16 g", "layer ours g"]
    print(f"{'T':>5} | " + " ".join(f"{n:>12}" for n in names) + f" (ms) | {'gemm bf16/ours':>14} {'layer bf16/ours':>15} {'rel err':>8}")
    with torch.no_grad():
        for tokens in tokens_to_run:
            hidden = torch.randn(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16)
            top_k_weights, top_k_index = torch.topk(torch.randn(tokens, EXPERTS, device="cuda").softmax(-1), TOP_K)
            top_k_weights = top_k_weights.to(torch.bfloat16)
            routing = route(top_k_index, EXPERTS)
            rows = hidden[routing.token_of_row]
            ends = routing.expert_offsets[1:].to(torch.int32)
            intermediate = torch.randn(rows.shape[0], INTERMEDIATE, device="cuda", dtype=torch.bfloat16)

            def gemm_bf16():
                grouped_mm(rows, gate_up_t, offs=ends)
                grouped_mm(intermediate, down_t, offs=ends)

            def gemm_ours():
                ours.gate_up_proj(rows, routing.expert_offsets)
                ours.down_proj(intermediate, routing.expert_offsets)

            layer_bf16 = lambda: bf16(hidden, top_k_index, top_k_weights)  # noqa: E731
            layer_ours = lambda: ours(hidden, top_k_index, top_k_weights)  # noqa: E731
            ms = {
                "gemm bf16": do_bench(gemm_bf16, return_mode="median"),
                "gemm ours": do_bench(gemm_ours, return_mode="median"),
                "gemm bf16 g": graph_ms(gemm_bf16),
                "gemm ours g": graph_ms(gemm_ours),
                "layer bf16": do_bench(layer_bf16, return_mode="median"),
                "layer ours": do_bench(layer_ours, return_mode="median"),
                "layer bf16 g": graph_ms(layer_bf16),
                "layer ours g": graph_ms(layer_ours),
            }
            reference = layer_bf16().float()
            rel_err = float((layer_ours().float() - reference).norm() / reference.norm())
            print(
                f"{tokens:>5} | " + " ".join(f"{ms[n]:12.4f}" for n in names) + "      | "
                f"{ms['gemm bf16 g'] / ms['gemm ours g']:14.2f} {ms['layer bf16 g'] / ms['layer ours g']:15.2f} {rel_err:8.3f}"
            )
    print_eager_loop(bf16, ours, [tokens for tokens in tokens_to_run if tokens * TOP_K <= MOST_REPLAYED_PAIRS])
    print_compiled(bf16, ours, tokens_to_run)


EAGER_LOOP_CALLS = 200


def eager_loop_us(layer, hidden, top_k_index, top_k_weights, path: str = "replayed") -> float:
    """Microseconds per call of ``layer`` called ``EAGER_LOOP_CALLS`` times back to back, then
    synchronized: the host time an eager decode loop pays, where it exceeds the GPU's. ``path``
    (ours): ``"torch ops"`` routes and sums with torch ops, ``"forward"`` with the two kernels
    but without the replay, ``"replayed"`` as an eager call runs."""
    with ours_through(path):
        layer(hidden, top_k_index, top_k_weights)
        return 1e3 * ms_per_call(lambda: layer(hidden, top_k_index, top_k_weights), EAGER_LOOP_CALLS, rounds=1)


@contextlib.contextmanager
def ours_through(path: str):
    """Run our experts through ``path`` (``eager_loop_us``) inside the block."""
    with contextlib.ExitStack() as stack:
        if path == "torch ops":
            stack.enter_context(mock.patch.object(experts_routing, "HAS_TRITON", False))
        if path in ("torch ops", "forward"):
            stack.enter_context(mock.patch.object(EagerExpertsLaunches, "parts", lambda self, experts, *inputs: experts))
        yield


def print_eager_loop(bf16, ours, token_counts: list[int], rounds: int = 5) -> None:
    """The eager loop table (module docstring) for ``token_counts``."""
    paths = ("torch ops", "forward", "replayed")
    print(f"\neager loop, us per call | {'T':>5} | {'bf16':>8} " + " ".join(f"{'ours, ' + p:>16}" for p in paths) + " | bf16/ours")
    with torch.no_grad():
        for tokens in token_counts:
            hidden = torch.randn(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16)
            top_k_weights, top_k_index = torch.topk(torch.randn(tokens, EXPERTS, device="cuda").softmax(-1), TOP_K)
            batch = (hidden, top_k_index, top_k_weights.to(torch.bfloat16))
            outputs = []
            for path in paths:
                with ours_through(path):
                    outputs += [ours(*batch), ours(*batch)]  # the replay's first call records
            assert all(torch.equal(out, outputs[0]) for out in outputs), "the paths of ours differ"
            times = [
                (eager_loop_us(bf16, *batch), *(eager_loop_us(ours, *batch, path) for path in paths))
                for _ in range(rounds)
            ]
            bf16_us, *ours_us = (statistics.median(round_[i] for round_ in times) for i in range(1 + len(paths)))
            print(
                f"{'':>23} | {tokens:>5} | {bf16_us:8.1f} " + " ".join(f"{us:16.1f}" for us in ours_us)
                + f" | {bf16_us / ours_us[-1]:9.2f}"
            )


def print_compiled(bf16, ours, token_counts: list[int]) -> None:
    """The compiled table (module docstring) for ``token_counts``."""
    paths = ("bf16", "ours, torch ops", "ours, kernel ops")
    print(f"\ncompiled, ms from a CUDA graph | {'T':>5} | " + " ".join(f"{p:>16}" for p in paths) + " | bf16/ours | diff")
    torch._dynamo.reset()
    compiled = {"bf16": torch.compile(bf16, fullgraph=True, dynamic=True)}
    for path in paths[1:]:
        compiled[path] = torch.compile(ours, fullgraph=True, dynamic=True)
    with torch.no_grad():
        for tokens in token_counts:
            hidden = torch.randn(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16)
            top_k_weights, top_k_index = torch.topk(torch.randn(tokens, EXPERTS, device="cuda").softmax(-1), TOP_K)
            batch = (hidden, top_k_index, top_k_weights.to(torch.bfloat16))
            ms, outputs = {}, {}
            for path in paths:
                # The torch ops' graph is traced (and guarded) with the routing kernels hidden.
                hidden_kernels = mock.patch.object(experts_routing, "HAS_TRITON", path != "ours, torch ops")
                with hidden_kernels:
                    outputs[path] = compiled[path](*batch).float()
                    ms[path] = graph_ms(lambda: compiled[path](*batch))
            a, b = outputs["ours, torch ops"], outputs["ours, kernel ops"]
            diff = float((a - b).norm() / b.norm())
            print(
                f"{'':>30} | {tokens:>5} | " + " ".join(f"{ms[p]:16.4f}" for p in paths)
                + f" | {ms['bf16'] / ms['ours, kernel ops']:9.2f} | {diff:.1e}"
            )


if __name__ == "__main__":
    main()
