"""Shared fixtures."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True, scope="session")
def _partition_cache(tmp_path_factory):
    """Silo partitions cached in the session's temp folder, not the user's ~/.cache (set in
    os.environ, so the SuperNodes and ClientApps the tests start inherit it)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("FEDLB_CACHE_DIR", str(tmp_path_factory.mktemp("partition-cache")))
        # no speed profiles unless a test asks for them: a run's round 1 must not depend
        # on the tests that ran before it
        patch.setenv("FEDLB_PROFILE_DIR", "off")
        yield


@pytest.fixture
def task_identity():
    """Flower refuses to build a Message outside a run unless the task identity is set."""
    from flwr.supercore.task_identity import TaskIdentity

    saved = (TaskIdentity._run_id, TaskIdentity._task_id, TaskIdentity._node_id)
    TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 1, 1, 0
    yield
    TaskIdentity._run_id, TaskIdentity._task_id, TaskIdentity._node_id = saved
