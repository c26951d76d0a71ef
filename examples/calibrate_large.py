"""Calibrate a random-weight Llama layer by layer, and data-parallel under torchrun.

    python examples/calibrate_large.py                        # small, CPU, about a minute
    python examples/calibrate_large.py --device cuda --preset 8b --dtype bfloat16 \
        --batches 16 --batch-size 4 --seq-len 2048            # one GPU, 131k tokens
    torchrun --nproc-per-node 2 examples/calibrate_large.py   # data-parallel (gloo on CPU, NCCL on CUDA)

The model is built from a Llama config with random weights (on ``--device``, then moved to CPU)
and stays on CPU; one decoder layer at a time moves to ``--device``
(nvfp4_static.calibrate_layer_by_layer). Under torchrun each rank calibrates every WORLD_SIZE-th
batch, the ranks' statistics are synchronised layer by layer and each rank converts a share of
each layer's linears (nvfp4_static.distributed, nvfp4_static.data_parallel_convert). Printed:
the layer-by-layer time, where it went (seconds per phase, a line per rank: recording the first
layer's inputs, moving layers in, smoothing, prepare, calibrate, statistics sync, convert, moving
back; on CUDA each phase waits for the GPU at its end) and peak memory (GPU memory on CUDA,
against the budget one decoder layer's weights + the cached layer inputs + 2 GiB).
On CUDA the next layer is copied in while one calibrates (``--no-prefetch``: plain moves).

Then, in one process (``--check``, the default there and for small models), the same model
calibrated whole on ``--device``: its float forward over the same tokens (the decoder, not
``lm_head``), and its prepare, calibrate and convert times, timed on a model already on the
device; and a check that its scales equal the layer-by-layer ones bit for bit (under torchrun,
one process calibrating the same shards, ``calibrate_in_shards``).
"""

import argparse
import dataclasses
import os
import resource
import time

import torch
import torch.distributed as dist
from torchao.quantization import quantize_
from transformers import LlamaConfig, LlamaForCausalLM

from nvfp4_static import (
    NVFP4StaticActivationConfig,
    calibrate_in_shards,
    calibrate_layer_by_layer,
    is_quantizable,
    smooth_norm_inputs,
)
from nvfp4_static.linear import NVFP4StaticLinear
from nvfp4_static.norm_smoothing import DEFAULT_ALPHA

PRESETS = {
    # hidden, intermediate, layers, heads, kv heads, vocab
    "small": (256, 512, 4, 4, 2, 1024),
    "1b": (2048, 8192, 16, 32, 8, 128256),
    "8b": (4096, 14336, 32, 32, 8, 128256),
}
CHECK_LIMIT = 2e9  # parameters above which a data-parallel run skips the check unless --check
SPARE_GPU_MEMORY = 2 * 2**30  # the layer-by-layer budget's allowance above layer + cached inputs


def build(preset: str, dtype: torch.dtype, device: torch.device, layers=None) -> LlamaForCausalLM:
    """The preset's Llama (``layers`` decoder layers if given) with random weights, initialised
    on ``device`` (fast on a GPU); every rank builds the same weights."""
    hidden, intermediate, preset_layers, heads, kv_heads, vocab = PRESETS[preset]
    layers = layers or preset_layers
    config = LlamaConfig(
        hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=vocab,
        max_position_embeddings=4096,
    )
    torch.manual_seed(0)
    with torch.device(device):
        return LlamaForCausalLM._from_config(config, dtype=dtype).eval()


def start_processes(device: torch.device) -> tuple[torch.device, int, int]:
    """``(device, rank, world size)``. Under torchrun (WORLD_SIZE > 1) the process group starts
    here: NCCL on this rank's GPU (LOCAL_RANK), gloo on CPU."""
    if int(os.environ.get("WORLD_SIZE", "1")) == 1:
        return device, 0, 1
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)  # the communicator is made now, not timed
    else:
        dist.init_process_group("gloo")
    return device, dist.get_rank(), dist.get_world_size()


