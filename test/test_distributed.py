"""Data-parallel calibration (nvfp4_static.distributed): two gloo processes on 127.0.0.1 against
one process on the same data, and the errors every rank must raise alike.

What is guaranteed, and checked here bit for bit:
- every rank ends with the same scales and outputs;
- they equal ``calibrate_in_shards``: one process calibrating rank r's batches as shard r and
  folding the shards' states in rank order (every recipe);
- they equal the plain one-process run on all the data wherever no float32 sum is involved:
  the activation amaxes of b_min, max and percentile (histogram counts and maxima add up
  exactly), the weight scales of weight_scale="mse" (no data), and so the outputs of those
  recipes combined.
"""

import copy
import os
import re
import socket
import subprocess
import sys
import warnings

import pytest
import torch
from torchao.quantization import quantize_

from distributed_worker import (
    ACT_RECIPES,
    MOE_MIN_TOKENS,
    MOE_RECIPES,
    MOE_SHARDS,
    PROBE,
    SHARDS,
    WEIGHT_RECIPES,
    converted_scales,
    moe_batch,
    pooled_experts,
)
from conftest import DIM, calibration_batches, device_waits, make, prepare, requires_cuda
from models import MLP
from test_experts import tiny_model
from tiny_llama import all_but_lm_head, convert_llama, tiny_llama, token_ids

