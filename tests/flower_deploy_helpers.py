"""Shared helpers of the deployed-run tests (tests/test_flower_deploy_*.py): a silo's
node config, a run's settings, the port a federation records, and a probe of the
server's public port (the Control API must not be served there)."""

from __future__ import annotations

import json

import pytest

from fedlb.deploy import RunConfig

BASE_SPEED = 200.0  # samples/s of a factor-1 silo: sleep-padding dominates real compute


def silo_config(i, n, factor):
    return {
        "partition-id": i,
        "num-partitions": n,
        "emulated-speed": BASE_SPEED / factor,
        "threads": 1,
    }


def record_port(out_dir):
    """The SuperLink's public port, as the server recorded it in server.json."""
    return json.loads((out_dir / "server.json").read_text())["port"]


def run_settings(out_dir, **changes):
    values = {
        **RunConfig().to_mapping(),
        "num-silos": 3,
        "num-rounds": 3,
        "local-steps": 5,
        "batch-size": 16,
        "evaluate-every": 3,
        "learning-rate": 0.1,
        "out-dir": str(out_dir),
    }
    values.update(changes)
    return values


def probe_public_door(address, control_address, ca=None):
    """What a stranger who reaches the server's public port gets from the Control API
    during a live run, with the federation's CA when it has TLS (all it needs): nothing.
    Returns the live run's id (from the control door, on this machine)."""
    import ssl
    import urllib.error
    import urllib.request

    from fedlb.deploy.control import Control
    from fedlb.deploy.processes import DeployError

    with Control(control_address) as own:  # the loopback door answers on this machine
        live = [run for run, status in own.runs().items() if status == "running"]
    assert len(live) == 1, live
    with Control(address, root_certificates=ca) as stranger:
        for call in (stranger.runs, lambda: stranger.stop_run(live[0])):
            with pytest.raises(DeployError, match="not served on this port"):
                call()
    context = ssl.create_default_context(cafile=str(ca)) if ca is not None else None
    scheme = "https" if ca is not None else "http"
    for method in ("list-runs", "list-nodes", "stop-run", "register-supernode"):
        request = urllib.request.Request(
            f"{scheme}://{address}/v1/control/{method}",
            data=b"{}",
            headers={"content-type": "application/json"},
        )
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=5, context=context)
        assert refused.value.code == 403
        assert b"Control API listens on 127.0.0.1:" in refused.value.read()
    return live[0]
