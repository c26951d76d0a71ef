"""Held-out perplexity of NVFP4 recipes, ours and our peers', over calibration draws, in one run.

    python examples/compare_recipes.py --device cuda --dtype float32     # with ModelOpt's recipes
    python examples/compare_recipes.py --tie-fused-layers                 # ours tied and untied too
    python examples/compare_recipes.py --draws 2 --draw-sizes 1 --n-eval 4 --recipes torchao,b_min+mse

Rows, every one on the same held-out text as ``quantize_llm.py``'s:
- ``float`` and ``w4a16`` (torchao's ``NVFP4WeightOnlyConfig``), which need no calibration and are
  scored once; ``w4a16+mse`` (our MSE-swept weights, float activations) is calibrated like the
  W4A4 recipes, though its weights do not depend on the data;
- torchao's recipe (``torchao`` = ``max+max``) and ours, named as in ``quantize_llm.py``
  (``<act_calibration>+<weight_scale>``; ``@upstream`` / ``@quantized``: the Hessian gathered in
  a second pass under quantized activations, from each layer's input before / after its own
  quantization), calibrated on every draw; with ``--tie-fused-layers`` each of them also as
  ``<recipe> tied`` (q/k/v and gate/up share their scales, as serving engines need);
- ModelOpt's three NVFP4 W4A4 configs (``modelopt:default``, ``modelopt:mse_fp8_sweep``,
  ``modelopt:local_hessian``) where ``modelopt`` imports and the model is on CUDA (ModelOpt's
  NVFP4 fake quantization runs only there); otherwise they are listed as skipped. ModelOpt's
  weight sweeps give q/k/v and gate/up one weight global amax, as ``tie_fused_layers`` does.

Draw ``i`` of size ``n`` calibrates on sequences ``calib_start + i * n`` onwards: the draws of one
size are disjoint, and all lie before the held-out sequences. For each draw size the table gives,
per recipe, the mean perplexity over the draws and its standard error, the mean paired difference
to the baseline recipe (ModelOpt's local Hessian when it runs, else torchao's) with its standard
error, and the median wall time of quantizing (calibration and convert; the first draw includes
compiling kernels, which the median leaves out).
"""

import argparse
import copy
import math
import statistics
import time
import warnings
from typing import Optional

DEFAULT_DRAW_SIZES = "16,1"
OUR_RECIPES = "torchao,max+mse,b_min+mse,max+hessian_mse,b_min+hessian_mse,b_min+hessian_mse+smooth,max+gptq,b_min+gptq"
MODELOPT_CONFIGS = {
    "modelopt:default": "NVFP4_DEFAULT_CFG",
    "modelopt:mse_fp8_sweep": "NVFP4_W4A4_WEIGHT_MSE_FP8_SWEEP_CFG",
    "modelopt:local_hessian": "NVFP4_W4A4_WEIGHT_LOCAL_HESSIAN_CFG",
}
DEFAULT_RECIPES = ",".join(["w4a16", "w4a16+mse", OUR_RECIPES, *MODELOPT_CONFIGS])
TIED = " tied"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                        help="model dtype")
    parser.add_argument("--recipes", default=DEFAULT_RECIPES,
                        help=f"comma-separated recipes (default: {DEFAULT_RECIPES})")
    parser.add_argument("--draws", type=int, default=4, help="calibration draws of each size")
    parser.add_argument("--draw-sizes", default=DEFAULT_DRAW_SIZES,
                        help="calibration sequences per draw, comma-separated")
    parser.add_argument("--calib-start", type=int, default=0, help="first sequence of the first draw")
    parser.add_argument("--n-eval", type=int, default=16, help="held-out evaluation sequences")
    parser.add_argument("--seq-len", type=int, default=256, help="tokens per sequence")
    parser.add_argument("--batch-size", type=int, default=4, help="sequences per forward")
    parser.add_argument("--tie-fused-layers", action="store_true",
                        help="also score each of our W4A4 recipes with q/k/v and gate/up tied")
    parser.add_argument("--num-layers", type=int, default=None,
                        help="keep only the first N decoder layers (smoke tests)")
    return parser.parse_args(argv)


if __name__ == "__main__":
    parse_args()  # --help and bad arguments answer here, before the imports below (seconds)

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

import quantize_llm  # noqa: E402

BASELINES = ("modelopt:local_hessian", "torchao")


def modelopt_or_why_not(device: str):
    """``modelopt.torch.quantization``, or the reason its recipes are skipped."""
    if device != "cuda":
        return None, f"ModelOpt's NVFP4 fake quantization needs CUDA (device: {device})"
    try:
        with warnings.catch_warnings():  # it warns about the versions it was tested with
            warnings.simplefilter("ignore")
            import modelopt.torch.quantization as mtq
    except ImportError as error:
        return None, f"modelopt does not import ({error})"
    return mtq, None