from nvfp4_static import (
    NVFP4StaticActivationConfig,
    NVFP4StaticLinear,
    NVFP4StaticObservedExperts,
    NVFP4StaticObservedLinear,
    calibrate_layer_by_layer,
    smooth_norm_inputs,
)
from nvfp4_static.data_parallel_convert import _share_out, convert_data_parallel
from nvfp4_static.distributed import _snapshot, calibrate_in_shards, sync_calibration

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "distributed_worker.py")
WORLD = 2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Every scenario of distributed_worker.py, run once by two gloo processes."""
    out = tmp_path_factory.mktemp("dp")
    port = free_port()
    env = {**os.environ, "TQDM_DISABLE": "1", "PYTHONWARNINGS": "ignore"}
    procs = [
        subprocess.Popen([sys.executable, WORKER, str(r), str(WORLD), str(port), str(out)],
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for r in range(WORLD)
    ]
    logs = []
    try:
        for proc in procs:
            logs.append(proc.communicate(timeout=300)[0])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    for rank, (proc, log) in enumerate(zip(procs, logs)):
        assert proc.returncode == 0, f"rank {rank} failed:\n{log[-4000:]}"

    def load(name):
        return [torch.load(out / f"{name}.{r}.pt", weights_only=False) for r in range(WORLD)]

    return load


def batches(seeds):
    return [token_ids(seed) for seed in seeds]


def prepared(act, weight, model=None):
    model = model or tiny_llama()
    config = NVFP4StaticActivationConfig(step="prepare", act_calibration=act, weight_scale=weight)
    quantize_(model, config, filter_fn=all_but_lm_head)
    return model


def finished(model, act, weight):
    convert_llama(model, act_calibration=act, weight_scale=weight)
    with torch.no_grad():
        logits = model(token_ids(PROBE)).logits
    return {"scales": converted_scales(model), "logits": logits}


def union_run(act, weight, seeds):
    model = prepared(act, weight)
    with torch.no_grad():
        for batch in batches(seeds):
            model(batch)
    return finished(model, act, weight)


def shards_run(act, weight, shards, smooth=False):
    """``calibrate_in_shards`` on the tiny Llama; ``smooth``: its norms smoothed first from the
    first batch of all, as ``calibrate_layer_by_layer`` smooths by default."""
    model = tiny_llama()
    if smooth:
        smooth_norm_inputs(model, lambda m: m(token_ids(shards[0][0])))
    model = prepared(act, weight, model)
    calibrate_in_shards(model, [batches(shard) for shard in shards])
    return finished(model, act, weight)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit (``torch.equal`` takes -0.0 for 0.0)."""
    return (a.dtype, a.shape) == (b.dtype, b.shape) and torch.equal(
        a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def assert_same(a: dict, b: dict, parts=("act", "weight"), logits=True) -> None:
    index = {"act": [0], "weight": [1, 2, 3]}
    assert a["scales"].keys() == b["scales"].keys() and len(a["scales"]) == 14
    for name in a["scales"]:
        for part in parts:
            for i in index[part]:
                assert torch.equal(a["scales"][name][i], b["scales"][name][i]), (name, part, i)
    if logits:
        assert torch.equal(a["logits"], b["logits"])


@pytest.mark.parametrize("weight", WEIGHT_RECIPES)
@pytest.mark.parametrize("act", ACT_RECIPES)
def test_two_ranks_equal_one_process_on_the_same_shards(results, act, weight):
    rank0, rank1 = results(f"dp-{act}-{weight}")
    assert_same(rank0, rank1)
    assert_same(rank0, shards_run(act, weight, SHARDS))
    exact_act = act != "mse"  # no float sum behind the activation amax
    exact_weight = weight == "mse"  # no Hessian
    parts = ("act",) * exact_act + ("weight",) * exact_weight
    if parts:
        union = union_run(act, weight, [seed for shard in SHARDS for seed in shard])
        assert_same(rank0, union, parts=parts, logits=exact_act and exact_weight)


def test_states_gathered_in_many_chunks_fold_as_in_one(results):
    for chunked, whole in zip(results("dp-chunked"), results("dp-one-chunk"), strict=True):
        assert_same(chunked, whole)
        assert len(chunked["states"]) == len(whole["states"]) == 28  # an mse search and a Hessian per linear
        for ours, theirs in zip(chunked["states"], whole["states"], strict=True):
            assert ours.keys() == theirs.keys()
            assert all(same_bits(ours[key], theirs[key]) for key in ours)


@pytest.mark.parametrize("weight", ("max", "mse", "hessian_mse"))
def test_ranks_convert_disjoint_shares_and_all_end_with_the_one_process_convert(results, weight):
    rank0, rank1 = results(f"split-convert-{weight}")
    one_process = shards_run("b_min", weight, SHARDS)
    for rank in (rank0, rank1):
        assert rank["scales"].keys() == one_process["scales"].keys()
        for name, parts in rank["scales"].items():
            assert all(same_bits(a, b) for a, b in zip(parts, one_process["scales"][name], strict=True)), name
        assert torch.equal(rank["logits"], one_process["logits"])
    assert rank0["converted"] and rank1["converted"] and set(rank0["converted"]).isdisjoint(rank1["converted"])
    assert sorted(rank0["converted"] + rank1["converted"]) == sorted(rank0["scales"])
    # Each rank sweeps exactly the layers it converts; the others' arrive converted.
    assert [sorted(r["swept"]) for r in (rank0, rank1)] == (
        [[], []] if weight == "max" else [sorted(r["converted"]) for r in (rank0, rank1)])
    # The diagnostics and the host copy of the scale product travel with the converted layers.
    assert rank0["stats"] == rank1["stats"] and all("g_amax" in s for s in rank0["stats"].values())
    assert all(rank0["output_scales_hold"]) and all(rank1["output_scales_hold"])


def test_a_side_task_runs_on_its_rank_whose_share_shrinks_by_its_cost(results):
    rank0, rank1 = results("split-convert-side-task")
    assert (rank0["ran"], rank1["ran"]) == ([], [1])
    assert rank1["converted"] == [] and sorted(rank0["converted"]) == sorted(rank0["scales"])
    one_process = shards_run("b_min", "mse", SHARDS)
    for rank in (rank0, rank1):
        for name, parts in rank["scales"].items():
            assert all(same_bits(a, b) for a, b in zip(parts, one_process["scales"][name], strict=True)), name


def test_shares_go_largest_first_to_the_least_loaded_rank_counting_its_head_start():
    loads = [6, 0]
    assert _share_out([5, 4, 3, 2, 1], loads) == [1, 1, 0, 0, 1]
    assert loads == [11, 10]


def test_a_failed_convert_raises_the_same_error_on_every_rank_and_converts_nothing(results):
    failures = results("split-convert-failure")
    assert failures[0]["error"] == failures[1]["error"]
    assert failures[0]["error"].startswith("RuntimeError: nvfp4_static: data-parallel convert failed on rank 1")
    assert "sweep of 'model.layers." in failures[0]["error"]
    assert [f["converted_layers_left"] for f in failures] == [0, 0]


def test_ranks_converting_different_layers_raise_the_same_error_naming_rank_and_layer(results):
    errors = [r["error"] for r in results("split-convert-mismatch")]
    assert errors[0] == errors[1]
    assert "rank 1" in errors[0] and "'model.layers.1.mlp.down_proj'" in errors[0]


def test_a_rank_without_data_contributes_nothing(results):
    rank0, rank1 = results("no-data")
    assert_same(rank0, rank1)
    assert_same(rank0, union_run("mse", "hessian_mse", SHARDS[0]))


def test_ranks_prepared_with_different_recipes_raise_the_same_error_naming_rank_and_layer(results):
    errors = [r["error"] for r in results("recipe-mismatch")]
    assert errors[0] == errors[1]
    assert "rank 1" in errors[0] and "'model.layers.0.self_attn.q_proj'" in errors[0]
    assert "PercentileCalibrator" in errors[0] and "NVFP4BMinCalibrator" in errors[0]


def test_ranks_with_different_structures_raise_the_same_error_naming_rank_and_layer(results):
    errors = [r["error"] for r in results("structure-mismatch")]
    assert errors[0] == errors[1]
    assert "rank 1" in errors[0] and "'model.layers.1.mlp.down_proj'" in errors[0]


def test_a_second_sync_is_refused_on_every_rank_and_changes_nothing(results):
    """It would add the other ranks' data to the statistics again."""
    for result in results("sync-twice"):
        assert result["error"] == results("sync-twice")[0]["error"] and result["unchanged"]
        assert "'model.layers.0.self_attn.q_proj' was synced already" in result["error"]


@pytest.mark.parametrize(
    "scenario, message",
    [("convert-config-mismatch", "rank 1 converts with weight_scale='hessian_mse', rank 0 with weight_scale='mse'"),
     ("convert-weights-mismatch", "layer 'model.layers.1.self_attn.o_proj' has another weight or bias on rank 1"),
     ("convert-unsynced", r"layer 'model\.layers\.0\.[a-z_.]+' has other act statistics on rank 1 than on "
                          r"rank 0; call sync_calibration\(model\) on every rank")],
)
def test_ranks_that_would_convert_a_mix_of_models_are_refused_alike_before_any_work(results, scenario, message):
    """Each rank would take the others' results for their layers: a mix of recipes or models."""
    errors = [r["error"] for r in results(scenario)]
    assert errors[0] == errors[1] and re.search(message, errors[0])
    assert all(r.get("converted", 0) == 0 for r in results(scenario))


@pytest.mark.parametrize(
    "scenario, message",
    [("layerwise-dp-layer-count-mismatch", "rank 1 has decoder layers 3, rank 0 2"),
     ("layerwise-dp-alpha-mismatch", "rank 1 has smooth_alpha 0.25, rank 0 0.5")],
)
def test_layer_by_layer_ranks_with_other_models_or_settings_are_refused_alike(results, scenario, message):
    errors = [r["error"] for r in results(scenario)]
    assert errors[0] == errors[1] and message in errors[0]


def test_nan_on_one_rank_raises_the_same_error_on_every_rank(results):
    errors = [r["error"] for r in results("nan")]
    assert errors[0] == errors[1]
    assert errors[0].startswith("RuntimeError: nvfp4_static: data-parallel calibration failed on rank 1")
    assert "NaN" in errors[0] and "model.layers.0.self_attn.q_proj" in errors[0]


def test_layer_by_layer_data_parallel_equals_whole_model_shards(results):
    rank0, rank1 = results("layerwise-dp")
    reference = shards_run("mse", "hessian_mse", SHARDS, smooth=True)
    assert_same(rank0, rank1, logits=False)
    assert_same(rank0, reference, logits=False)
    assert {"calibrate", "sync statistics", "convert"} <= rank0["timings"].keys()


def test_layer_by_layer_data_parallel_with_an_empty_rank_0_smooths_on_rank_1_and_equals_one_shard(results):
    rank0, rank1 = results("layerwise-dp-rank-0-empty")
    reference = shards_run("mse", "hessian_mse", [[seed for shard in SHARDS for seed in shard]], smooth=True)
    assert_same(rank0, rank1, logits=False)
    assert_same(rank0, reference, logits=False)


def test_layer_by_layer_data_parallel_with_prefetch_stages_half_of_each_layer_on_each_rank(results):
    rank0, rank1 = results("layerwise-dp-prefetch")
    assert_same(rank0, results("layerwise-dp")[0], logits=False)
    assert_same(rank1, results("layerwise-dp")[1], logits=False)
    layer_bytes = sum(t.numel() * t.element_size() for t in tiny_llama().model.layers[0].state_dict().values())
    tensors = len(tiny_llama().model.layers[0].state_dict())
    for rank in (rank0, rank1):
        assert len(rank["staged bytes"]) == 2  # both layers went through the worker
        # each tensor's share rounds up by at most one byte
        assert all(layer_bytes / WORLD <= staged <= layer_bytes / WORLD + tensors for staged in rank["staged bytes"])


def test_a_rank_failing_to_stage_a_layer_makes_every_rank_raise_naming_it(results):
    errors = [r["error"] for r in results("layerwise-dp-staging-fails")]
    expected = "RuntimeError: nvfp4_static: staging the next layer for the device failed on rank(s) [1]"
    assert errors[0] == expected
    assert errors[1] == expected + ": MemoryError: no pinned memory left"


@pytest.mark.parametrize("scenario, norm", [
    ("layerwise-dp-smoothing-nan", "model.layers.0.input_layernorm"),  # NaN in the first batch
    ("layerwise-dp-smoothing-inf-layer-1", "model.layers.1.post_attention_layernorm"),  # smoothed in layer 0's convert
])
def test_non_finite_smoothing_statistics_make_every_rank_raise_naming_the_norm(results, scenario, norm):
    errors = [r["error"] for r in results(scenario)]
    assert errors[0] == errors[1]
    assert errors[0].startswith("RuntimeError: nvfp4_static: data-parallel norm smoothing failed on rank 0: "
                                "ValueError: nvfp4_static: smooth_norm_inputs: the output of norms "
                                f"{norm}")


def test_layer_by_layer_data_parallel_resumes_from_the_folder_rank_0_wrote(results):
    assert [r["error"] for r in results("layerwise-dp-interrupted")] == ["RuntimeError: interrupted"] * 2
    resumed, uninterrupted = results("layerwise-dp-resumed"), results("layerwise-dp")
    for rank in range(WORLD):
        assert_same(resumed[rank], uninterrupted[rank], logits=False)


# --- mixture of experts: the tiny Qwen3-MoE -------------------------------------------------------


def moe_prepared(act, weight, smooth=False):
    model = tiny_model("qwen3_moe")
    if smooth:  # only q/k/v: gate/up are experts
        smooth_norm_inputs(model, lambda m: m(moe_batch(MOE_SHARDS[0][0])))
    quantize_(model, NVFP4StaticActivationConfig(
        step="prepare", act_calibration=act, weight_scale=weight, expert_min_tokens=MOE_MIN_TOKENS),
        filter_fn=all_but_lm_head)
    return model


def moe_finished(model, act, weight):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the starved experts' warning
        quantize_(model, NVFP4StaticActivationConfig(
            step="convert", act_calibration=act, weight_scale=weight, expert_min_tokens=MOE_MIN_TOKENS),
            filter_fn=all_but_lm_head)
    with torch.no_grad():
        logits = model(moe_batch(PROBE)).logits
    return {"scales": converted_scales(model), "logits": logits, "pooled": pooled_experts(model)}


def moe_tokens_per_expert(seeds) -> list:
    model = moe_prepared("max", "mse")
    with torch.no_grad():
        for seed in seeds:
            model(moe_batch(seed))
    return [m.tokens_per_expert for m in model.modules() if isinstance(m, NVFP4StaticObservedExperts)]


def moe_union_run(act, weight, smooth=False):
    model = moe_prepared(act, weight, smooth)
    with torch.no_grad():
        for seed in [seed for shard in MOE_SHARDS for seed in shard]:
            model(moe_batch(seed))
    return moe_finished(model, act, weight)


def moe_shards_run(act, weight):
    model = moe_prepared(act, weight)
    calibrate_in_shards(model, [[moe_batch(seed) for seed in shard] for shard in MOE_SHARDS])
    return moe_finished(model, act, weight)


def assert_same_moe(a: dict, b: dict, parts=("act", "weight"), logits=True) -> None:
    index = {"act": [0], "weight": [1, 2, 3]}
    assert a["scales"].keys() == b["scales"].keys()
    assert sum(".mlp.experts." in name for name in a["scales"]) == 2 * 2  # gate_up, down per layer
    for name in a["scales"]:
        for part in parts:
            for i in index[part]:
                assert torch.equal(a["scales"][name][i], b["scales"][name][i]), (name, part, i)
    assert a["pooled"] == b["pooled"]
    if logits:
        assert torch.equal(a["logits"], b["logits"])


def test_moe_shards_starve_experts_the_union_does_not_and_the_union_starves_some():
    shards = [moe_tokens_per_expert(shard) for shard in MOE_SHARDS]
    union = moe_tokens_per_expert([seed for shard in MOE_SHARDS for seed in shard])
    assert len(union) == 2  # one experts module per decoder layer
    for layer, counts in enumerate(union):
        assert [a + b for a, b in zip(shards[0][layer], shards[1][layer])] == counts
        assert any(n < MOE_MIN_TOKENS for n in counts), layer
        for shard in shards:
            assert any(n < MOE_MIN_TOKENS <= total for n, total in zip(shard[layer], counts)), layer


@pytest.mark.parametrize("act, weight", MOE_RECIPES, ids=[f"{a}-{w}" for a, w in MOE_RECIPES])
def test_two_ranks_pool_the_experts_one_process_pools_on_all_the_data(results, act, weight):
    rank0, rank1 = results(f"moe-dp-{act}-{weight}")
    assert_same_moe(rank0, rank1)
    assert_same_moe(rank0, moe_shards_run(act, weight))
    union = moe_union_run(act, weight)
    assert rank0["pooled"] == union["pooled"] and all(union["pooled"].values())
    exact_weight = weight == "mse"  # no Hessian: the union's own scales, bit for bit
    assert_same_moe(rank0, union, parts=("act", "weight") if exact_weight else ("act",), logits=exact_weight)


def test_gptq_runs_once_per_layer_split_across_ranks(results):
    ran = [r["ran_gptq"] for r in results("moe-dp-b_min-gptq")]
    expected = {m.layer_name for m in moe_prepared("b_min", "gptq").modules()
                if isinstance(m, NVFP4StaticObservedLinear)}
    assert ran[0] and ran[1] and set(ran[0]).isdisjoint(ran[1])
    assert sorted(ran[0] + ran[1]) == sorted(expected)
    assert any(".experts.gate_up_proj." in name for name in ran[1])


def test_moe_experts_anchored_on_different_ranks_raise_the_same_error_naming_the_expert(results):
    errors = [r["error"] for r in results("moe-dp-mse-anchors")]
    assert errors[0] == errors[1]
    assert errors[0].startswith("ValueError: nvfp4_static: layer 'model.layers.")
    assert ".mlp.experts." in errors[0] and "MSE search grid differs" in errors[0]
    assert "each expert must get tokens in that first batch" in errors[0]


def test_moe_layer_by_layer_data_parallel_equals_the_whole_model_on_all_the_data(results):
    rank0, rank1 = results("moe-layerwise-dp")
    union = moe_union_run("b_min", "mse", smooth=True)
    assert_same_moe(rank0, rank1, logits=False)
    assert_same_moe(rank0, union, logits=False)


# --- in one process ------------------------------------------------------------------------------


def test_one_shard_is_the_plain_run():
    assert_same(shards_run("mse", "hessian_mse", [[0, 1]]), union_run("mse", "hessian_mse", [0, 1]))


def test_shards_fold_the_hessian_as_merge_does():
    name = "model.layers.0.mlp.down_proj"
    folded = prepared("b_min", "hessian_mse")
    calibrate_in_shards(folded, [batches(shard) for shard in SHARDS])
    parts = []
    for shard in SHARDS:
        model = prepared("b_min", "hessian_mse")
        with torch.no_grad():
            for batch in batches(shard):
                model(batch)
        parts.append(model.get_submodule(name).hessian_accumulator)
    parts[0].merge(parts[1])
    accumulator = folded.get_submodule(name).hessian_accumulator
    assert torch.equal(accumulator.hessian, parts[0].hessian)
    assert accumulator.num_tokens == 4 * 4 * 16


@requires_cuda
def test_gpu_sync_waits_for_the_device_as_often_for_one_layer_as_for_the_model_and_keeps_one_ranks_states():
    """Under NCCL the states travel as one tensor per rank and fold on the GPU: the host waits
    only inside all_gather_object (a fixed few), not per state as a host copy of each would; a
    rank alone keeps its states bit for bit."""
    import torch.distributed as dist

    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1,
                            device_id=torch.device("cuda", torch.cuda.current_device()))
    try:
        model = prepared("b_min", "hessian_mse", tiny_llama().cuda())
        with torch.no_grad():
            for batch in batches(SHARDS[0]):
                model(batch.cuda())
        whole = copy.deepcopy(model)  # a model syncs once: one copy syncs a layer, the other all
        before = [{k: v.clone() for k, v in slot["state"].items()} for slot in _snapshot(whole)]
        waits = [device_waits(lambda: sync_calibration(part)) for part in (model.model.layers[0], whole)]
        after = [slot["state"] for slot in _snapshot(whole)]
    finally:
        dist.destroy_process_group()
    assert len(before) == 28 and len(waits[0]) == len(waits[1]), waits  # 14 observers, 28
    for ours, theirs in zip(before, after, strict=True):
        assert all(same_bits(ours[key], theirs[key]) for key in ours)


