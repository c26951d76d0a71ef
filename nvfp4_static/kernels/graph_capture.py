"""Which CUDA graph capture a launch goes into.

Memory a kernel keeps across launches (the GEMMs' tile counters) must belong to one graph when
it is captured: graphs may replay on any stream, two at once, or in another order than they were
captured, so one graph's buffer cannot be another's. torch says whether the current stream is
capturing but not which capture it is; the CUDA driver does (``cuStreamGetCaptureInfo``), and
torch's own CUDA graphs ask it the same.
"""

import ctypes
from functools import lru_cache
from typing import Optional

import torch

__all__ = ["capture_id"]

# CUstreamCaptureStatus: the stream is capturing.
_CAPTURE_ACTIVE = 1


@lru_cache(maxsize=None)
def _stream_capture_info():
    """The driver's ``cuStreamGetCaptureInfo_v2(stream, status*, id*, graph*, nodes**, count*)``,
    which every driver from CUDA 11.3 on exports (the later ``_v3`` only adds edge data)."""
    function = ctypes.CDLL("libcuda.so.1").cuStreamGetCaptureInfo_v2
    function.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_uint64)] + [
        ctypes.c_void_p
    ] * 3
    function.restype = ctypes.c_int
    return function


def capture_id(device: torch.device) -> Optional[int]:
    """The id of the CUDA graph capture under way on ``device``'s current stream (unique in the
    process), or None where that stream is not capturing."""
    if device.type != "cuda" or not torch.cuda.is_current_stream_capturing():
        return None
    stream = torch._C._cuda_getCurrentRawStream(device.index)
    status, identifier = ctypes.c_int(), ctypes.c_uint64()
    result = _stream_capture_info()(stream, ctypes.byref(status), ctypes.byref(identifier), None, None, None)
    if result != 0:
        raise RuntimeError(f"nvfp4_static: cuStreamGetCaptureInfo on stream {stream:#x} failed with CUresult {result}")
    return identifier.value if status.value == _CAPTURE_ACTIVE else None
