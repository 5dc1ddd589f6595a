"""The private details of Flower's app-side API that fedlb relies on outside a run
(fedlb/_flower_internals/): messages built once the task identity is set,
aggregate_arrayrecords as FedAvg's weighted average. Quick tier; run against the newest
flwr-nightly by scripts/check-flower-nightly.sh. (A ClientApp's call chain and mod types
are no longer here: fedlb spells them from flwr.app's public types, as the public
`ClientApp(mods=...)` does, and mypy checks fedlb's mods against it.)"""

from __future__ import annotations

from fedlb import _flower_internals as flower

# --- outside a run ------------------------------------------------------------------------


def test_messages_are_built_outside_a_run_once_the_task_identity_is_set():
    """Message(...) reads TaskIdentity, which raises while unset; task_identity sets it
    and puts back what was there (its class attributes _run_id, _task_id, _node_id)."""
    from flwr.app import Message, RecordDict
    from flwr.supercore.task_identity import TaskIdentity

    saved = (TaskIdentity._run_id, TaskIdentity._task_id, TaskIdentity._node_id)
    with flower.task_identity(run_id=3, task_id=4, node_id=0):
        message = Message(RecordDict(), dst_node_id=2, message_type="train")
        assert message.metadata.run_id == 3
    assert (TaskIdentity._run_id, TaskIdentity._task_id, TaskIdentity._node_id) == saved


def test_aggregate_arrayrecords_is_fedavgs_weighted_average():
    """strategy_utils.aggregate_arrayrecords(records, weighting_key): the arrays of each
    RecordDict weighted by its MetricRecord value."""
    import numpy as np
    from flwr.app import Array, ArrayRecord, MetricRecord, RecordDict

    records = [
        RecordDict({"a": ArrayRecord({"w": Array(np.full(2, v))}), "m": MetricRecord({"n": n})})
        for v, n in ((1.0, 1), (4.0, 3))
    ]
    average = flower.aggregate_arrayrecords(records, "n")
    np.testing.assert_allclose(average["w"].numpy(), np.full(2, 3.25))
