"""One rank of test_distributed.py's two-process gloo run: every scenario in turn, in one
process group (a scenario that ends in an error on every rank leaves the group usable, which
is itself the no-deadlock check). Each scenario's result goes to ``OUT/<scenario>.<rank>.pt``.

    python test/distributed_worker.py RANK WORLD_SIZE PORT OUT
"""

import dataclasses
import functools
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from test_experts import tiny_model  # noqa: E402
from test_experts import token_ids as moe_token_ids  # noqa: E402
from tiny_llama import all_but_lm_head, llama_config, tiny_llama, token_ids  # noqa: E402
from torchao.quantization import quantize_  # noqa: E402

from nvfp4_static import (  # noqa: E402
    NVFP4StaticActivationConfig,
    NVFP4StaticObservedLinear,
    data_parallel_convert,
    distributed,
    workflow,
)
from nvfp4_static.data_parallel_convert import convert_data_parallel  # noqa: E402
from nvfp4_static.distributed import (  # noqa: E402
    data_parallel_calibration,
    sync_mse_anchors,
)
from nvfp4_static.layer_mover import LayerMover  # noqa: E402
from nvfp4_static.layerwise import calibrate_layer_by_layer  # noqa: E402
from nvfp4_static.experts import NVFP4StaticExperts  # noqa: E402
from nvfp4_static.linear import NVFP4StaticLinear  # noqa: E402
from nvfp4_static.tensor import host_scale_product  # noqa: E402

ACT_RECIPES = ("b_min", "max", "percentile", "mse")
WEIGHT_RECIPES = ("mse", "hessian_mse")
SHARDS = ([0, 1], [2, 3])  # token_ids seeds of each rank's batches
PROBE = 9  # token_ids seed of the batch whose outputs are compared
# The tiny Qwen3-MoE's shards: batches of 2 x 8 tokens routed by its own routers; with
# MOE_MIN_TOKENS, some experts are starved on one shard but not on the union, some on both
# (test_distributed.py checks this with one-process runs).
MOE_SHARDS = ([0, 1], [2, 3])
MOE_MIN_TOKENS = 12
MOE_RECIPES = (("b_min", "mse"), ("max", "hessian_mse"), ("b_min", "gptq"))


def moe_batch(seed: int) -> torch.Tensor:
    return moe_token_ids(seed, batch=2, length=8)


def converted_scales(model) -> dict:
    """Per converted layer (each grouped linear of converted experts, its experts stacked):
    activation and weight per-tensor scales, packed weight, FP8 block scales (as bytes, for
    bitwise comparison)."""
    tensors = {name: m.weight for name, m in model.named_modules() if isinstance(m, NVFP4StaticLinear)}
    for name, m in model.named_modules():
        if isinstance(m, NVFP4StaticExperts):
            tensors.update({f"{name}.gate_up_proj": m.gate_up_proj, f"{name}.down_proj": m.down_proj})
    return {
        name: (t.act_per_tensor_scale.clone(), t.per_tensor_scale.clone(), t.qdata.clone(),
               t.scale.view(torch.uint8).clone())
        for name, t in tensors.items()
    }


def pooled_experts(model) -> dict:
    """The experts each converted experts module gave the pooled statistics."""
    return {name: m.calibration_stats["pooled_experts"] for name, m in model.named_modules()
            if isinstance(m, NVFP4StaticExperts)}


def quantize_convert(model, config, filter_fn):
    quantize_(model, config, filter_fn=filter_fn)


def data_parallel_run(batches, act, weight, filter_fn=all_but_lm_head, forward=None,
                      convert=quantize_convert, model=None, probe=None, **options):
    """Prepare ``model`` (default the tiny Llama), calibrate this rank's ``batches``
    data-parallel (the MSE protocol: the lowest rank with data runs its first batch, anchors
    shared, then the rest), ``convert``; ``options``: more config fields."""
    forward = forward or (lambda model, batch: model(batch))
    config = dict(act_calibration=act, weight_scale=weight, **options)
    model = model or tiny_llama()
    quantize_(model, NVFP4StaticActivationConfig(step="prepare", **config), filter_fn=filter_fn)
    with torch.no_grad():
        counts = [None] * dist.get_world_size()
        dist.all_gather_object(counts, len(batches))
        first = next(r for r, n in enumerate(counts) if n)
        rest = batches
        if dist.get_rank() == first:
            forward(model, batches[0])
            rest = batches[1:]
        sync_mse_anchors(model)
        with data_parallel_calibration(model):
            for batch in rest:
                forward(model, batch)
    convert(model, NVFP4StaticActivationConfig(step="convert", **config), filter_fn)
    with torch.no_grad():
        logits = model(token_ids(PROBE) if probe is None else probe).logits
    return {"scales": converted_scales(model), "logits": logits, "pooled": pooled_experts(model)}


