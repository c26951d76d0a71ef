"""``step="prepare"`` on a Llama-8B-shaped stack of linears against plain module swapping.

    python examples/benchmarks/bench_prepare.py                  # meta-device weights: any machine
    python examples/benchmarks/bench_prepare.py --device cuda    # bf16 weights on the GPU (14 GB)

32 layers of Llama-3-8B's seven linears (q 4096 x 4096, k and v 4096 -> 1024, o 4096 x 4096,
gate and up 4096 -> 14336, down 14336 -> 4096): 224 linears. Rows, each the median of
``--repeats`` runs on a fresh stack holding the same weights:

- ``module swap``: every ``nn.Linear`` replaced by a new ``nn.Linear`` holding the same
  parameters, the least any ``quantize_`` module-swapping handler does;
- ``prepare``: ``quantize_(stack, NVFP4StaticActivationConfig(step="prepare"),
  filter_fn=is_quantizable)`` for each ``weight_scale`` that prepares differently (``"mse"``;
  ``"hessian_mse"`` adds a Hessian accumulator per layer).
"""

import argparse
import statistics
import time

import torch
from torchao.quantization import quantize_

from nvfp4_static import NVFP4StaticActivationConfig, is_quantizable

LAYERS = 32
LINEARS = {  # name: (in_features, out_features) of Llama-3-8B's decoder layer
    "q_proj": (4096, 4096), "k_proj": (4096, 1024), "v_proj": (4096, 1024), "o_proj": (4096, 4096),
    "gate_proj": (4096, 14336), "up_proj": (4096, 14336), "down_proj": (14336, 4096),
}


def weights(device: str) -> list[dict]:
    """One dict of bf16 weights per layer (uninitialised: prepare never reads them)."""
    with torch.device(device):
        return [{name: torch.nn.Parameter(torch.empty(out, k, dtype=torch.bfloat16), requires_grad=False)
                 for name, (k, out) in LINEARS.items()} for _ in range(LAYERS)]


def stack(layer_weights: list[dict]) -> torch.nn.Sequential:
    """A fresh stack of ``nn.Linear`` modules holding ``layer_weights`` (no copy)."""
    layers = []
    for held in layer_weights:
        layer = torch.nn.Module()
        for name, weight in held.items():
            with torch.device("meta"):
                linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
            linear.weight = weight
            setattr(layer, name, linear)
        layers.append(layer)
    return torch.nn.Sequential(*layers)


def swap_modules(model: torch.nn.Module) -> None:
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, torch.nn.Linear):
                with torch.device("meta"):
                    new = torch.nn.Linear(child.in_features, child.out_features, bias=False)
                new.weight = child.weight
                setattr(parent, name, new)


def median_seconds(step, layer_weights, repeats: int, device: str) -> float:
    times = []
    for _ in range(repeats):
        model = stack(layer_weights)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        start = time.perf_counter()
        step(model)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="meta", help="where the weights live (meta: nowhere)")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    layer_weights = weights(args.device)
    rows = [("module swap", swap_modules)]
    for weight_scale in ("mse", "hessian_mse"):
        config = NVFP4StaticActivationConfig(step="prepare", weight_scale=weight_scale)
        rows.append((f"prepare, weight_scale={weight_scale!r}",
                     lambda model, config=config: quantize_(model, config, filter_fn=is_quantizable)))
    print(f"{LAYERS * len(LINEARS)} Llama-8B-shaped linears, weights on {args.device}, "
          f"median of {args.repeats}")
    baseline = None
    for what, step in rows:
        seconds = median_seconds(step, layer_weights, args.repeats, args.device)
        baseline = baseline or seconds
        print(f"  {what}: {seconds * 1e3:.1f} ms = {seconds / baseline:.2f}x the module swap")


if __name__ == "__main__":
    main()
