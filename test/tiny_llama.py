"""A random-weight two-layer Llama, quantized the way a user would: what the export, import and
fused-layer tests share."""

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from conftest import all_but_lm_head, convert, prepare
from nvfp4_static import tie_fused_layers

VOCAB = 128


def llama_config(**changes) -> LlamaConfig:
    return LlamaConfig(
        **changes,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
    )


def tiny_llama(dtype=torch.float32, seed=0, **config_changes) -> LlamaForCausalLM:
    """Built in ``dtype`` as transformers builds it from a config (``.to(dtype)`` would also cast
    the rotary buffers, which a model loaded from a folder keeps in float32)."""
    torch.manual_seed(seed)
    return LlamaForCausalLM._from_config(llama_config(**config_changes), dtype=dtype).eval()


def token_ids(seed=0, batch=4, length=16) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def logits(model, seed=5):
    with torch.no_grad():
        return model(token_ids(seed)).logits


def prepared_and_calibrated(model, filter_fn=all_but_lm_head, **config):
    prepare(model, filter_fn=filter_fn, **config)
    with torch.no_grad():
        for seed in range(2):
            model(token_ids(seed))
    return model


def convert_llama(model, filter_fn=all_but_lm_head, **config):
    """``convert`` with the filter the Llama was prepared with."""
    return convert(model, filter_fn=filter_fn, **config)


def converted_llama(dtype=torch.float32, tie=True, weight_scale="max", **config):
    """The tiny Llama prepared, calibrated, tied (unless ``tie=False``) and converted, every
    linear but ``lm_head`` quantized. ``weight_scale="max"`` by default keeps it fast."""
    model = prepared_and_calibrated(tiny_llama(dtype), weight_scale=weight_scale, **config)
    if tie:
        tie_fused_layers(model)
    return convert_llama(model, weight_scale=weight_scale, **config)
