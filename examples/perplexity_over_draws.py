"""Held-out perplexity of torchao's recipe and ``b_min+mse`` over many calibration draws, paired.

    python examples/perplexity_over_draws.py --n-calib 1 --draws 26    # about 25 min on 2 CPU cores
    python examples/perplexity_over_draws.py --n-calib 16 --draws 17   # about 20 min

One run of ``quantize_llm.py`` compares recipes on one calibration draw, and on SmolLM2 the
difference between two W4A4 recipes moves by 0.2-0.3 perplexity from draw to draw (where the FP8
block scales happen to round). This script measures the difference itself: draw ``i`` calibrates
on sequences ``calib_start + i * n_calib`` onwards (disjoint draws, all before the held-out
sequences), and every recipe is scored on the same held-out text as ``quantize_llm.py``'s.

Each draw is one calibration pass of a ``b_min``-prepared model: torchao's recipe takes the
histogram's literal max (the exact ``max |x|``) as its activation global amax, and ``b_min+mse``
reads g_amax from the same histogram at every ``--b-max-percentiles`` value. The MSE weight sweep
does not depend on calibration, so it runs once per layer for all draws. Per draw and recipe the
perplexity equals ``quantize_llm.py``'s with ``--calib-start`` at that draw (a test checks it).

``--propagation RECIPE`` compares something else over the same draws: RECIPE calibrated layer by
layer (``calibrate_layer_by_layer``), each layer fed the float previous layer's outputs, against
the same with ``propagate_quantized=True`` (each layer fed the quantized layer's outputs, as
llm-compressor does):

    python examples/perplexity_over_draws.py --propagation b_min+mse --n-calib 16 --draws 8
"""

import argparse
import copy
import math
import statistics
import warnings


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("``", ""))
    parser.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    parser.add_argument("--n-calib", type=int, default=1, help="calibration sequences per draw")
    parser.add_argument("--draws", type=int, default=8, help="calibration draws")
    parser.add_argument("--calib-start", type=int, default=0, help="first sequence of the first draw")
    parser.add_argument("--n-eval", type=int, default=16, help="held-out evaluation sequences")
    parser.add_argument("--seq-len", type=int, default=256, help="tokens per sequence")
    parser.add_argument("--batch-size", type=int, default=4, help="sequences per forward")
    parser.add_argument("--b-max-percentiles", default="99.99,99.999,100",
                        help="B_max percentiles of the b_min+mse rows (100 = literal max)")
    parser.add_argument("--num-layers", type=int, default=None,
                        help="keep only the first N decoder layers (smoke tests)")
    parser.add_argument("--propagation", metavar="RECIPE", default=None,
                        help="instead, RECIPE (e.g. b_min+mse) layer by layer with and without "
                             "propagate_quantized, paired per draw")
    return parser.parse_args(argv)


if __name__ == "__main__":
    parse_args()  # --help and bad arguments answer here, before the imports below (seconds)

import torch  # noqa: E402
from torchao.quantization import quantize_  # noqa: E402
from tqdm import tqdm  # noqa: E402

import quantize_llm  # noqa: E402
from nvfp4_static import NVFP4StaticActivationConfig, calibrate_layer_by_layer, kernels  # noqa: E402
from nvfp4_static.linear import NVFP4StaticLinear  # noqa: E402
from nvfp4_static.norm_smoothing import DEFAULT_ALPHA  # noqa: E402
from nvfp4_static.observed import NVFP4StaticObservedLinear  # noqa: E402
from nvfp4_static.tensor import NVFP4StaticTensor  # noqa: E402

TORCHAO = "torchao"
# The --propagation rows: each layer calibrated on the float, or the quantized, previous layer's outputs.
FLOAT_INPUTS, QUANTIZED_INPUTS = "float layer inputs", "quantized layer inputs"


def b_min_name(percentile: float) -> str:
    return f"b_min+mse (B_max p{percentile:g})"


