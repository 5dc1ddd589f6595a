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
    from fedlb._flower_internals import task_identity

    with task_identity(run_id=1, task_id=1, node_id=0):
        yield
