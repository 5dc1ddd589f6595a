"""The private details of Flower's Control API and `flwr` CLI helpers that fedlb's
Control calls (fedlb/_flower_internals/): submitting, listing, stopping and streaming
runs, building a user's FAB, registering a silo key; and the lines fedlb reads in a
SuperNode's log. Quick tier; run against the newest flwr-nightly by
scripts/check-flower-nightly.sh."""

from __future__ import annotations

import pytest

from fedlb import _flower_internals as flower
from tests.flower_internals_helpers import ROOT, flower_says, source

# --- the Control API and the flwr CLI's helpers -----------------------------------------


def test_the_control_api_client_has_the_calls_fedlb_makes():
    """ControlHttpClient (with the CLI's interceptors) has StartRun, ListRuns, StopRun,
    StreamLogs and RegisterNode; cli_errors is the CLI's translation into ClickException."""
    import click

    client = flower.control_client("127.0.0.1:9", None)
    try:
        for call in ("StartRun", "ListRuns", "StopRun", "StreamLogs", "RegisterNode"):
            assert callable(getattr(client, call))
    finally:
        client.close()
    with pytest.raises(click.ClickException), flower.cli_errors():
        flower.control_client("127.0.0.1:9", None).ListRuns(flower.list_runs_request())


def test_a_run_is_submitted_as_flwr_run_builds_it():
    """build_fab (load_and_validate, build_fab_from_disk) of fedlb's app, parse_config
    (Flower's --run-config syntax) and start_run_request (fab_to_proto, Fab,
    user_config_to_proto, simulation_config_from_json)."""
    import hashlib

    app = ROOT / "fedlb" / "deploy" / "app"
    fab = flower.build_fab(app)
    assert fab[:2] == b"PK"  # a zip
    config = flower.parse_config("num-rounds=3 dataset='mnist' lr=0.5")
    assert config == {"num-rounds": 3, "dataset": "mnist", "lr": 0.5}
    digest = hashlib.sha256(fab).hexdigest()
    request = flower.start_run_request(digest, fab, config, {"num_supernodes": 3})
    assert request.fab.hash_str == digest
    assert request.HasField("override_federation_config")
    plain = flower.start_run_request(digest, fab, {}, None)
    assert not plain.HasField("override_federation_config")


def test_building_a_users_fab_leaves_none_of_its_modules_imported(tmp_path):
    """Flower's check imports the app's package (find_spec of its module refs); a later
    app of the same package name, or a changed copy, must be imported from its own folder."""
    import shutil
    import sys

    app = tmp_path / "app"
    shutil.copytree(ROOT / "tests" / "apps" / "quickstart_pytorch", app)
    flower.build_fab(app)
    assert not [m for m in sys.modules if m.split(".")[0] == "pytorchexample"]


def test_runs_are_listed_stopped_and_streamed_with_these_requests():
    """ListRunsRequest(run_id), run_from_proto's status (status, sub_status) as `flwr ls`
    writes it, StopRunRequest(run_id), StreamLogsRequest(run_id, after_timestamp)."""
    from flwr.common.serde import run_to_proto
    from flwr.proto.control_pb2 import ListRunsResponse
    from flwr.supercore.run import Run

    assert flower.list_runs_request("3").run_id == 3
    assert flower.stop_run_request("4").run_id == 4
    assert flower.stream_logs_request("5").run_id == 5
    done, running = Run.create_empty(1), Run.create_empty(2)
    done.status.status, done.status.sub_status = "finished", "completed"
    running.status.status = "running"
    reply = ListRunsResponse(run_dict={1: run_to_proto(done), 2: run_to_proto(running)})
    assert flower.run_statuses(reply) == {"1": "finished:completed", "2": "running"}


def test_a_silo_key_is_registered_as_flwr_supernode_register_reads_it(tmp_path):
    """register_node_request reads a silo's public key (fedlb silo-key: an EC key in
    OpenSSH form) as `flwr supernode register` does; the SuperLink's refusal of a known key
    says ALREADY_REGISTERED."""
    from fedlb.security import make_silo_key

    _, public = make_silo_key(tmp_path, "silo-0")
    assert flower.register_node_request(public).public_key
    assert flower_says(f'"{flower.ALREADY_REGISTERED}')


# --- lines Flower logs --------------------------------------------------------------------


def test_the_lines_fedlb_reads_in_a_supernodes_log_are_flowers():
    """The SuperNode loop logs "SuperNode ID: %s" once connected; flwr_exit writes
    "Exit Code: N", the reason and "For more information, visit: <...>"; the connection
    errors' generic lines, the ClientApp runtime's "%s raised an exception" (its entity:
    "ClientApp") and the API error codes 2001 and 2004 are Flower's."""
    from flwr.supercore.error.base import ApiErrorCode

    assert 'log(INFO, "SuperNode ID: %s", node_id)' in source(flower.SUPERNODE_LOOP)
    assert flower.SUPERNODE_CONNECTED.search("INFO :      SuperNode ID: 123").group(1) == "123"
    exit_source = source("flwr.supercore.exit.exit")
    assert 'f"Exit Code: {code}\\n"' in exit_source
    assert f"{flower.EXIT_MORE_INFORMATION}, visit: " in exit_source
    assert flower.EXIT_CODE.search("Exit Code: 305").group(1) == "305"
    for line in flower.EXIT_GENERIC_LINES:
        assert flower_says(line), line
    runtime = source(flower.CLIENTAPP_RUNTIME)
    assert '"%s raised an exception"' in runtime
    assert '"ClientApp"' in runtime
    assert flower.CLIENTAPP_RAISED == "ClientApp raised an exception"
    disabled = int(ApiErrorCode.FLEET_SUPERNODE_REGISTRATION_DISABLED)
    assert f"[code: {disabled}]" == flower.REGISTRATION_DISABLED
    not_activated = int(ApiErrorCode.FLEET_NODE_ACTIVATION_FAILED)
    assert f"[code: {not_activated}]" == flower.NODE_ACTIVATION_FAILED
    assert flower_says("[code: {")  # how Flower writes a code into a reason
