"""End to end on real SuperLink and SuperNode processes on loopback: HE FedAvg over TLS,
only silos whose keys were registered joining, the public port refusing the Control API;
everything stopped by PID afterwards."""

from __future__ import annotations

import json

import numpy as np
import pytest

from fedlb.deploy.federation import Federation
from tests.flower_deploy_helpers import probe_public_door, run_settings, silo_config

pytestmark = pytest.mark.slow


def test_he_fedavg_over_tls_with_silo_authentication(tmp_path):
    """One federation set up as a deployment across organisations would be, serving the
    assertions of all three layers.
    TLS and silo keys (`fedlb certs`, `fedlb silo-key`): the SuperLink serves HTTPS and
    admits only registered silo keys; two registered silos train, a silo trusting another
    CA and a silo with an unregistered key never join.
    CKKS: the server holds the public context only; every round's aggregate (computed on
    ciphertexts) decrypts to the dataset-size-weighted mean of the decrypted updates; the
    final model stays encrypted and `fedlb decrypt` opens it at a silo. Then a run whose
    silos all fail is a failure with their reason."""
    from collections import OrderedDict

    import typer
    from flwr.app import Array, ArrayRecord
    from typer.testing import CliRunner

    from fedlb.cli import app
    from fedlb.cli.federation import finish
    from fedlb.deploy.processes import launch_supernode
    from fedlb.flower import decrypt_record
    from fedlb.he import load_context, write_keys
    from fedlb.security import make_certificates, make_silo_key

    keys = write_keys(tmp_path / "keys")
    secret = load_context(keys.secret, "silo")
    tls = make_certificates(tmp_path / "certs", ["127.0.0.1", "localhost"])
    other = make_certificates(tmp_path / "other-ca", ["127.0.0.1"])
    silo_keys = [make_silo_key(tmp_path / "silo-keys", f"silo-{i}") for i in range(2)]
    stranger_key, _ = make_silo_key(tmp_path / "stranger", "stranger")
    out = tmp_path / "out"
    with Federation(
        tmp_path / "procs", tls=tls, silo_keys=[public for _, public in silo_keys]
    ) as federation:
        assert "--ssl-certfile" in federation.link.command
        assert "--enable-supernode-auth" in federation.link.command
        federation.add_silos(
            {
                f"silo-{i}": {**silo_config(i, 2, factor), "he-context": str(keys.secret)}
                for i, factor in enumerate((1, 3))
            },
            {f"silo-{i}": private for i, (private, _) in enumerate(silo_keys)},
        )
        # launched, not waited for: Flower may refuse one before its local API is up
        intruders = [
            launch_supernode(
                tmp_path / "procs",
                "wrong-ca",
                federation.address,
                silo_config(0, 2, 1),
                root_certificates=other.ca,
                extra_args=["--auth-supernode-private-key", str(silo_keys[0][0])],
            ),
            launch_supernode(
                tmp_path / "procs",
                "unregistered",
                federation.address,
                silo_config(1, 2, 1),
                root_certificates=tls.ca,
                extra_args=["--auth-supernode-private-key", str(stranger_key)],
            ),
        ]
        settings = {
            "num-silos": 2,
            "partition": "dirichlet:0.5",  # unequal dataset sizes: the weights matter
            "keep-updates": 1,
            "he-context": str(keys.public),
        }
        probed = []

        def probe(record):  # with the CA every silo has, a stranger gets no Control API
            if record.round == 1:
                address = federation.address
                probed.append(probe_public_door(address, federation.control_address, tls.ca))

        try:
            outcome = federation.run(run_settings(out, **settings), on_round=probe, timeout=400)
            # The same silos in a run that splits the data otherwise (num-silos 1, their
            # num-partitions 2): each fails every round. Flower calls that run completed;
            # fedlb calls it a failure, with the silos' reason, and `fedlb server` exits 1.
            failing = {**settings, "num-silos": 1, "num-rounds": 1, "local-steps": 1}
            failed = federation.run(run_settings(tmp_path / "out-2", **failing), timeout=200)
        finally:
            for node in intruders:
                node.stop()
    wrong_ca = intruders[0].log_path.read_text(errors="replace")
    assert "CERTIFICATE_VERIFY_FAILED" in wrong_ca, wrong_ca[-2000:]
    unregistered = intruders[1].log_path.read_text(errors="replace")
    assert "could not establish a connection" in unregistered.lower() or (
        "failed to activate" in unregistered.lower()
    ), unregistered[-2000:]
    assert failed.status == "finished:completed"
    assert not failed.ok
    assert "1 of 1 rounds trained nothing" in failed.problem
    assert "num-partitions 2, but the run has num-silos 1" in failed.problem
    rows = (tmp_path / "out-2" / "rounds.jsonl").read_text().splitlines()
    assert [json.loads(r)["round_silos"] for r in rows] == [0]  # on record, with why
    with pytest.raises(typer.Exit) as exit_:
        finish(failed)
    assert exit_.value.exit_code == 1

    assert outcome.ok, (outcome.status, outcome.log_path.read_text()[-3000:])
    assert probed == [outcome.run_id]  # the live run, which the stranger did not stop
    assert "HE on" in outcome.log_path.read_text()
    assert [r.round for r in outcome.records] == [1, 2, 3]
    assert all(not r.failed and not r.rejected for r in outcome.records)
    assert all(len(r.silos) == 2 for r in outcome.records)  # no intruder took part
    assert outcome.records[-1].accuracy is not None  # federated evaluation under HE
    for record in outcome.records:
        for silo in record.silos:
            assert 0 < silo.he_s <= silo.fixed_s  # HE time counts as the fixed cost
    assert not (out / "model.pt").exists()

    def open_record(saved, prefix):
        names = [n for n in saved.files if n.startswith(prefix)]
        arrays = OrderedDict((n[len(prefix) :], Array(saved[n])) for n in names)
        return decrypt_record(secret, ArrayRecord(arrays))

    for k in (1, 2, 3):
        with np.load(out / "updates" / f"round-{k}.npz") as saved:
            nodes = [name.split("/")[1] for name in saved.files if name.startswith("weight/")]
            weights = {n: float(saved[f"weight/{n}"]) for n in nodes}
            assert len(set(weights.values())) == 2
            updates = {n: open_record(saved, f"update/{n}/") for n in nodes}
            aggregate = open_record(saved, "aggregate/")
        total = sum(weights.values())
        for key, array in aggregate.items():
            expected = sum(updates[n][key].numpy() * weights[n] / total for n in nodes)
            np.testing.assert_allclose(array.numpy(), expected, rtol=0, atol=1e-4)

    result = CliRunner().invoke(
        app,
        [
            "decrypt",
            str(out / "model.ckks.npz"),
            "--context",
            str(keys.secret),
            "--out",
            str(tmp_path / "model.pt"),
        ],
    )
    assert result.exit_code == 0, result.output
    assert (tmp_path / "model.pt").stat().st_size > 0
    refused = CliRunner().invoke(
        app, ["decrypt", str(out / "model.ckks.npz"), "--context", str(keys.public)]
    )
    assert refused.exit_code == 2
    assert "has no secret key" in refused.output