def prepared_model(float_model):
    """A copy of ``float_model`` with a ``b_min`` observer on every linear but ``lm_head``."""
    model = copy.deepcopy(float_model)
    quantize_(
        model, NVFP4StaticActivationConfig(step="prepare"), filter_fn=quantize_llm.all_but_lm_head
    )
    return model, {n: m for n, m in model.named_modules() if isinstance(m, NVFP4StaticObservedLinear)}


def mse_block_scales(observed: dict) -> dict:
    """Each layer's FP8 block scales from the 126-candidate sweep, as ``step="convert"`` makes them."""
    scales = {}
    for name, layer in tqdm(observed.items(), desc="MSE weight sweeps", leave=False):
        weight = layer.weight.detach()
        scales[name] = kernels.fp8_scale_sweep(weight, weight.abs().amax().to(torch.float32))
    return scales


def activation_amaxes(observed: dict, b_max_percentiles) -> dict:
    """``{recipe: {layer: g_amax}}`` from the histograms of the last calibration pass."""
    amaxes = {TORCHAO: {}, **{b_min_name(p): {} for p in b_max_percentiles}}
    for name, layer in observed.items():
        calibrator = layer.act_calibrator
        amaxes[TORCHAO][name] = torch.tensor(calibrator.literal_max, dtype=torch.float32)
        for percentile in b_max_percentiles:
            calibrator.b_max_percentile = percentile
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*B_max / B_min")
                amaxes[b_min_name(percentile)][name] = calibrator.compute_amax()
    return amaxes


def converted_model(float_model, observed: dict, amaxes: dict, block_scales, recipe: dict):
    """``float_model`` with each observed linear replaced by its converted layer."""
    model = copy.deepcopy(float_model)
    for name, layer in observed.items():
        weight = NVFP4StaticTensor.from_float(
            layer.weight.detach(), amaxes[name], None if block_scales is None else block_scales[name]
        )
        model.set_submodule(name, NVFP4StaticLinear(weight, layer.bias, recipe, name))
    return model


def summary_table(perplexities: dict, baseline_name: str = TORCHAO) -> str:
    """Mean perplexity per recipe, and its per-draw difference to the baseline's."""
    baseline = perplexities[baseline_name]
    minus = f"minus {baseline_name}"
    header = (
        f"{'recipe':<28} {'mean ppl':>9} {'sd':>6} {minus:>14} {'se':>6} "
        f"{'draws below':>12} {'<= -0.3':>8}"
    )
    lines = [header, "-" * len(header)]
    for name, values in perplexities.items():
        spread = statistics.stdev(values) if len(values) > 1 else float("nan")
        row = f"{name:<28} {statistics.mean(values):>9.3f} {spread:>6.3f}"
        if name != baseline_name:
            gaps = [v - b for v, b in zip(values, baseline)]
            error = statistics.stdev(gaps) / math.sqrt(len(gaps)) if len(gaps) > 1 else float("nan")
            row += (
                f" {statistics.mean(gaps):>+{max(14, len(minus))}.3f} {error:>6.3f} "
                f"{sum(g < 0 for g in gaps):>5} of {len(gaps):<4} {sum(g <= -0.3 for g in gaps):>8}"
            )
        lines.append(row)
    return "\n".join(lines)


def calibration_draws(args, token_ids):
    """``(first sequence, calibration batches)`` of each draw."""
    for draw in range(args.draws):
        start = args.calib_start + draw * args.n_calib
        calib, _ = quantize_llm.split_sequences(token_ids, args.seq_len, args.n_calib, args.n_eval, start)
        yield start, quantize_llm.batches(calib, args.batch_size, args.device)


def report_draw(args, start: int, perplexities: dict) -> None:
    draw, last = (start - args.calib_start) // args.n_calib, start + args.n_calib - 1
    tqdm.write(
        f"draw {draw} (sequences {start}-{last}): "
        + ", ".join(f"{name} {values[-1]:.3f}" for name, values in perplexities.items())
    )


