"""Messages and records outside a run: Flower's task identity, FedAvg's aggregate."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any


@contextlib.contextmanager
def task_identity(run_id: int = 1, task_id: int = 1, node_id: int = 0) -> Iterator[None]:
    """Flower's task identity set for building Messages outside a run, then put back.
    `Message(...)` reads `TaskIdentity.run_id` / `node_id` / `task_id`
    (flwr/supercore/task_identity.py: class properties that raise while unset, backed by
    the class attributes `_run_id`, `_task_id`, `_node_id`)."""
    from flwr.supercore.task_identity import TaskIdentity

    saved = (TaskIdentity._run_id, TaskIdentity._task_id, TaskIdentity._node_id)
    set_task_identity(run_id, task_id, node_id)
    try:
        yield
    finally:
        TaskIdentity._run_id, TaskIdentity._task_id, TaskIdentity._node_id = saved


def set_task_identity(run_id: int = 1, task_id: int = 1, node_id: int = 0) -> None:
    """Set Flower's task identity for the rest of this process (a benchmark's)."""
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = run_id, task_id, node_id


def aggregate_arrayrecords(records: Sequence[Any], weighting_key: str) -> Any:
    """FedAvg's weighted average of the ArrayRecords of `records` (RecordDicts), weighted
    by each one's MetricRecord value `weighting_key`: what Flower's strategies aggregate
    with (`flwr.serverapp.strategy.strategy_utils.aggregate_arrayrecords`)."""
    from flwr.serverapp.strategy.strategy_utils import aggregate_arrayrecords as aggregate

    return aggregate(list(records), weighting_key)
