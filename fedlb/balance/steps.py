"""The second lever, where batch sizes cannot move: fewer local steps for the slow workers.

At the edge of stability (the app's own learning rate already near divergence) a smaller
batch is a noisier step, and the noise kills runs (fedlb.balance.guard). A slow worker can
finish sooner another way: at its own batch size, with fewer local steps. Every step it
takes is then exactly as noisy as a uniform run's; what changes is how far its update
travels, which `step_weights` undoes (FedNova, Wang et al., NeurIPS 2020: each update
divided by its steps, the average scaled back by the weighted mean of the steps), so a
worker with fewer steps neither drags the model back nor gains a bigger say.

Only the slow workers' steps are cut, never a fast one's raised: the LB-BSP paper (Sec. 3.5)
rejects tuning τ because a fast worker's extra steps bias the average toward its data; a
slow one doing fewer steps at its own batch size, normalized, is the proposal FedNova makes
and measures. The round is as long as the batch-size balanced round would be at the same
X (T* of `ideal_round_time` at each worker's own τ): the two levers give the same round
time, one by moving B, the other by moving τ.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping
from typing import TypeVar

from .ideal import ideal_round_time

K = TypeVar("K", bound=Hashable)


def steps_for_round(
    speeds: Mapping[str, float],
    batch_sizes: Mapping[str, int],
    own_steps: Mapping[str, int],
    overheads: Mapping[str, float] | None = None,
) -> dict[str, int]:
    """Each worker's local steps at its own batch size, so that all finish together.

    Args:
        speeds: samples/s of pure compute per worker (v_i).
        batch_sizes: each worker's batch size, kept (B_i).
        own_steps: each worker's own step count (τ_i, what a uniform round runs); no
            worker gets more.
        overheads: fixed seconds per round per worker (o_i). Default none.

    Returns each worker's steps in [1, own], cut to the round time T* a batch-size
    balanced round would take at X = Σ B_i: τ_i = (T* − o_i)·v_i / B_i, rounded.
    Workers without a speed keep their own steps.
    """
    known = [w for w in batch_sizes if w in speeds and w in own_steps]
    out = {w: int(own_steps[w]) for w in batch_sizes if w in own_steps}
    if len(known) < 2:
        return out
    fixed = {w: (overheads or {}).get(w, 0.0) for w in known}
    target = ideal_round_time(
        {w: speeds[w] for w in known},
        sum(batch_sizes[w] for w in known),
        {w: own_steps[w] for w in known},
        fixed,
    )
    for w in known:
        ideal = (target - fixed[w]) * speeds[w] / batch_sizes[w]
        steps = round(ideal) if math.isfinite(ideal) else own_steps[w]
        out[w] = max(1, min(int(own_steps[w]), steps))
    return out


def step_weights(steps: Mapping[K, int], weights: Mapping[K, float]) -> dict[K, float]:
    """FedNova's factor for each worker's update: τ_eff / τ_i, with τ_eff = Σ p_i·τ_i the
    mean of the steps weighted as the average weighs the workers (p_i ∝ `weights`).

    An update scaled by it, global + (τ_eff/τ_i)·(local − global), and averaged with the
    weights p_i gives global − τ_eff·Σ p_i·d_i, d_i the worker's update per step: FedAvg
    of normalized updates. Where all steps are equal every factor is 1 (plain FedAvg)."""
    names = [w for w in steps if w in weights and weights[w] > 0 and steps[w] > 0]
    total = math.fsum(weights[w] for w in names)
    if not names or total <= 0:
        return {w: 1.0 for w in steps}
    effective = math.fsum(weights[w] * steps[w] for w in names) / total
    return {w: (effective / steps[w] if w in names else 1.0) for w in steps}
