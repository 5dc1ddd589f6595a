"""Shared fixtures."""

from __future__ import annotations

import pytest


@pytest.fixture
def task_identity():
    """Flower refuses to build a Message outside a run unless the task identity is set."""
    from flwr.supercore.task_identity import TaskIdentity

    saved = (TaskIdentity._run_id, TaskIdentity._task_id, TaskIdentity._node_id)
    TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 1, 1, 0
    yield
    TaskIdentity._run_id, TaskIdentity._task_id, TaskIdentity._node_id = saved
