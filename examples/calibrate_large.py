"""Calibrate a random-weight Llama layer by layer, and data-parallel under torchrun.

    python examples/calibrate_large.py                        # small, CPU, about a minute
    python examples/calibrate_large.py --device cuda --preset 8b --cache-device cpu
    torchrun --nproc-per-node 2 examples/calibrate_large.py   # data-parallel (gloo on CPU, NCCL on CUDA)

The model is built from a Llama config with random weights and stays on CPU; one decoder layer
at a time moves to ``--device`` (nvfp4_static.calibrate_layer_by_layer). Under torchrun each
rank calibrates every WORLD_SIZE-th batch and the ranks' statistics are synchronised layer by
layer (nvfp4_static.distributed). The script prints the time, the peak memory (GPU memory on
CUDA) and, unless the model is too large (``--check`` forces it), checks that the scales equal
one process calibrating the whole model on the same data split into the same shards
(``calibrate_in_shards``; with one rank, the plain whole-model run).
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
)
from nvfp4_static.linear import NVFP4StaticLinear

PRESETS = {
    # hidden, intermediate, layers, heads, kv heads, vocab
    "small": (256, 512, 4, 4, 2, 1024),
    "1b": (2048, 8192, 16, 32, 8, 128256),
    "8b": (4096, 14336, 32, 32, 8, 128256),
}
CHECK_LIMIT = 2e9  # parameters above which the whole-model check is skipped unless --check


def build(preset: str, dtype: torch.dtype) -> LlamaForCausalLM:
    hidden, intermediate, layers, heads, kv_heads, vocab = PRESETS[preset]
    config = LlamaConfig(
        hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=vocab,
        max_position_embeddings=4096,
    )
    torch.manual_seed(0)  # every rank builds the same weights
    return LlamaForCausalLM._from_config(config, dtype=dtype).eval()


def not_lm_head(module, fqn):
    return is_quantizable(module, fqn) and fqn != "lm_head"


def scales(model) -> dict:
    return {
        name: (m.weight.act_per_tensor_scale.cpu(), m.weight.per_tensor_scale.cpu(),
               m.weight.qdata.cpu(), m.weight.scale.view(torch.uint8).cpu())
        for name, m in model.named_modules() if isinstance(m, NVFP4StaticLinear)
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=PRESETS, default="small")
    parser.add_argument("--device", default="cpu", help="where each layer is calibrated")
    parser.add_argument("--cache-device", default=None, help="where layer inputs wait (default: --device)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--batches", type=int, default=8, help="calibration batches in all")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--act", default="b_min", help="act_calibration")
    parser.add_argument("--weight", default="mse", help="weight_scale")
    parser.add_argument("--propagate", action="store_true", help="feed each layer the quantized outputs")
    parser.add_argument("--check", action=argparse.BooleanOptionalAction, default=None,
                        help="compare with one process calibrating the whole model (default: small models)")
    args = parser.parse_args(argv)

    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    device = torch.device(args.device)
    if distributed:
        if device.type == "cuda":
            device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    dtype = getattr(torch, args.dtype)
    config = NVFP4StaticActivationConfig(act_calibration=args.act, weight_scale=args.weight)

    model = build(args.preset, dtype)
    params = sum(p.numel() for p in model.parameters())
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(1)
    everything = [torch.randint(0, vocab, (args.batch_size, args.seq_len), generator=generator)
                  for _ in range(args.batches)]
    shards = [everything[r::world] for r in range(world)]

    layer_bytes = sum(p.numel() * p.element_size() for p in model.model.layers[0].parameters())
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    calibrate_layer_by_layer(
        model, shards[rank], config, device=device, cache_device=args.cache_device,
        filter_fn=not_lm_head, propagate_quantized=args.propagate, group=True if distributed else None,
    )
    elapsed = time.perf_counter() - start
    tokens = args.batches * args.batch_size * args.seq_len
    if rank == 0:
        print(f"{args.preset} Llama, {params / 1e6:.0f}M parameters, {world} rank(s), {tokens} tokens "
              f"({args.act}+{args.weight}{', propagated' if args.propagate else ''}): "
              f"layer by layer in {elapsed:.1f} s")
        if device.type == "cuda":
            cached = len(shards[rank]) * args.batch_size * args.seq_len * model.config.hidden_size * dtype.itemsize
            print(f"peak GPU memory {torch.cuda.max_memory_allocated(device) / 2**30:.2f} GiB "
                  f"(one float decoder layer {layer_bytes / 2**30:.2f} GiB, cached layer inputs "
                  f"{cached / 2**30:.2f} GiB{' on the GPU' if args.cache_device in (None, 'cuda') else ''})")
        else:
            print(f"peak resident memory {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB")

    check = args.check if args.check is not None else params <= CHECK_LIMIT
    if rank == 0 and check and not args.propagate:
        reference = build(args.preset, dtype).to(device)
        quantize_(reference, config, filter_fn=not_lm_head)  # config's step is "prepare"
        calibrate_in_shards(reference, [[b.to(device) for b in shard] for shard in shards],
                            forward=lambda m, batch: m(batch, use_cache=False))
        quantize_(reference, dataclasses.replace(config, step="convert"), filter_fn=not_lm_head)
        ours, theirs = scales(model), scales(reference)
        equal = ours.keys() == theirs.keys() and all(
            torch.equal(a, b) for name in ours for a, b in zip(ours[name], theirs[name]))
        print(f"scales equal to one process calibrating the whole model ({len(ours)} layers): {equal}")
        if not equal:
            raise SystemExit(1)
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