def token_batches(args, vocab: int, world: int) -> tuple[list, list]:
    """``args.batches`` seeded random token batches, and each rank's shard of them (every
    ``world``-th batch)."""
    generator = torch.Generator().manual_seed(1)
    everything = [torch.randint(0, vocab, (args.batch_size, args.seq_len), generator=generator)
                  for _ in range(args.batches)]
    return everything, [everything[r::world] for r in range(world)]


def not_lm_head(module, fqn):
    return is_quantizable(module, fqn) and fqn != "lm_head"


def decoder_forward(model, batch):
    """The decoder layers' forward, without ``lm_head`` (which stays float): what calibration
    needs, and no logits over a 128k vocabulary."""
    return model.model(batch, use_cache=False)


def scales(model) -> dict:
    return {
        name: (m.weight.act_per_tensor_scale.cpu(), m.weight.per_tensor_scale.cpu(),
               m.weight.qdata.cpu(), m.weight.scale.view(torch.uint8).cpu())
        for name, m in model.named_modules() if isinstance(m, NVFP4StaticLinear)
    }


def timed(fn, device: torch.device) -> float:
    """Seconds ``fn()`` takes, its GPU work included."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def whole_model_run(args, config, shards, device, dtype) -> tuple[dict, dict]:
    """The model calibrated whole on ``device`` on the same shards: its scales, and the seconds
    of its float forward and of each step (one shard: the plain run; several: calibrate_in_shards,
    what the ranks' synchronised statistics equal)."""
    model = build(args.preset, dtype, device)
    batches = [[b.to(device) for b in shard] for shard in shards]

    @torch.no_grad()
    def forward_all():
        for shard in batches:
            for batch in shard:
                decoder_forward(model, batch)

    def calibrate():
        if len(batches) == 1:
            forward_all()
        else:
            calibrate_in_shards(model, batches, forward=decoder_forward)

    seconds = {"float forward": timed(forward_all, device), "smooth": 0.0}
    if args.smooth:  # from the first batch of all, as calibrate_layer_by_layer smooths
        seconds["smooth"] = timed(
            lambda: smooth_norm_inputs(model, lambda m: decoder_forward(m, batches[0][0])), device
        )
    prepare = dataclasses.replace(config, step="prepare")
    seconds["prepare"] = timed(lambda: quantize_(model, prepare, filter_fn=not_lm_head), device)
    seconds["calibrate"] = timed(calibrate, device)
    convert = dataclasses.replace(config, step="convert")
    seconds["convert"] = timed(lambda: quantize_(model, convert, filter_fn=not_lm_head), device)
    return scales(model), seconds


def add_run_arguments(parser: argparse.ArgumentParser, weight: str) -> None:
    """The options that pick the model, the data and the recipe (``--weight`` defaulting to
    ``weight``), which ``main`` and the layer-by-layer profile share."""
    parser.add_argument("--preset", choices=PRESETS, default="small")
    parser.add_argument("--device", default="cpu", help="where each layer is calibrated")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--batches", type=int, default=8, help="calibration batches in all")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--act", default="b_min", help="act_calibration")
    parser.add_argument("--weight", default=weight, help="weight_scale")
    parser.add_argument("--smooth", action=argparse.BooleanOptionalAction, default=True,
                        help="smooth the norms' outputs from the first batch (default; a whole-model "
                             "run calls smooth_norm_inputs before prepare, timed)")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_run_arguments(parser, weight="mse")
    parser.add_argument("--cache-device", default=None, help="where layer inputs wait (default: --device)")
    parser.add_argument("--propagate", action="store_true", help="feed each layer the quantized outputs")
    parser.add_argument("--resume-dir", default=None, help="save finished layers there; resume from it")
    parser.add_argument("--prefetch", action=argparse.BooleanOptionalAction, default=None,
                        help="copy the next layer to the device while one calibrates (default: on CUDA)")
    parser.add_argument("--check", action=argparse.BooleanOptionalAction, default=None,
                        help="also calibrate the whole model on --device: times and a bitwise check "
                             "(default: one process, or a small model)")
    args = parser.parse_args(argv)

    device, rank, world = start_processes(torch.device(args.device))
    distributed = world > 1
    dtype = getattr(torch, args.dtype)
    config = NVFP4StaticActivationConfig(act_calibration=args.act, weight_scale=args.weight)

    model = build(args.preset, dtype, device).to("cpu")
    params = sum(p.numel() for p in model.parameters())
    everything, shards = token_batches(args, model.config.vocab_size, world)

    layer_bytes = sum(p.numel() * p.element_size() for p in model.model.layers[0].parameters())
    if device.type == "cuda":  # untimed: Triton compiles its kernels, cuBLAS starts, on one layer
        calibrate_layer_by_layer(build(args.preset, dtype, device, layers=1), everything[:1], config,
                                 device=device, filter_fn=not_lm_head, progress=False)
        torch.cuda.reset_peak_memory_stats(device)
    if distributed:
        dist.barrier()  # every rank's clock starts together
    timings = {}
    layer_by_layer = timed(lambda: calibrate_layer_by_layer(
        model, shards[rank], config, device=device, cache_device=args.cache_device,
        filter_fn=not_lm_head, propagate_quantized=args.propagate, group=True if distributed else None,
        smooth_alpha=DEFAULT_ALPHA if args.smooth else None,
        resume_dir=args.resume_dir, prefetch=args.prefetch, timings=timings,
    ), device)
    tokens = args.batches * args.batch_size * args.seq_len
    every_rank = [(layer_by_layer, timings)]
    if distributed:  # each rank's phases: where one waits for another
        every_rank = [None] * world
        dist.all_gather_object(every_rank, (layer_by_layer, timings))
    if rank == 0:
        print(f"{args.preset} Llama, {params / 1e6:.0f}M parameters, {world} rank(s), {tokens} tokens "
              f"({args.act}+{args.weight}{'+smooth' if args.smooth else ''}"
              f"{', propagated' if args.propagate else ''}): "
              f"layer by layer in {layer_by_layer:.1f} s")
        for r, (total, phase_seconds) in enumerate(every_rank):
            phases = ", ".join(f"{phase} {seconds:.2f}" for phase, seconds in phase_seconds.items())
            print(f"  where it went (s, rank {r}): {phases}, other {total - sum(phase_seconds.values()):.2f}")
        if device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(device)
            tokens_here = len(shards[rank]) * args.batch_size * args.seq_len
            cached = tokens_here * model.config.hidden_size * dtype.itemsize
            cached_on_gpu = torch.device(args.cache_device or device).type == "cuda"
            budget = layer_bytes + cached * cached_on_gpu + SPARE_GPU_MEMORY
            print(f"peak GPU memory {peak / 2**30:.2f} GiB, budget {budget / 2**30:.2f} GiB = one float "
                  f"decoder layer {layer_bytes / 2**30:.2f} + cached layer inputs "
                  f"{cached / 2**30:.2f}{'' if cached_on_gpu else ' (on the CPU: 0)'} + 2 GiB: "
                  f"{'within' if peak <= budget else 'OVER'}")
        else:
            print(f"peak resident memory {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB")

    check = args.check if args.check is not None else (world == 1 or params <= CHECK_LIMIT)
    if rank == 0 and check and not args.propagate:
        theirs, seconds = whole_model_run(args, config, shards, device, dtype)
        steps = seconds["smooth"] + seconds["prepare"] + seconds["calibrate"] + seconds["convert"]
        smoothing = f"smooth {seconds['smooth']:.2f} s + " if args.smooth else ""
        print(f"whole model on {device.type}: {smoothing}prepare {seconds['prepare']:.2f} s + calibrate "
              f"{seconds['calibrate']:.2f} s + convert {seconds['convert']:.2f} s = {steps:.2f} s; float "
              f"forward over the same tokens {seconds['float forward']:.2f} s: "
              f"{steps / seconds['float forward']:.2f}x the float forward (target <= 2x)")
        if world == 1:
            print(f"layer by layer / whole model: {layer_by_layer / steps:.2f}x (target <= 1.5x)")
        ours = scales(model)
        equal = ours.keys() == theirs.keys() and all(
            torch.equal(a, b) for name in ours for a, b in zip(ours[name], theirs[name]))
        print(f"scales equal to one process calibrating the whole model ({len(ours)} layers): {equal}")
        if not equal:
            raise SystemExit(1)
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