def synced_states_run(batches) -> dict:
    """``data_parallel_run`` of mse + hessian_mse, with every observer's state (CPU copies, in
    ``_observers`` order) as convert finds them, after the sync."""
    states = []

    def recording_convert(model, config, filter_fn):
        states.extend(None if slot["state"] is None else {k: v.cpu() for k, v in slot["state"].items()}
                      for slot in distributed._snapshot(model))
        quantize_convert(model, config, filter_fn)

    return {**data_parallel_run(batches, "mse", "hessian_mse", convert=recording_convert), "states": states}


def split_convert_run(batches, weight, fail_on_rank=None, filter_fn=all_but_lm_head, model=None,
                      side_task=None) -> dict:
    """``data_parallel_run`` converted by ``convert_data_parallel`` (with ``side_task``), with
    the names of the layers this rank converted and swept, and every layer's calibration
    diagnostics (``fail_on_rank``: that rank's sweeps raise)."""
    swept, converted = [], []
    sweep, convert_one = workflow.sweep_weight_block_scales, data_parallel_convert.converted_linear

    def recorded_sweep(module, config, global_amax):
        if dist.get_rank() == fail_on_rank:
            raise RuntimeError(f"sweep of '{module.layer_name}' failed")
        swept.append(module.layer_name)
        return sweep(module, config, global_amax)

    def recorded_convert(module, config):
        converted.append(module.layer_name)
        return convert_one(module, config)

    data_parallel_convert.sweep_weight_block_scales = workflow.sweep_weight_block_scales = recorded_sweep
    data_parallel_convert.converted_linear = recorded_convert
    model = model or tiny_llama()
    try:
        result = data_parallel_run(batches, "b_min", weight, filter_fn=filter_fn, model=model,
                                   convert=functools.partial(convert_data_parallel, side_task=side_task))
    finally:
        data_parallel_convert.sweep_weight_block_scales = workflow.sweep_weight_block_scales = sweep
        data_parallel_convert.converted_linear = convert_one
    linears = [m for m in model.modules() if isinstance(m, NVFP4StaticLinear)]
    stats = {m.layer_name: m.calibration_stats for m in linears}
    # The host copy of each weight's scale product, against one read from its scales here.
    output_scales_hold = [
        m.weight.output_scale == host_scale_product(m.weight.act_per_tensor_scale, m.weight.per_tensor_scale)
        for m in linears
    ]
    return {**result, "swept": swept, "converted": converted, "stats": stats,
            "output_scales_hold": output_scales_hold}


def moe_run(batches, act, weight, **options) -> dict:
    """``data_parallel_run`` of the tiny Qwen3-MoE converted by ``convert_data_parallel``, with
    the names of the layers whose GPTQ this rank ran."""
    ran_gptq, gptq = [], workflow.gptq_quantize_nvfp4

    def recorded_gptq(weight, hessian, global_amax, **kwargs):
        ran_gptq.append(kwargs["name"])
        return gptq(weight, hessian, global_amax, **kwargs)

    workflow.gptq_quantize_nvfp4 = recorded_gptq
    try:
        result = data_parallel_run(
            batches, act, weight, convert=convert_data_parallel,
            model=tiny_model("qwen3_moe"), probe=moe_batch(PROBE), expert_min_tokens=MOE_MIN_TOKENS,
            **options)
    finally:
        workflow.gptq_quantize_nvfp4 = gptq
    return {**result, "ran_gptq": ran_gptq}


def error_of(fn) -> dict:
    try:
        fn()
    except Exception as error:  # the scenario expects one, the same on every rank
        return {"error": f"{type(error).__name__}: {error}"}
    return {"error": None}


