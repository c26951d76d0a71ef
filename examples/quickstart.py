"""Quickstart: static-activation NVFP4 on a toy MLP, in seconds.

    python examples/quickstart.py             # eager
    python examples/quickstart.py --compile   # also torch.compile(fullgraph=True)

Prepare inserts observers, a few calibration batches fix each layer's activation global scale,
convert bakes NVFP4 weights. The script then compares the quantized model with the float one,
on data like the calibration data and on data with 8x larger values than calibration saw.
"""

import argparse
import copy


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--compile", action="store_true", help="also run the model compiled")
    return parser.parse_args(argv)


if __name__ == "__main__":
    parse_args()  # --help and bad arguments answer here, before the imports below (seconds)

import torch  # noqa: E402
from torchao.quantization import quantize_  # noqa: E402

from nvfp4_static import NVFP4StaticActivationConfig, is_quantizable  # noqa: E402
from nvfp4_static.diagnostics import format_diagnostics, layer_diagnostics, snr_db  # noqa: E402


def main(argv=None) -> None:
    args = parse_args(argv)

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256)
    )
    float_model = copy.deepcopy(model)

    quantize_(model, NVFP4StaticActivationConfig(step="prepare"), filter_fn=is_quantizable)
    with torch.no_grad():
        for _ in range(8):
            model(torch.randn(32, 256))
    quantize_(model, NVFP4StaticActivationConfig(step="convert"), filter_fn=is_quantizable)
    print(model)

    x = torch.randn(16, 256)
    with torch.no_grad():
        print(f"\noutput SNR against the float model: {snr_db(float_model(x), model(x)):.1f} dB")
        if args.compile:
            compiled = torch.compile(model, fullgraph=True)
            print(f"compiled matches eager: {torch.allclose(compiled(x), model(x), atol=1e-4)}")

    # The B_min recipe leaves headroom above the calibration max, so 8x larger activations
    # than calibration saw do not clip (clip % stays 0).
    for label, batch in (("calibration-like batch", x), ("batch 8x beyond calibration", 8 * x)):
        print(f"\nper-layer diagnostics, {label}:")
        print(format_diagnostics(layer_diagnostics(model, batch, reference_model=float_model)))


if __name__ == "__main__":
    main()