def modelopt_quantized(mtq, float_model, config_name: str, calib_batches):
    """A copy of ``float_model`` fake-quantized by ModelOpt's ``config_name`` (lm_head, which
    ModelOpt's NVFP4 configs leave alone, stays float as in our recipes)."""
    model = copy.deepcopy(float_model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mtq.quantize(
            model,
            getattr(mtq, config_name),
            forward_loop=lambda m: quantize_llm.calibrate(m, calib_batches, config_name),
        )
    return model


def timed(make_model, device: str):
    start = time.perf_counter()
    model = make_model()
    if device == "cuda":
        torch.cuda.synchronize()
    return model, time.perf_counter() - start


def mean_and_error(values) -> tuple[float, float]:
    """Mean and standard error of the mean (NaN for a single value)."""
    mean = statistics.mean(values)
    error = statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else math.nan
    return mean, error


def summary_table(perplexities: dict, seconds: dict, baseline: Optional[str]) -> str:
    """Per recipe: mean, standard error, paired difference to ``baseline`` and median time.

    ``perplexities[name]`` holds one value per draw (one value for calibration-free rows).
    """
    paired = f"minus {baseline}" if baseline else "paired"
    header = (
        f"{'recipe':<32} {'draws':>5} {'mean ppl':>9} {'se':>6} {paired:>30} {'se':>6} "
        f"{'below':>6} {'median s':>9}"
    )
    lines = [header, "-" * len(header)]
    reference = perplexities.get(baseline)
    for name, values in perplexities.items():
        mean, error = mean_and_error(values)
        row = f"{name:<32} {len(values):>5} {mean:>9.3f} {_number(error, 6)}"
        if reference is not None and name != baseline and len(values) == len(reference) > 1:
            gaps = [value - base for value, base in zip(values, reference)]
            gap, gap_error = mean_and_error(gaps)
            row += f" {gap:>+30.3f} {_number(gap_error, 6)} {sum(g < 0 for g in gaps):>6}"
        else:
            row += f" {'':>30} {'':>6} {'':>6}"
        lines.append(row + f" {_number(statistics.median(seconds[name]), 9, 1)}")
    return "\n".join(lines)


def _number(value: float, width: int, digits: int = 3) -> str:
    return f"{'-':>{width}}" if math.isnan(value) else f"{value:>{width}.{digits}f}"


def main(argv=None) -> None:
    args = parse_args(argv)
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    draw_sizes = [int(size) for size in args.draw_sizes.split(",") if size]
    names = [name for name in args.recipes.split(",") if name]
    ours = {
        name: quantize_llm.parse_recipe(name, {})
        for name in names if name not in MODELOPT_CONFIGS and name != quantize_llm.WEIGHT_ONLY
    }
    peers = [name for name in names if name in MODELOPT_CONFIGS]
    mtq, why_not = modelopt_or_why_not(args.device) if peers else (None, None)

    dtype = getattr(torch, args.dtype)
    tokenizer, float_model = quantize_llm.load_model(dtype, args.device, args.num_layers)
    token_ids = tokenizer(quantize_llm.load_text(None), return_tensors="pt").input_ids[0]
    largest = max(draw_sizes)
    _, held_out = quantize_llm.split_sequences(
        token_ids, args.seq_len, largest, args.n_eval, args.calib_start + (args.draws - 1) * largest
    )
    eval_batches = quantize_llm.batches(held_out, args.batch_size, args.device)
    print(
        f"SmolLM2-135M-Instruct on {args.device} ({dtype}); held-out {args.n_eval} x "
        f"{args.seq_len} tokens; {args.draws} draws of {', '.join(map(str, draw_sizes))} "
        f"calibration sequences from sequence {args.calib_start}"
    )
    if why_not is not None:
        print(f"skipped: {', '.join(peers)}: {why_not}")
        peers = []

    def quantized(name: str, calib_batches):
        if name in MODELOPT_CONFIGS:
            return modelopt_quantized(mtq, float_model, MODELOPT_CONFIGS[name], calib_batches)
        if name == quantize_llm.WEIGHT_ONLY:
            return quantize_llm.quantize(float_model, None, calib_batches, name)
        recipe = name.removesuffix(TIED)
        return quantize_llm.quantize(
            float_model, ours[recipe], calib_batches, recipe, tie=name.endswith(TIED)
        )

    def scored(name: str, calib_batches) -> tuple[float, float]:
        model, seconds = timed(lambda: quantized(name, calib_batches), args.device)
        return quantize_llm.evaluate(model, eval_batches, name)[0], seconds

    float_ppl, _ = quantize_llm.evaluate(float_model, eval_batches, "float")
    calibration_free = {"float": (float_ppl, 0.0)}
    if quantize_llm.WEIGHT_ONLY in names:
        calibration_free[quantize_llm.WEIGHT_ONLY] = scored(quantize_llm.WEIGHT_ONLY, [])
    for name, (ppl, _) in calibration_free.items():
        tqdm.write(f"{name}: perplexity {ppl:.3f}")

    tied = [name + TIED for name, recipe in ours.items() if quantize_llm.is_w4a4(recipe)]
    rows = [*ours, *(tied if args.tie_fused_layers else []), *peers]
    baseline = next((name for name in BASELINES if name in rows), rows[0] if rows else None)
    for size in draw_sizes:
        perplexities = {name: [ppl] for name, (ppl, _) in calibration_free.items()}
        seconds = {name: [elapsed] for name, (_, elapsed) in calibration_free.items()}
        for draw in range(args.draws):
            start = args.calib_start + draw * size
            calib, _ = quantize_llm.split_sequences(
                token_ids, args.seq_len, size, args.n_eval, start
            )
            calib_batches = quantize_llm.batches(calib, args.batch_size, args.device)
            for name in rows:
                ppl, elapsed = scored(name, calib_batches)
                perplexities.setdefault(name, []).append(ppl)
                seconds.setdefault(name, []).append(elapsed)
            tqdm.write(
                f"draw {draw} of {size} (sequences {start}-{start + size - 1}): "
                + ", ".join(f"{name} {perplexities[name][-1]:.3f}" for name in rows)
            )
        print(f"\n{args.draws} draws of {size} calibration sequences:")
        print(summary_table(perplexities, seconds, baseline))


if __name__ == "__main__":
    main()
