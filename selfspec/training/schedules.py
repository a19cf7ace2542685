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


def lr_at(step: int, peak: float, warmup: int, total: int, min_ratio: float,
          replan: tuple[int, float] | None = None) -> float:
    """Linear warm-up to `peak` over `warmup` steps, then a cosine to peak*min_ratio at `total`.
    `step` is 0-based: the learning rate used by the (step+1)-th optimizer update.

    replan = (s0, lr0): a run resumed at step s0 with a new `total` (see replan_on_resume):
    from s0 on, a cosine from lr0, the rate the old schedule gave step s0, to the same floor
    at the new `total`, so the rate never jumps."""
    floor = peak * min_ratio
    if replan is not None and step >= replan[0]:
        s0, lr0 = replan
        progress = min(1.0, (step - s0) / max(1, total - s0))
        return floor + (lr0 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
    if warmup > 0 and step < warmup:
        return peak * (step + 1) / warmup
    span = max(1, total - warmup)
    progress = min(1.0, (step - warmup) / span)
    return floor + (peak - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def replan_on_resume(step: int, peak: float, warmup: int, min_ratio: float, old_total: int, new_total: int,
                     replan: tuple[int, float] | None) -> tuple[tuple[int, float] | None, str | None]:
    """The learning-rate plan of a run resumed at `step` whose --max-steps changed from
    old_total to new_total: (replan for lr_at, what changed, to print; None if nothing did).

    Restarting the schedule with the new horizon would jump the rate (1.06e-4 at step 20 ->
    3.39e-4 at step 21 for a 20-step run extended to 40); instead the rest of the run follows
    a cosine from the current rate down to the same floor at the new horizon. During the
    warm-up nothing needs re-planning: the warm-up finishes and the cosine ends at new_total."""
    if new_total == old_total or step >= new_total:
        return replan, None
    change = f"--max-steps {old_total} -> {new_total}"
    if replan is None and step < warmup:
        return None, f"{change}: the warm-up continues and the learning-rate cosine now ends at step {new_total}"
    lr0 = lr_at(step, peak, warmup, old_total, min_ratio, replan)
    floor = peak * min_ratio
    if lr0 <= floor * (1 + 1e-9):
        return (step, lr0), (f"{change}: the learning rate had decayed to its floor {floor:.3g}; the extra steps keep it "
                             "(to train at a higher rate, start a new run from the model)")
    return (step, lr0), (f"{change}: the learning rate is re-planned from {lr0:.3g} at step {step} down to {floor:.3g} at "
                         f"step {new_total} (a cosine, no jump)")


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
