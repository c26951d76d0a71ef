"""Hugging Face habits on a converted transformers model: save_pretrained refuses clearly and
points to the two ways that work; the documented save and load round-trips, generate included."""

import pytest
import torch

pytest.importorskip("transformers")
from tiny_llama import converted_llama, tiny_llama, token_ids  # noqa: E402

from nvfp4_static import load_quantized  # noqa: E402


def test_save_pretrained_refuses_with_the_ways_that_work(tmp_path):
    model = converted_llama()
    with pytest.raises(RuntimeError, match="export_checkpoint.*load_quantized"):
        model.save_pretrained(tmp_path / "out")
    assert not list((tmp_path / "out").glob("*.safetensors"))


def test_the_documented_save_and_load_round_trip_a_transformers_model(tmp_path):
    model = converted_llama()
    torch.save(model.state_dict(), tmp_path / "model.pt")
    fresh = load_quantized(tiny_llama(seed=1), tmp_path / "model.pt")
    ids = token_ids(seed=5, batch=1, length=6)
    with torch.inference_mode():
        assert torch.equal(fresh(ids).logits, model(ids).logits)
        generated = fresh.generate(ids, max_new_tokens=4, do_sample=False)
        assert torch.equal(generated, model.generate(ids, max_new_tokens=4, do_sample=False))
