"""The routing of a mixture-of-experts layer's token-expert pairs: the route kernel against the
torch ops, from a CUDA graph.

Qwen3-30B-A3B's routing (128 experts, top-8) of random router logits, at several token counts:
the torch ops (``experts.routing.route`` as a compiled graph runs it), the route kernel sorting
every pair in one program (up to 4096 pairs), and the route kernel in chunks of
``ROUTE_CHUNK`` pairs (three launches: count, sum, place); ``takes`` is the form the launcher
picks (``SORTED_IN_ONE_PROGRAM``). The three routings are checked equal first. Each time is
the median GPU time of the routing replayed from a CUDA graph, in microseconds (past
``MAX_ROUTED_PAIRS`` the torch ops alone). Run:

    python examples/benchmarks/bench_route.py [--tokens 1 16 64 128 256 512 1024 4096]
"""

import argparse
from unittest import mock

import torch
from bench_linear import graph_ms

from nvfp4_static.experts import routing as experts_routing
from nvfp4_static.kernels import expert_routing

EXPERTS, TOP_K = 128, 8
# The one-program sort holds every pair's key in registers: at most this many pairs here.
MOST_PAIRS_SORTED_IN_ONE_PROGRAM = 4096


def routed(top_k_index: torch.Tensor, form: str):
    """``route(top_k_index)`` by the torch ops, the kernel in one program, or in chunks."""
    if form == "torch ops":
        with mock.patch.object(experts_routing, "routed_by_kernel", lambda index: False):
            return experts_routing.route(top_k_index, EXPERTS)
    limit = expert_routing.MAX_ROUTED_PAIRS if form == "one program" else 0
    with mock.patch.object(expert_routing, "SORTED_IN_ONE_PROGRAM", limit):
        return experts_routing.route(top_k_index, EXPERTS)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64, 128, 256, 512, 1024, 4096])
    tokens_to_run = parser.parse_args().tokens
    torch.manual_seed(0)
    print(f"device: {torch.cuda.get_device_name()}; {EXPERTS} experts, top-{TOP_K}; us from a CUDA graph")
    forms = ["torch ops", "one program", "in chunks"]
    print(f"{'tokens':>6} {'pairs':>6} | " + " ".join(f"{form:>11}" for form in forms) + f" | {'takes':>11} {'ops / takes':>11}")
    for tokens in tokens_to_run:
        top_k_index = torch.topk(torch.randn(tokens, EXPERTS, device="cuda"), TOP_K).indices
        pairs = top_k_index.numel()
        most_pairs = {
            "torch ops": pairs,
            "one program": MOST_PAIRS_SORTED_IN_ONE_PROGRAM,
            "in chunks": expert_routing.MAX_ROUTED_PAIRS,
        }
        run = [form for form in forms if pairs <= most_pairs[form]]
        expected = tuple(routed(top_k_index, "torch ops"))
        for form in run[1:]:
            got = tuple(routed(top_k_index, form))
            if not all(torch.equal(torch.as_tensor(a), torch.as_tensor(b)) for a, b in zip(got, expected)):
                raise AssertionError(f"{form} routes {tokens} tokens otherwise than the torch ops")
        us = {form: 1000 * graph_ms(lambda form=form: routed(top_k_index, form)) for form in run}
        takes = "one program" if pairs <= expert_routing.SORTED_IN_ONE_PROGRAM else "in chunks"
        takes = takes if pairs <= expert_routing.MAX_ROUTED_PAIRS else "torch ops"
        cells = " ".join(f"{us[form]:>11.1f}" if form in us else f"{'-':>11}" for form in forms)
        print(f"{tokens:>6} {pairs:>6} | {cells} | {takes:>11} {us['torch ops'] / us[takes]:>11.2f}")


if __name__ == "__main__":
    main()
