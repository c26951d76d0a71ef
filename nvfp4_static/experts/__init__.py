"""Mixture-of-experts layers: their fused 3-D expert weights, calibrated per expert, in NVFP4.

- ``layouts``: which experts modules are quantized (``register_experts``) and where their
  weights are;
- ``routing``: tokens to experts and back, as transformers' eager forward routes them;
- ``observed``: ``NVFP4StaticObservedExperts``, what prepare inserts;
- ``converted``: ``NVFP4StaticExperts``, what convert makes (grouped GEMMs);
- ``handlers``: the three ``quantize_`` steps for experts, built on the linears' own.
"""

from nvfp4_static.experts.converted import NVFP4StaticExperts, NVFP4StaticGroupedLinear
from nvfp4_static.experts.layouts import ExpertsLayout, experts_layout, register_experts
from nvfp4_static.experts.observed import NVFP4StaticObservedExperts

__all__ = [
    "ExpertsLayout",
    "NVFP4StaticExperts",
    "NVFP4StaticGroupedLinear",
    "NVFP4StaticObservedExperts",
    "experts_layout",
    "register_experts",
]