def main(rank: int, world: int, port: int, out: str) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=timedelta(seconds=60),
    )
    mine = [token_ids(seed) for seed in SHARDS[rank]]

    def save(name, result):
        torch.save(result, os.path.join(out, f"{name}.{rank}.pt"))

    for act in ACT_RECIPES:
        for weight in WEIGHT_RECIPES:
            save(f"dp-{act}-{weight}", data_parallel_run(mine, act, weight))

    chunk = distributed._GATHER_CHUNK_BYTES
    save("dp-one-chunk", synced_states_run(mine))
    distributed._GATHER_CHUNK_BYTES = 1008  # some 70 all-gathers, their edges inside states
    try:
        save("dp-chunked", synced_states_run(mine))
    finally:
        distributed._GATHER_CHUNK_BYTES = chunk

    save("no-data", data_parallel_run(mine if rank == 0 else [], "mse", "hessian_mse"))

    for weight in ("max", *WEIGHT_RECIPES):
        save(f"split-convert-{weight}", split_convert_run(mine, weight))
    ran_side_task = []  # rank 1's task weighs more than all the layers: rank 0 converts them all
    side_task = data_parallel_convert.SideTask(1, 10**12, lambda: ran_side_task.append(rank))
    save("split-convert-side-task", {**split_convert_run(mine, "mse", side_task=side_task), "ran": ran_side_task})
    model = tiny_llama()
    failure = error_of(lambda: split_convert_run(mine, "mse", fail_on_rank=1, model=model))
    failure["converted_layers_left"] = sum(isinstance(m, NVFP4StaticLinear) for m in model.modules())
    save("split-convert-failure", failure)

    save("recipe-mismatch", error_of(
        lambda: data_parallel_run(mine, "b_min" if rank == 0 else "percentile", "mse")))

    def skip_down_proj_on_rank_1(module, fqn):
        return all_but_lm_head(module, fqn) and not (rank == 1 and fqn == "model.layers.1.mlp.down_proj")

    save("structure-mismatch", error_of(
        lambda: data_parallel_run(mine, "b_min", "mse", filter_fn=skip_down_proj_on_rank_1)))

    def convert_skips_down_proj_on_rank_1(model, config, filter_fn):
        convert_data_parallel(model, config, skip_down_proj_on_rank_1)

    save("split-convert-mismatch", error_of(
        lambda: data_parallel_run(mine, "b_min", "mse", convert=convert_skips_down_proj_on_rank_1)))

    def sync_twice():
        model = tiny_llama()
        quantize_(model, NVFP4StaticActivationConfig(step="prepare", weight_scale="max"), filter_fn=all_but_lm_head)
        with torch.no_grad(), data_parallel_calibration(model):
            for batch in mine:
                model(batch)
        before = [{k: v.clone() for k, v in slot["state"].items()} for slot in distributed._snapshot(model)]
        result = error_of(lambda: distributed.sync_calibration(model))
        after = [slot["state"] for slot in distributed._snapshot(model)]
        result["unchanged"] = all(torch.equal(a[k], b[k]) for a, b in zip(before, after) for k in a)
        return result

    save("sync-twice", sync_twice())

    def refused_convert(convert):
        """``data_parallel_run`` whose ``convert`` should be refused: the error, and whether
        the model was left without converted layers."""
        model = tiny_llama()
        result = error_of(lambda: data_parallel_run(mine, "b_min", "hessian_mse", model=model, convert=convert))
        result["converted"] = sum(isinstance(m, NVFP4StaticLinear) for m in model.modules())
        return result

    def mse_on_rank_0(model, config, filter_fn):
        convert_data_parallel(model, dataclasses.replace(config, weight_scale=["mse", "hessian_mse"][rank]), filter_fn)

    save("convert-config-mismatch", refused_convert(mse_on_rank_0))

    def other_weight_on_rank_1(model, config, filter_fn):
        if rank == 1:
            with torch.no_grad():
                model.model.layers[1].self_attn.o_proj.weight[3, 5] += 1
        convert_data_parallel(model, config, filter_fn)

    save("convert-weights-mismatch", refused_convert(other_weight_on_rank_1))

    def unsynced():
        model = tiny_llama()
        config = dict(act_calibration="max", weight_scale="max")
        quantize_(model, NVFP4StaticActivationConfig(step="prepare", **config), filter_fn=all_but_lm_head)
        with torch.no_grad():
            for batch in mine:
                model(batch)
        return error_of(lambda: convert_data_parallel(model, NVFP4StaticActivationConfig(**config), all_but_lm_head))

    save("convert-unsynced", unsynced())

    def nan_on_rank_1(model, batch):
        embeds = model.model.embed_tokens(batch)
        if rank == 1:
            embeds[0, 3, 5] = float("nan")
        return model(inputs_embeds=embeds)

    save("nan", error_of(lambda: data_parallel_run(mine, "b_min", "mse", forward=nan_on_rank_1)))

    def layerwise(batches=None, **options):
        options.setdefault("filter_fn", all_but_lm_head)
        config = NVFP4StaticActivationConfig(act_calibration="mse", weight_scale="hessian_mse")
        timings = {}
        model = calibrate_layer_by_layer(tiny_llama(), mine if batches is None else batches, config,
                                         group=True, progress=False, device="cpu", timings=timings,
                                         **options)
        return {"scales": converted_scales(model), "timings": timings}

    save("layerwise-dp", layerwise())
    config = llama_config()
    config.num_hidden_layers = 2 + rank
    save("layerwise-dp-layer-count-mismatch", error_of(lambda: calibrate_layer_by_layer(
        type(tiny_llama())(config), mine, NVFP4StaticActivationConfig(), group=True,
        progress=False, device="cpu", filter_fn=all_but_lm_head)))
    save("layerwise-dp-alpha-mismatch", error_of(lambda: layerwise(smooth_alpha=[0.5, 0.25][rank])))

    all_on_rank_1 = [] if rank == 0 else [token_ids(seed) for shard in SHARDS for seed in shard]
    save("layerwise-dp-rank-0-empty", layerwise(all_on_rank_1))  # rank 1 smooths

    def nan_in_rank_0s_first_batch(model, batch):
        embeds = model.model.embed_tokens(batch)
        if rank == 0 and torch.equal(batch, mine[0]):
            embeds[0, 3, 5] = float("nan")
        return model(inputs_embeds=embeds, use_cache=False)

    save("layerwise-dp-smoothing-nan", error_of(lambda: layerwise(forward=nan_in_rank_0s_first_batch)))
    infinite_norm = tiny_llama()  # smoothed while layer 0 converts
    with torch.no_grad():
        infinite_norm.model.layers[1].post_attention_layernorm.weight[5] = float("inf")
    save("layerwise-dp-smoothing-inf-layer-1", error_of(lambda: calibrate_layer_by_layer(
        infinite_norm, mine, NVFP4StaticActivationConfig(), group=True, progress=False, device="cpu",
        filter_fn=all_but_lm_head)))
    staged = []

    def recording_stage(self, sources):
        """This rank's staged bytes per layer."""
        parts = stage(self, sources)
        staged.append(sum(t.numel() * t.element_size() for t in parts))
        return parts

    def stage_failing_on_rank_1(self, sources):
        if rank == 1:
            raise MemoryError("no pinned memory left")
        return stage(self, sources)

    stage = LayerMover._stage
    try:
        LayerMover._stage = recording_stage
        save("layerwise-dp-prefetch", {**layerwise(prefetch=True), "staged bytes": staged})
        LayerMover._stage = stage_failing_on_rank_1
        save("layerwise-dp-staging-fails", error_of(lambda: layerwise(prefetch=True)))
    finally:
        LayerMover._stage = stage

    moe_mine = [moe_batch(seed) for seed in MOE_SHARDS[rank]]
    for act, weight in MOE_RECIPES:
        save(f"moe-dp-{act}-{weight}", moe_run(moe_mine, act, weight))
    # Rank 0's first batch, 2 tokens, reaches a few experts: the others anchor their MSE grids
    # at a batch of each rank.
    two_tokens_first = [moe_token_ids(PROBE, batch=1, length=2)] * (rank == 0) + moe_mine
    save("moe-dp-mse-anchors", error_of(lambda: moe_run(two_tokens_first, "mse", "mse")))
    moe_layerwise = calibrate_layer_by_layer(
        tiny_model("qwen3_moe"), moe_mine,
        NVFP4StaticActivationConfig(act_calibration="b_min", weight_scale="mse",
                                    expert_min_tokens=MOE_MIN_TOKENS),
        group=True, progress=False, device="cpu")
    save("moe-layerwise-dp", {"scales": converted_scales(moe_layerwise),
                              "pooled": pooled_experts(moe_layerwise)})

    def interrupted_after_layer_0(module, fqn):  # in layer 1's convert, after layer 0 is saved
        if fqn.startswith("model.layers.1.") and isinstance(module, NVFP4StaticObservedLinear):
            raise RuntimeError("interrupted")
        return all_but_lm_head(module, fqn)

    folder = os.path.join(out, "resume")  # one folder: rank 0 writes it, both read it
    save("layerwise-dp-interrupted", error_of(
        lambda: layerwise(resume_dir=folder, filter_fn=interrupted_after_layer_0)))
    save("layerwise-dp-resumed", layerwise(resume_dir=folder))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
