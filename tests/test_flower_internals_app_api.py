"""The private details of Flower's app-side API that fedlb relies on outside a run
(fedlb/_flower_internals/): messages built once the task identity is set,
aggregate_arrayrecords as FedAvg's weighted average, a ClientApp's call chain and mod
types. Quick tier; run against the newest flwr-nightly by scripts/check-flower-nightly.sh."""

from __future__ import annotations

import pytest

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


def test_a_clientapps_call_chain_and_mod_types_are_flowers():
    """ClientAppCallable and Mod (flwr/clientapp/typing.py), through this module."""
    from flwr.clientapp import typing as clientapp_typing

    assert flower.ClientAppCallable is clientapp_typing.ClientAppCallable
    assert flower.Mod is clientapp_typing.Mod
    with pytest.raises(AttributeError):
        _ = flower.NoSuchName