@requires_cuda
def test_gpu_data_parallel_layer_by_layer_sends_every_layer_home_with_the_one_process_scales():
    """Data-parallel, each next layer moves in during this layer's convert to be smoothed there:
    it still goes home once converted, and the scales are the one-process run's."""
    import torch.distributed as dist

    config = NVFP4StaticActivationConfig(act_calibration="b_min", weight_scale="hessian_mse")
    data = batches(SHARDS[0])

    def run(group):
        return calibrate_layer_by_layer(tiny_llama(), data, config, device="cuda", group=group,
                                        filter_fn=all_but_lm_head, progress=False)

    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1,
                            device_id=torch.device("cuda", torch.cuda.current_device()))
    try:
        ours = run(True)
    finally:
        dist.destroy_process_group()
    one_process = converted_scales(run(None))
    devices = {t.device.type for layer in ours.model.layers for t in [*layer.parameters(), *layer.buffers()]}
    assert devices == {"cpu"}
    scales = converted_scales(ours)
    assert scales.keys() == one_process.keys() and len(scales) == 2 * 7
    for name, parts in scales.items():
        assert all(same_bits(a.cpu(), b.cpu()) for a, b in zip(parts, one_process[name], strict=True)), name


def test_sync_without_a_process_group_says_what_is_missing():
    model = prepared("b_min", "mse")
    with pytest.raises(RuntimeError, match="init_process_group"):
        sync_calibration(model)


