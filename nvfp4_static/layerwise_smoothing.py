"""Norm smoothing inside ``calibrate_layer_by_layer``, with the whole-model statistics.

``smooth_norm_inputs(model, loop over the first batch)`` on the whole model takes each norm's
channel maxima from the first calibration batch as the *unsmoothed* model computes it. Layer by
layer, the layers before this one are already smoothed, and their outputs differ from the
unsmoothed ones by the rounding of the folded weights. So the first batch's hidden states also
travel through the layers before they are smoothed: each layer runs that batch once, unsmoothed,
which gives its norms' maxima and the next layer's unsmoothed input. The scales, and so every
calibration statistic after them, equal the whole-model run's bit for bit.

Data-parallel, the rank holding the first batch of the union computes each layer's scales and
broadcasts them; a failure there reaches every rank as the same error. The computing
(``compute``) and the handing over (``settle``) are separate steps, so that the other ranks can
take on more of the previous layer's convert meanwhile instead of waiting.
"""

from collections.abc import Callable
from typing import Optional

import torch

from nvfp4_static.distributed import _error_text, _gather, _raise_any_rank_error, ranks_that_failed
from nvfp4_static.messages import warn
from nvfp4_static.norm_smoothing import find_norm_groups, fold_smoothing_scales, smoothing_scales

__all__ = ["LayerSmoothing"]


class LayerSmoothing:
    """Smooths each decoder layer's norm-fed linears as the layer-by-layer run reaches it.

    Args:
        alpha: ``smooth_norm_inputs``'s alpha.
        hidden: the first batch's input to the first decoder layer; None on a rank without it.
        run: ``run(layer, hidden)`` -> the layer's output hidden states for the first batch.
        group, source: data-parallel: the process group (None: one process) and the rank in it
            that holds the first batch.
        device: where the broadcast scales live (the device the backend moves tensors on).
    """

    def __init__(self, alpha: float, hidden: Optional[torch.Tensor],
                 run: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor],
                 group=None, source: int = 0, device: Optional[torch.device] = None,
                 data_parallel: bool = False):
        self.alpha, self.hidden, self.run = alpha, hidden, run
        self.group, self.source, self.device = group, source, device
        self.data_parallel = data_parallel
        self.without_norms: list[str] = []
        self._computed: Optional[tuple] = None  # (name, norm groups, scales, error) from compute

    @property
    def computes_scales(self) -> bool:
        """Whether this rank computes the scales (it holds the first batch)."""
        return self.hidden is not None

    def smooth(self, layer: torch.nn.Module, name: str) -> None:
        """Fold the smoothing scales into ``layer`` and carry the first batch past it."""
        self.compute(layer, name)
        self.settle()

    def compute(self, layer: torch.nn.Module, name: str) -> None:
        """This rank's part of smoothing ``layer``: on the rank holding the first batch, the
        scales (and the first batch carried past it); an error is kept for ``settle``. Between
        the two, a data-parallel rank may do other work while the source computes."""
        groups, scales, error = {}, None, None
        try:
            groups = {f"{name}.{norm}": group for norm, group in find_norm_groups(layer).items()}
            if self.computes_scales:
                if groups:
                    scales = smoothing_scales(layer, groups, self._advance, self.alpha)
                else:
                    self._advance(layer)
        except Exception as caught:
            error = caught
        self._computed = (name, groups, scales, error)

    def settle(self) -> None:
        """Finish the smoothing ``compute`` started: every rank raises if any rank's failed,
        takes the source's scales (data-parallel) and folds them into the layer."""
        name, groups, scales, error = self._computed
        self._computed = None
        if self.data_parallel:
            self._raise_if_any_rank_failed(error)
            if groups:
                scales = self._broadcast(groups, scales)
        elif error is not None:
            raise error
        if groups:
            fold_smoothing_scales(groups, scales)
        else:
            self.without_norms.append(name)

    def warn_about_unsmoothed(self) -> None:
        if self.without_norms:
            warn(
                f"nvfp4_static: smoothing left {', '.join(self.without_norms)} unsmoothed: no "
                f"norm feeding q/k/v or gate/up found there (norm_smoothing.DEFAULT_NORM_CONSUMERS)"
            )

    def _advance(self, layer: torch.nn.Module) -> None:
        self.hidden = self.run(layer, self.hidden)

    def _raise_if_any_rank_failed(self, error: Optional[BaseException]) -> None:
        """Every rank raises the same error if any rank's smoothing failed (a flag per rank on
        the device; the error texts are gathered only then)."""
        if ranks_that_failed(error is not None, self.group, self.device):
            gathered = _gather({"error": _error_text(error) if error else None}, self.group)
            _raise_any_rank_error(gathered, "norm smoothing")

    def _broadcast(self, groups: dict, scales: Optional[dict]) -> dict:
        """The source rank's scales on every rank (one tensor, in the groups' order)."""
        import torch.distributed as dist

        widths = [norm.weight.numel() for norm, _ in groups.values()]
        if scales is None:
            flat = torch.empty(sum(widths), dtype=torch.float32, device=self.device)
        else:
            flat = torch.cat([scales[name].float().to(self.device) for name in groups])
        dist.broadcast(flat, group=self.group, group_src=self.source)
        return {
            name: part.to(norm.weight.device)
            for (name, (norm, _)), part in zip(groups.items(), flat.split(widths))
        }
