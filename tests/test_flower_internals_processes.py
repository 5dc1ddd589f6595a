"""The private details of Flower's SuperLink and SuperNode processes that fedlb relies
on (fedlb/_flower_internals/): their entry functions, the SuperLink's app and paths, the
SuperNode loop's pauses, backoff and steps by module-global name. Quick tier; run
against the newest flwr-nightly by scripts/check-flower-nightly.sh."""

from __future__ import annotations

import importlib
import inspect
import json
import os
import subprocess
import sys
import time
from importlib.metadata import entry_points

import pytest

from fedlb import _flower_internals as flower
from tests.flower_internals_helpers import ROOT, parameters

# --- the SuperLink's and SuperNode's processes ------------------------------------------


def test_flower_supernode_and_superlink_are_the_entry_functions_fedlb_runs_in_process():
    """`flower-supernode` is `flwr.supernode.cli:flower_supernode` and `flower-superlink`
    `flwr.superlink.cli:flower_superlink` (fedlb runs them in its own processes, forked)."""
    scripts = {e.name: e.value for e in entry_points(group="console_scripts")}
    assert scripts["flower-supernode"] == f"{flower.SUPERNODE_CLI}:flower_supernode"
    assert scripts["flower-superlink"] == f"{flower.SUPERLINK_CLI}:flower_superlink"
    assert callable(importlib.import_module(flower.SUPERNODE_CLI).flower_supernode)


SUPERLINK_PROBE = """
import json
from fedlb._flower_internals import run_superlink_cli

class Uvicorn:  # what the entry module's global `uvicorn` is replaced with
    def run(self, **options):
        app = options["app"]
        kind = f"{type(app).__module__}.{type(app).__name__}"
        print("PROBE " + json.dumps({"options": sorted(options), "app": kind}), flush=True)

run_superlink_cli(["--insecure", "--host", "127.0.0.1", "--port", "9"], uvicorn=Uvicorn())
"""


def test_the_superlink_serves_its_fastapi_app_with_its_entry_modules_uvicorn_run(tmp_path):
    """flwr/superlink/cli/flower_superlink.py has a module-level `uvicorn` whose
    `run(app=..., host=..., port=..., ...)` serves the SuperLink's FastAPI app: replaced,
    the entry point hands the replacement its app (what fedlb's gate serves through two
    doors), with the options the gate reads."""
    entry = importlib.import_module(flower.SUPERLINK_ENTRY)
    import uvicorn

    assert entry.uvicorn is uvicorn
    env = {**os.environ, "FLWR_HOME": str(tmp_path), "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", SUPERLINK_PROBE],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=tmp_path,
        check=False,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("PROBE ")]
    assert lines, f"uvicorn.run was not called (code {done.returncode}):\n{done.stderr[-3000:]}"
    probe = json.loads(lines[0][len("PROBE ") :])
    assert probe["app"] == "fastapi.applications.FastAPI"
    assert set(flower.UVICORN_RUN_OPTIONS) <= set(probe["options"]), probe["options"]


def test_the_superlink_serves_fleet_runtime_and_health_under_the_paths_the_gate_admits():
    """The Fleet API's router has prefix /v1/fleet, the Runtime API's /v1/runtime, and the
    health check is GET /health (fedlb's gate admits these at the public door)."""

    def prefixes(name: str) -> set[str]:
        return {str(getattr(v, "prefix", "")) for v in vars(importlib.import_module(name)).values()}

    assert flower.FLEET_PATH.rstrip("/") in prefixes("flwr.superlink.routers.fleet.router")
    assert flower.RUNTIME_PATH.rstrip("/") in prefixes("flwr.supercore.routers.runtime.router")
    health = importlib.import_module("flwr.supercore.routers.health.router").router
    assert flower.HEALTH_PATH in {route.path for route in health.routes}


def test_acquire_task_is_the_method_the_superexec_interceptor_signs():
    """RuntimeHttpClient.AcquireTask calls the RPC method ACQUIRE_TASK, the name fedlb's
    warm server lists in SuperExecAuthHttpInterceptor's protected methods."""
    from flwr.supercore.runtime import RuntimeHttpClient

    assert f'rpc_method="{flower.ACQUIRE_TASK}"' in inspect.getsource(RuntimeHttpClient.AcquireTask)


# --- the SuperNode's loop -----------------------------------------------------------------


def test_the_supernode_loop_pauses_3_s_idle_and_half_a_second_waiting_through_its_module_time():
    """flwr/supernode/start_client_internal.py imports the `time` module and pauses with
    `time.sleep(3)` after an empty pull and `time.sleep(0.5)` while a reply or an object is
    not there yet; set_supernode_clock replaces that module global."""
    loop = flower.module(flower.SUPERNODE_LOOP)
    text = inspect.getsource(loop)
    assert f"time.sleep({flower.SUPERNODE_IDLE_SLEEP_S})" in text
    assert f"time.sleep({flower.SUPERNODE_WAIT_SLEEP_S})" in text
    assert loop.time is time
    clock = object()
    try:
        flower.set_supernode_clock(clock)
        assert loop.time is clock
    finally:
        loop.time = time


@pytest.mark.parametrize(
    ("owner", "name", "bind"),
    [
        (flower.SUPERNODE_LOOP, "pull_objects", flower.supernode_object_pulls),
        (
            flower.CLIENTAPP_RUNTIME,
            "pull_and_inflate_object_from_tree",
            flower.clientapp_object_pulls,
        ),
        (flower.SERVERAPP_GRID, "pull_objects", flower.serverapp_reply_pulls),
    ],
)
def test_object_pulls_go_through_a_module_global_that_takes_initial_backoff(owner, name, bind):
    """The SuperNode loop, the ClientApp runtime and the ServerApp's grid pull objects
    through a function their module imported by name, which takes `initial_backoff` (1 s by
    default); binding it twice leaves one partial over Flower's function."""
    module = flower.module(owner)
    original = getattr(module, name)
    assert "initial_backoff" in parameters(original)
    assert f"{name}(" in inspect.getsource(module)
    try:
        bind(0.05)
        bind(0.02)
        bound = getattr(module, name)
        assert bound.keywords == {"initial_backoff": 0.02}
        assert bound.func is original
    finally:
        setattr(module, name, original)


def test_the_supernode_loop_calls_its_pull_and_push_steps_by_module_global_name():
    """`start_client_internal` calls `_pull_and_store_message(...)` (-> the run id of the
    message it pulled, None: none) and `_push_messages(state=, object_store=, send=,
    push_object=)` through its module's globals, which fedlb wraps."""
    loop = flower.module(flower.SUPERNODE_LOOP)
    body = inspect.getsource(loop.start_client_internal)
    for name in (flower.SUPERNODE_PULL_STEP, flower.SUPERNODE_PUSH_STEP):
        assert f"{name}(" in body
    assert {"state", "object_store", "send", "push_object"} <= parameters(
        getattr(loop, flower.SUPERNODE_PUSH_STEP)
    )
    assert {"state", "object_store", "receive", "pull_object"} <= parameters(
        getattr(loop, flower.SUPERNODE_PULL_STEP)
    )