@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("layer, key", [("model.layers.1.mlp.down_proj", "hessian"), ("model.layers.0.self_attn.q_proj", "hessian")])
def test_a_fold_that_is_not_finite_is_refused_naming_the_layer_and_changes_no_observer(value, layer, key):
    """What an overflowed sum across ranks would give, put in one rank's state (the check a
    load would make is skipped: the fold checks every state at once)."""
    import torch.distributed as dist

    model = prepared("b_min", "hessian_mse")
    with torch.no_grad():
        for batch in batches(SHARDS[0]):
            model(batch)
    accumulator = model.get_submodule(layer).hessian_accumulator
    accumulator.settle()
    accumulator._state[key][1, 2] = value
    before = [{k: v.clone() for k, v in slot["state"].items()} for slot in _snapshot(model)]
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(ValueError, match=f"layer '{layer}' .*state '{key}'.*no observer's state was changed"):
            sync_calibration(model)
    finally:
        dist.destroy_process_group()
    after = [slot["state"] for slot in _snapshot(model)]
    for ours, theirs in zip(before, after, strict=True):
        assert all(same_bits(ours[k], theirs[k]) for k in ours)


def test_calibrate_in_shards_leaves_an_unseen_layer_unconverted_with_the_usual_error():
    model = prepared("b_min", "mse")
    calibrate_in_shards(model, [[], []])
    with warnings.catch_warnings(), pytest.raises(RuntimeError, match="before any collect"):
        warnings.simplefilter("ignore")
        convert_llama(model, act_calibration="b_min", weight_scale="mse")