def recipe_perplexities(args, float_model, token_ids, eval_batches) -> dict:
    """Per draw, torchao's recipe and b_min+mse at each B_max percentile, from one calibration pass."""
    b_max_percentiles = [float(p) for p in args.b_max_percentiles.split(",") if p]
    prepared, observed = prepared_model(float_model)
    block_scales = mse_block_scales(observed)
    recipes = {TORCHAO: ({"act_calibration": "max", "weight_scale": "max"}, None)}
    recipes.update(
        {b_min_name(p): ({"act_calibration": "b_min", "weight_scale": "mse"}, block_scales)
         for p in b_max_percentiles}
    )
    perplexities = {name: [] for name in recipes}
    for start, calib_batches in calibration_draws(args, token_ids):
        for layer in observed.values():
            layer.act_calibrator.reset()
        quantize_llm.calibrate(prepared, calib_batches, "calibrate")
        amaxes = activation_amaxes(observed, b_max_percentiles)
        for name, (recipe, scales) in recipes.items():
            model = converted_model(float_model, observed, amaxes[name], scales, recipe)
            ppl, _ = quantize_llm.evaluate(model, eval_batches, name)
            perplexities[name].append(ppl)
        report_draw(args, start, perplexities)
    return perplexities


def propagation_perplexities(args, float_model, token_ids, eval_batches) -> dict:
    """Per draw, ``--propagation``'s recipe calibrated layer by layer with float and with
    quantized layer inputs."""
    recipe = quantize_llm.parse_recipe(args.propagation, {})
    if recipe is None:
        raise SystemExit(f"--propagation {args.propagation}: a weight-only recipe calibrates nothing")
    if recipe.get("hessian_pass"):
        raise SystemExit(f"--propagation {args.propagation}: the layer-by-layer run has no second Hessian pass")
    config = NVFP4StaticActivationConfig(
        **{key: value for key, value in recipe.items() if key not in quantize_llm.EXAMPLE_KEYS})
    smooth_alpha = DEFAULT_ALPHA if recipe.get("smooth") else None  # the recipe's '+smooth'
    perplexities = {FLOAT_INPUTS: [], QUANTIZED_INPUTS: []}
    for start, calib_batches in calibration_draws(args, token_ids):
        for name, propagate in ((FLOAT_INPUTS, False), (QUANTIZED_INPUTS, True)):
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*B_max / B_min")
                model = calibrate_layer_by_layer(
                    copy.deepcopy(float_model), calib_batches, config, device=args.device,
                    filter_fn=quantize_llm.all_but_lm_head, propagate_quantized=propagate,
                    smooth_alpha=smooth_alpha, progress=False,
                )
            ppl, _ = quantize_llm.evaluate(model, eval_batches, name)
            perplexities[name].append(ppl)
        report_draw(args, start, perplexities)
    return perplexities


def main(argv=None) -> None:
    args = parse_args(argv)
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    tokenizer, float_model = quantize_llm.load_model(dtype, args.device, args.num_layers)
    token_ids = tokenizer(quantize_llm.load_text(None), return_tensors="pt").input_ids[0]
    last_start = args.calib_start + (args.draws - 1) * args.n_calib
    _, held_out = quantize_llm.split_sequences(token_ids, args.seq_len, args.n_calib, args.n_eval, last_start)
    eval_batches = quantize_llm.batches(held_out, args.batch_size, args.device)
    if args.propagation:
        perplexities = propagation_perplexities(args, float_model, token_ids, eval_batches)
        baseline, what = FLOAT_INPUTS, f"{args.propagation} calibrated layer by layer, "
    else:
        perplexities = recipe_perplexities(args, float_model, token_ids, eval_batches)
        baseline, what = TORCHAO, ""
    print(
        f"\nSmolLM2-135M-Instruct, {what}{args.draws} draws of {args.n_calib} x {args.seq_len} "
        f"calibration tokens from sequence {args.calib_start}, held-out {args.n_eval} x "
        f"{args.seq_len} tokens:"
    )
    print(summary_table(perplexities, baseline))


if __name__ == "__main__":
    main()
