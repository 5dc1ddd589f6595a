"""A silo's one identity, and the names fedlb derives from it (only here).

A silo is its SuperNode's node id, the int Flower's SuperLink assigns and every message
carries (`msg.metadata.src_node_id`): the strategy, the membership, the replies, the
guard's verdicts and the round records key silos by it. Two names come from it:

- the balancer's worker name (`worker_name`, `node_of`): fedlb.balance names workers by
  text, because its state (estimators, tuner, guard) goes into JSON checkpoints, whose
  keys are text, and the cluster's workers and the manager service's clients are named
  the same way;
- the label people read (`silo_label`, `node_label`): silo-<partition id> once the silo
  has said which partition it trains on (stable across restarts of its SuperNode, which
  get new node ids), else node-<id>.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeAlias, TypeVar

NodeId: TypeAlias = int
V = TypeVar("V")


def worker_name(node: NodeId) -> str:
    """The balancer's name for the silo on `node`."""
    return str(node)


def node_of(worker: str) -> NodeId:
    """The node a balancer's worker name stands for (the inverse of `worker_name`)."""
    try:
        return int(worker)
    except ValueError:
        raise ValueError(f"worker {worker!r} is not a silo's name: not a Flower node id") from None


def by_node(values: Mapping[str, V]) -> dict[NodeId, V]:
    """The balancer's `values` by worker name, keyed by node instead."""
    return {node_of(w): v for w, v in values.items()}


def node_label(node: NodeId) -> str:
    """The label of a silo that has not said which partition it holds."""
    return f"node-{node}"


def silo_label(partition: int | str) -> str:
    """The label of the silo holding `partition` (an id, or its data file's name)."""
    return f"silo-{partition}"