def test_data_parallel_convert_shows_a_bar_over_a_share_of_many_layers(capsys):
    import torch.distributed as dist

    def calibrated(model):
        model = prepare(model)
        with torch.no_grad():
            model(calibration_batches(1)[0])
        return model

    many = calibrated(torch.nn.Sequential(*[torch.nn.Linear(DIM, DIM) for _ in range(9)]))
    few = calibrated(make(MLP))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        capsys.readouterr()
        convert_data_parallel(few)
        few_err = capsys.readouterr().err
        convert_data_parallel(many)
        many_err = capsys.readouterr().err
    finally:
        dist.destroy_process_group()
    assert "nvfp4_static convert" not in few_err
    assert "nvfp4_static convert, rank 0's share" in many_err and "9/9" in many_err
    assert sum(isinstance(m, NVFP4StaticLinear) for m in many.modules()) == 9


def test_the_smoothing_rank_s_convert_share_shrinks_with_the_first_batch_s_tokens(monkeypatch):
    """The smoothing of the next layer takes the place of part of a convert share; its forward
    grows with the first batch, so the share it replaces does too."""
    import torch.distributed as dist

    from nvfp4_static import layerwise

    costs = []

    def recording_convert(*args, side_task=None, **kwargs):
        costs.append(side_task and side_task.cost)  # the last layer's convert smooths none
        return convert_data_parallel(*args, side_task=side_task, **kwargs)

    monkeypatch.setattr(layerwise, "convert_data_parallel", recording_convert)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        for batch in (1, 2):
            data = [token_ids(seed, batch=batch) for seed in SHARDS[0]]
            calibrate_layer_by_layer(tiny_llama(), data, NVFP4StaticActivationConfig(), device="cpu",
                                     group=True, filter_fn=all_but_lm_head, progress=False)
    finally:
        dist.destroy_process_group()
    assert costs[1] is None and costs[3] is None  # two layers per run: layer 1 smoothed early
    assert costs[0] > 0 and costs[2] == 2 * costs[0]
