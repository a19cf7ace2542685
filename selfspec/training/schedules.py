"""Schedules as pure functions of (step, layer): nothing here keeps state, so a resumed run
computes exactly what an uninterrupted one would.

Layer dropout (LayerSkip, Elhoushi et al. 2024): layer l of L is skipped at step t with

    p(l, t) = S(t) * D(l) * p_max
    D(l) = exp(l * ln2 / (L-1)) - 1    "exp"      (0 at the first layer, 1 at the last)
         = l / (L-1)                   "linear"
         = 1                           "uniform"
    S(t) = exp(t * ln2 / T) - 1        "exp"      (from scratch: 0 at step 0, 1 at step T)
         = 1                           "none"     (continual training)

Early-exit loss weights over the active exits (torchtune's scale types, written afresh):
l is the 0-based layer index, the weight before normalisation is

    uniform  1          linear  l + 1          sum  sum_{i<=l, i active} (i + 1)
    sqrt     sqrt(l+1)  inverse 1 / (l + 1)

every non-final exit is multiplied by e_scale, and the weights are normalised to sum 1.

Exit curricula (which exits are trained at step t; the final layer always is):
    none        every layer
    rotational  layers l with (l - t) mod R == 0: every R-th layer, the pattern shifting by
                one layer each step, so each exit is trained every R steps
    gradual     layer l once t >= f*T * (L-1-l)/(L-1): exits switch on from the last layer
                towards the first, all on after the fraction f of training
"""

from __future__ import annotations

import math


def lr_at(step: int, peak: float, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warm-up to `peak` over `warmup` steps, then a cosine to peak*min_ratio at `total`.
    `step` is 0-based: the learning rate used by the (step+1)-th optimizer update."""
    if warmup > 0 and step < warmup:
        return peak * (step + 1) / warmup
    span = max(1, total - warmup)
    progress = min(1.0, (step - warmup) / span)
    return peak * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def depth_factor(layer: int, num_layers: int, schedule: str) -> float:
    """D(l) in [0, 1]."""
    if num_layers <= 1:
        return 1.0 if schedule == "uniform" else 0.0
    if schedule == "exp":
        return math.exp(layer * math.log(2) / (num_layers - 1)) - 1
    if schedule == "linear":
        return layer / (num_layers - 1)
    if schedule == "uniform":
        return 1.0
    raise ValueError(schedule)


def time_factor(step: int, total: int, curriculum: str) -> float:
    """S(t) in [0, 1]."""
    if curriculum == "none":
        return 1.0
    if curriculum == "exp":
        return math.exp(min(step, total) * math.log(2) / max(1, total)) - 1
    raise ValueError(curriculum)


def layer_dropout_rates(step: int, total: int, num_layers: int, p_max: float, schedule: str, curriculum: str) -> list[float]:
    """p(l, t) for every layer."""
    s = time_factor(step, total, curriculum)
    return [s * depth_factor(l, num_layers, schedule) * p_max for l in range(num_layers)]


def active_exits(step: int, total: int, num_layers: int, curriculum: str, rotation: int = 4, gradual_fraction: float = 0.5) -> list[int]:
    """Layer indices whose exit loss is computed at `step`, ascending; always includes L-1."""
    last = num_layers - 1
    if curriculum == "none":
        layers = list(range(num_layers))
    elif curriculum == "rotational":
        layers = [l for l in range(num_layers) if (l - step) % rotation == 0]
    elif curriculum == "gradual":
        horizon = gradual_fraction * total
        span = max(1, last)
        layers = [l for l in range(num_layers) if step >= horizon * (last - l) / span]
    else:
        raise ValueError(curriculum)
    if last not in layers:
        layers.append(last)
    return sorted(layers)


def exit_loss_scales(layers: list[int], num_layers: int, scale_type: str, e_scale: float) -> list[float]:
    """Weights of the exits `layers` (ascending), summing to 1. With e_scale 0 all weight
    is on the final layer."""
    raw: list[float] = []
    running = 0.0
    for l in layers:
        if scale_type == "uniform":
            w = 1.0
        elif scale_type == "linear":
            w = l + 1.0
        elif scale_type == "sum":
            running += l + 1.0
            w = running
        elif scale_type == "sqrt":
            w = math.sqrt(l + 1.0)
        elif scale_type == "inverse":
            w = 1.0 / (l + 1.0)
        else:
            raise ValueError(scale_type)
        raw.append(w * (e_scale if l < num_layers - 1 else 1.0))
    total = sum(raw)
    if total <= 0:  # only non-final exits with e_scale 0: nothing to train
        return [0.0 for _ in raw]
    return [w / total for w in raw]
