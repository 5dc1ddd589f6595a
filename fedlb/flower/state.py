"""fedlb's side of a LoadBalanced strategy as a checkpoint keeps it (`Checkpoint.strategy`):
the balancer, Python's sampling state, the silos' labels and the round's unpublished record,
and how they are put back on resume. The file itself is `records.checkpoint`'s."""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from typing import Any

from fedlb.balance import BatchSizeManager

from .membership import Membership
from .records import CheckpointError, RoundLog, record_from_dict, record_to_dict


def strategy_state(
    manager: BatchSizeManager | None, members: Membership, rounds: RoundLog
) -> dict[str, Any]:
    """What a resumed run needs of fedlb's side of the strategy (JSON-serialisable): the
    balancer with its estimators and tuner, the state of Python's `random` (Flower's
    strategies sample silos with it: a resumed run samples as the uninterrupted one
    would), the silos' labels, who is left out and what each brought to X, and the last
    round's record if still unpublished."""
    version, internal, gauss = random.getstate()
    pending = rounds.pending
    return {
        "manager": None if manager is None else manager.state_dict(),
        "sampling": [version, list(internal), gauss],
        **members.state_dict(),
        "pending": None if pending is None else record_to_dict(pending),
    }


def restore_strategy_state(
    state: Mapping[str, Any],
    balancer: Callable[[Mapping[str, int]], BatchSizeManager],
    members: Membership,
    rounds: RoundLog,
) -> BatchSizeManager | None:
    """Put `strategy_state` back into the parts; the balancer, rebuilt with `balancer`.
    CheckpointError if the state does not fit (another fedlb, another balancer kind).
    (An older checkpoint's "rng", fedlb's own sampling before it wrapped a strategy that
    samples, is not needed.)"""
    try:
        manager = None
        if state["manager"] is not None:
            manager_state = state["manager"]
            manager = balancer({w: int(b) for w, b in manager_state["sizes"].items()})
            manager.load_state_dict(manager_state)
        if "sampling" in state:
            version, internal, gauss = state["sampling"]
            random.setstate((int(version), tuple(int(x) for x in internal), gauss))
        members.load_state_dict(dict(state))
        pending = state["pending"]
        rounds.pending = None if pending is None else record_from_dict(pending)
    except (KeyError, TypeError, ValueError, AttributeError) as error:
        raise CheckpointError(
            f"the checkpoint's strategy state does not fit this strategy: {error!r}"
        ) from error
    return manager
