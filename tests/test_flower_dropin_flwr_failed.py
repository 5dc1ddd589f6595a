"""How a run that failed shows under the user's own `flwr run` (issue 56, item 5):
Flower's CLI exits 0 once the SuperLink accepted the run, also when fedlb's
`NoUsableUpdateError` then stopped it. On Flower's simulation, quickstart-pytorch made
load-balanced, every silo's train raising: `flwr run --stream` exits 0, the run's status
is finished:failed, and the streamed log ends with the error, as docs/how-to/flower-app.md
says to look for it."""

from __future__ import annotations

import re
import subprocess
import tomllib

import pytest

from fedlb.deploy import processes as deploy
from fedlb.deploy.control import Control
from tests.apps.adopt import adopt

pytestmark = pytest.mark.slow

FAILING_MOD = '''

def _failing(msg, context, call_next):
    """Every train fails: no usable update, round after round."""
    if msg.metadata.message_type == "train":
        raise RuntimeError("this silo cannot train")
    return call_next(msg, context)
'''


@pytest.mark.timeout(900)
def test_flwr_run_exits_0_for_a_run_fedlb_stopped_and_flwr_ls_says_it_failed(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    app, _ = adopt("quickstart_pytorch", tmp_path)
    client = next(app.glob("*/client_app.py"))
    client.write_text(
        client.read_text().replace(
            "app = ClientApp(mods=[balance_mod()])",
            FAILING_MOD.lstrip("\n") + "\napp = ClientApp(mods=[_failing, balance_mod()])",
        )
    )
    link = deploy.start_superlink(tmp_path, extra_args=["--simulation"])
    home = tmp_path / "home-cli"
    try:
        deploy.write_connection(home, f"127.0.0.1:{link.control_port}")
        done = subprocess.run(
            [
                str(deploy.bin_dir() / "flwr"),
                "run",
                str(app),
                deploy.CONNECTION,
                "--stream",
                "--federation-config",
                "num-supernodes=3 client-resources-num-cpus=1",
                "--run-config",
                "num-server-rounds=5",
            ],
            env=deploy.flower_env(home),
            capture_output=True,
            text=True,
            timeout=800,
            check=False,
        )
        output = done.stdout + done.stderr
        run_id = re.search(r"run_id `(\d+)`", output)
        assert run_id is not None, output[-3000:]
        address = tomllib.loads((home / "config.toml").read_text())["superlink"][deploy.CONNECTION]
        with Control(address["address"]) as control:
            status = control.run_status(run_id.group(1))
    finally:
        link.stop()
    assert done.returncode == 0, output[-3000:]  # Flower's CLI: the run was accepted
    assert status == "finished:failed", output[-3000:]
    assert "NoUsableUpdateError" in output, output[-3000:]
    assert "3 rounds in a row ended without a model" in output, output[-3000:]
