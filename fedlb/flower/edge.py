"""The second lever in a Flower round: where the stability guard finds the app at the edge
(a smaller batch at its learning rate is a step too noisy), every silo keeps its own batch
size and the slow ones run fewer local steps, so that all finish together
(fedlb.balance.steps); each update is normalized by its steps before the wrapped strategy
sees it (FedNova), so FedAdam, FedProx, the DP wrappers and the robust aggregators get
updates as a stock round's, only sooner."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np
from flwr.app import Array, ArrayRecord, Message

from fedlb.balance import BatchSizeManager, step_weights, steps_for_round

from .identity import by_node, worker_name


def edge_steps(
    manager: BatchSizeManager, own_steps: Mapping[int, int], nodes: list[int]
) -> dict[int, int]:
    """The steps each of `nodes` runs this round at its current (uniform) batch size,
    where the plan cuts any silo's steps ({} where it cuts none, or speeds are missing)."""
    names = [worker_name(n) for n in nodes if n in own_steps]
    sizes = {w: b for w, b in manager.sizes.items() if w in names}
    speeds = {w: v for w, v in manager.speeds().items() if w in sizes}
    if len(speeds) < 2 or len(speeds) < len(names):
        return {}
    own = {worker_name(n): own_steps[n] for n in nodes if n in own_steps}
    plan = by_node(steps_for_round(speeds, sizes, own, manager.overheads))
    if all(plan[n] >= own_steps[n] for n in plan):
        return {}
    return plan


def normalize_by_steps(
    replies: list[Message],
    sent: ArrayRecord,
    steps: Mapping[int, int],
    weight: Callable[[Message], float],
) -> None:
    """Each reply's model as global + (τ_eff/τ_i)·(local − global), in place (FedNova's
    normalization, with the wrapped strategy's own weights `weight`): averaged as the
    strategy averages, it moves the model by τ_eff steps of the silos' mean update per
    step. Only floating-point arrays of the sent model's keys and shapes are scaled."""
    by_src = {m.metadata.src_node_id: m for m in replies}
    factors = step_weights(
        {n: steps[n] for n in by_src if n in steps},
        {n: weight(m) for n, m in by_src.items() if n in steps},
    )
    before = {k: a.numpy() for k, a in sent.items()}
    for node, factor in factors.items():
        if factor == 1.0:
            continue
        content = by_src[node].content
        name, record = next(iter(content.array_records.items()))
        out: dict[str, Array] = {}
        for key, array in record.items():
            local = array.numpy()
            start = before.get(key)
            if (
                start is None
                or start.shape != local.shape
                or not np.issubdtype(local.dtype, np.floating)
            ):
                out[key] = array
                continue
            moved = start.astype(np.float64) + factor * (local.astype(np.float64) - start)
            out[key] = Array(np.ascontiguousarray(moved.astype(local.dtype)))
        content[name] = ArrayRecord(out)


def edge_text(sizes: Mapping[str, int], steps: Mapping[str, int], look: bool = False) -> str:
    """What a run at the edge runs, in words, silos by label: 'B kept at 32, τ 12/10/5';
    `look`: the stability guard's look, the round that runs it before any verdict."""
    order = sorted(steps)
    kept = sorted({sizes[s] for s in order if s in sizes})
    batch = "/".join(str(b) for b in kept) if kept else "each silo's own"
    lever = (
        f"B kept at {batch}, τ {'/'.join(str(steps[s]) for s in order)} by "
        f"speed ({', '.join(order)}), each update normalized by its steps (FedNova)"
    )
    if look:
        return (
            f"the stability guard looks at the app's own growth first: {lever}; grown "
            "steps mean the edge (the app's batch sizes kept from then on), calm ones a "
            "probe of unequal batch sizes next round"
        )
    return f"at the edge: {lever}"
