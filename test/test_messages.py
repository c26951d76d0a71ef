"""Our warnings point at the line of the user's code that led to them, however deep the model."""

import inspect
import warnings

import torch
from torchao.quantization import quantize_

from conftest import DIM, calibration_batches
from nvfp4_static import NVFP4StaticActivationConfig, NVFP4BMinCalibrator, is_quantizable


def nested(depth: int) -> torch.nn.Module:
    """A 100 -> 64 linear (not a multiple of 16: left unquantized with a warning) ``depth``
    containers down."""
    model = torch.nn.Linear(100, DIM)
    for _ in range(depth):
        model = torch.nn.Sequential(model)
    return model


def caught(run):
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        run()
    return [r for r in records if "nvfp4_static" in str(r.message) or "Calibrator" in str(r.message)]


def test_a_prepare_warning_points_at_the_quantize_call_at_every_depth():
    for depth in (1, 3, 6):
        model = nested(depth)
        line = inspect.currentframe().f_lineno + 1
        records = caught(lambda: quantize_(model, NVFP4StaticActivationConfig(), filter_fn=is_quantizable))
        assert len(records) == 1, depth
        assert (records[0].filename, records[0].lineno) == (__file__, line), depth


def test_a_convert_warning_from_a_calibrator_points_at_the_quantize_call():
    model = torch.nn.Sequential(torch.nn.Sequential(torch.nn.Linear(DIM, DIM)))
    quantize_(model, NVFP4StaticActivationConfig(step="prepare"), filter_fn=is_quantizable)
    x = calibration_batches(1)[0]
    x[..., :16] *= 1e6  # a block amax range beyond FP8's 28672: the B_min calibrator warns
    with torch.no_grad():
        model(x)
    line = inspect.currentframe().f_lineno + 1
    records = caught(lambda: quantize_(model, NVFP4StaticActivationConfig(step="convert"), filter_fn=is_quantizable))
    assert [("span B_max / B_min" in str(r.message), r.filename, r.lineno) for r in records] == [
        (True, __file__, line)
    ]


def test_a_calibrator_warning_called_directly_points_at_the_caller():
    calibrator = NVFP4BMinCalibrator()
    calibrator.collect(torch.zeros(4, 32))
    line = inspect.currentframe().f_lineno + 1
    records = caught(lambda: calibrator.compute_amax())
    assert [(r.filename, r.lineno) for r in records] == [(__file__, line)]


def test_a_quickstart_run_eager_and_compiled_warns_nothing_of_ours():
    """Prepare, calibrate, convert and run the README's quickstart model, eagerly and compiled:
    no warning from this package or about its tensor subclass (torch asks subclasses for a
    stable hash to cache compiled graphs by)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 256))

    def quickstart():
        quantize_(model, NVFP4StaticActivationConfig(step="prepare"), filter_fn=is_quantizable)
        with torch.no_grad():
            for _ in range(8):
                model(torch.randn(32, 256))
        quantize_(model, NVFP4StaticActivationConfig(step="convert"), filter_fn=is_quantizable)
        with torch.inference_mode():
            model(torch.randn(4, 256))
            torch.compile(model, fullgraph=True)(torch.randn(4, 256))

    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        quickstart()
    ours = [str(r.message) for r in records if "nvfp4_static" in str(r.message) + r.filename
            or "NVFP4Static" in str(r.message)]
    assert ours == []
