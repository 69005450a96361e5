"""Which layers' gradients moved first before an incident, and by how much.

Every StepEvent carries the largest per-layer gradient norms (``top_grad_norms``)
and the total norm. A layer's *share* of a step is ``(layer norm / total norm)²``:
the squared shares of all layers sum to 1, so a share does not move when every
layer's gradient grows together (a large batch, a higher LR) and does move when
one layer's gradient blows up on its own, which the total norm hides until
that layer dominates it (OLMo 2 saw such layer-local grad-norm spikes come
before the loss spikes).

A layer *moved* at a step when both hold: its norm is far outside its own
baseline (robust z of the log norm >= ``min_z``, against the median and MAD of
the ``baseline_steps`` steps before the look-back window: small models'
layer norms wander by 2-4x in healthy training, so a fixed ratio names noise)
and its share rose by at least ``min_rise`` (so a rise of every layer
together names nobody). Layers are ranked by the first step they moved, then
by how far. A layer missing from a step's top-k had a share below the smallest
one listed; it counts as 0 in the share baseline, and a layer that enters the
top-k from nowhere moved if its share rose enough.

The constants were chosen on the unit tests' small torch models (healthy
training: no layer of a 3-layer MLP passes z 6 in 200 steps; an injected x300
gradient on one layer: z > 50, share 0.35 -> 1.0). This ranks suspects for a
person; it triggers nothing.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass
from typing import Sequence

from spikeguard.processors.robust_stats import robust_sigma
from spikeguard.schemas import StepEvent

LOOKBACK_STEPS = 20  # how far before the onset a layer's move still counts as "before"
BASELINE_STEPS = 50
MIN_RISE = 0.10  # absolute rise of a squared share (0..1)
MIN_Z = 6.0  # robust z of the layer's log norm
MAD_FLOOR = 0.05  # log units: a layer with a constant norm still needs a 1.35x move to count


@dataclass(frozen=True)
class LayerMove:
    """One layer that moved: when first, from what share to what peak share."""

    layer: str
    first_step: int  # the first step in the window at which its share had moved
    steps_before_onset: int  # onset - first_step (0: it moved at the onset itself)
    baseline_share: float
    peak_share: float
    norm_ratio: float | None  # the layer's norm at its peak over its baseline median norm
    z: float | None  # robust z of the log norm at its peak (None: it was not in the baseline)

    def as_dict(self) -> dict:
        return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in asdict(self).items()}


def _shares(event: StepEvent) -> dict[str, float]:
    total = event.grad_norm
    if not total or not math.isfinite(total) or total <= 0:
        return {}
    return {
        name: (norm / total) ** 2
        for name, norm in event.top_grad_norms.items()
        if math.isfinite(norm)
    }


def attribute(
    steps: Sequence[StepEvent],
    onset_step: int,
    *,
    lookback: int = LOOKBACK_STEPS,
    baseline_steps: int = BASELINE_STEPS,
    min_rise: float = MIN_RISE,
    min_z: float = MIN_Z,
    after: int = 2,
) -> list[LayerMove]:
    """Layers whose gradient share moved in ``[onset - lookback, onset + after]``.

    ``steps`` are one training history (one epoch chain, rank 0) in step order;
    steps outside the window and the baseline are ignored. Returns [] when there
    are no per-layer norms or no baseline to compare with.
    """
    window_start = onset_step - lookback
    base = [e for e in steps if window_start - baseline_steps <= e.step < window_start]
    window = [e for e in steps if window_start <= e.step <= onset_step + after]
    if not base or not window:
        return []
    base_shares = [_shares(e) for e in base]
    layers = {name for e in (*base, *window) for name in e.top_grad_norms}
    moves: list[LayerMove] = []
    for layer in layers:
        baseline = statistics.median(s.get(layer, 0.0) for s in base_shares)
        logs = [
            math.log(e.top_grad_norms[layer])
            for e in base
            if e.top_grad_norms.get(layer, 0) > 0 and math.isfinite(e.top_grad_norms[layer])
        ]
        # The layer's usual log norm and its robust spread; None without a finite base norm.
        fit: tuple[float, float] | None = None
        if logs:
            center = statistics.median(logs)
            fit = center, max(MAD_FLOOR, robust_sigma(logs, center))
        first: StepEvent | None = None
        peak, peak_z, peak_norm = baseline, None, None
        for event in window:
            share = _shares(event).get(layer)
            if share is None or share - baseline < min_rise:
                continue
            norm = event.top_grad_norms[layer]
            z = (math.log(norm) - fit[0]) / fit[1] if fit is not None and norm > 0 else None
            if z is not None and z < min_z:
                continue
            first = first or event
            if share > peak:
                peak, peak_z, peak_norm = share, z, norm
        if first is None:
            continue
        ratio = peak_norm / math.exp(fit[0]) if peak_norm is not None and fit is not None else None
        moves.append(
            LayerMove(layer, first.step, onset_step - first.step, baseline, peak, ratio, peak_z)
        )
    return sorted(moves, key=lambda m: (m.first_step, -(m.peak_share - m.baseline_share)))
