"""CKKS: keys and their roles, packing, the encrypted weighted average, and HE FedAvg
through the strategy and the silo mod (in-process Flower messages, real ciphertexts)."""

from __future__ import annotations

import contextlib
import os
from typing import ClassVar

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, MetricRecord
from flwr.clientapp import ClientApp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fedlb.balance import BatchSizeManager, Static
from fedlb.deploy import RunConfig, evaluate_reply, train_reply
from fedlb.deploy.task import federation_data, model_for
from fedlb.flower import Balancing, Keeping, LoadBalancedFedAvg, RoundReporter, balance_mod
from fedlb.flower.he import (
    EncryptedAggregation,
    EncryptedModel,
    he_mod,
    is_encrypted,
    load_encrypted,
    read_encrypted,
    save_encrypted,
)
from fedlb.flower.protocol import HE_S, OVERHEAD_S, PREFIX
from fedlb.he import (
    CiphertextError,
    HeKeyError,
    HeParams,
    Layout,
    decrypt_arrays,
    encrypt_arrays,
    fingerprint,
    generate_keys,
    load_ciphertexts,
    load_context,
    weighted_sum,
    write_keys,
)
from tests.flower_fakes import InProcessGrid, fedlb_app, lr_config


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    return write_keys(tmp_path_factory.mktemp("keys"))


@pytest.fixture(scope="module")
def secret(keys):
    return load_context(keys.secret, "silo")


@pytest.fixture(scope="module")
def public(keys):
    return load_context(keys.public, "server")


# ---- keys ----------------------------------------------------------------------------
def test_keygen_writes_a_secret_and_a_public_context_tied_by_a_fingerprint(keys, secret, public):
    assert secret.is_private()
    assert not public.is_private()
    assert fingerprint(secret) == fingerprint(public) == keys.fingerprint
    assert keys.secret.stat().st_mode & 0o077 == 0  # the secret key: owner only
    assert (keys.secret.parent / "fingerprint.txt").read_text().strip() == keys.fingerprint
    assert load_context(keys.public, "server", keys.fingerprint) is not None
    with pytest.raises(HeKeyError, match="already exist"):
        write_keys(keys.secret.parent)


def test_contexts_are_refused_in_the_wrong_role_or_run(keys, tmp_path):
    with pytest.raises(
        HeKeyError, match=r"silo\.context holds a secret key: the server must never"
    ):
        load_context(keys.secret, "server")
    with pytest.raises(HeKeyError, match="has no secret key"):
        load_context(keys.public, "silo")
    other = write_keys(tmp_path / "other")
    with pytest.raises(HeKeyError, match="does not match this run's"):
        load_context(other.secret, "silo", keys.fingerprint)
    junk = tmp_path / "junk.context"
    junk.write_bytes(os.urandom(500))
    with pytest.raises(HeKeyError, match=r"junk\.context: not a TenSEAL context"):
        load_context(junk, "silo")
    with pytest.raises(HeKeyError, match="cannot read"):
        load_context(tmp_path / "missing.context", "silo")
    with pytest.raises(HeKeyError, match="must never have it"):
        EncryptedAggregation(load_context(keys.secret, "silo"))


@pytest.mark.parametrize(
    ("params", "message"),
    [
        (HeParams(8192, (60, 40, 40, 60, 60)), "above the 218 bits"),
        (HeParams(8192, (60, 60)), "at least 3 coefficient moduli"),
        (HeParams(8192, (60, 30, 60)), "must equal the scale"),
        (HeParams(3000), "poly modulus degree must be one of"),
    ],
)
def test_insecure_or_unusable_parameters_are_refused(params, message):
    with pytest.raises(HeKeyError, match=message):
        generate_keys(params)


# ---- packing and aggregation ---------------------------------------------------------
def _update(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "conv.weight": rng.normal(size=(6, 1, 5, 5)).astype(np.float32),
        "fc.weight": rng.normal(size=(84, 120)).astype(np.float32),  # spans 3 ciphertexts
        "fc.bias": rng.normal(size=84).astype(np.float32),
        "bn.num_batches_tracked": np.array(7, dtype=np.int64),
    }


def test_arrays_pack_into_as_few_ciphertexts_as_the_slots_allow(secret, public):
    update = _update(0)
    ciphertexts, layout = encrypt_arrays(public, update)  # the server can encrypt too
    assert layout.total == 150 + 10080 + 84 + 1
    assert len(ciphertexts) == layout.count == 3  # ceil(10315 / 4096)
    back = decrypt_arrays(secret, ciphertexts, layout)
    for key, value in update.items():
        assert back[key].dtype == value.dtype
        np.testing.assert_allclose(back[key], value, atol=1e-5)
    assert Layout.from_json(layout.to_json()) == layout


def test_the_encrypted_weighted_average_matches_plaintext(secret, public):
    updates = [_update(seed) for seed in range(5)]
    sizes = np.array([120.0, 40.0, 310.0, 75.0, 9.0])
    encrypted = [encrypt_arrays(secret, u) for u in updates]
    layout = encrypted[0][1]
    loaded = [load_ciphertexts(public, c, lay) for c, lay in encrypted]
    average = decrypt_arrays(secret, weighted_sum(loaded, sizes / sizes.sum()), layout)
    for key in ("conv.weight", "fc.weight", "fc.bias"):
        expected = sum(
            w * u[key].astype(np.float64)
            for w, u in zip(sizes / sizes.sum(), updates, strict=False)
        )
        np.testing.assert_allclose(average[key], expected, atol=1e-5)


def test_corrupt_truncated_and_foreign_ciphertexts_are_refused(secret, public, tmp_path):
    ciphertexts, layout = encrypt_arrays(secret, _update(1))
    good = ciphertexts[0]
    cases = {
        "truncated": [good[: len(good) // 2], *ciphertexts[1:]],
        "random": [os.urandom(len(good)), *ciphertexts[1:]],
        "empty": [b"", *ciphertexts[1:]],
        "missing": ciphertexts[:-1],
        "reordered": [ciphertexts[2], ciphertexts[1], ciphertexts[0]],
    }
    for bad in cases.values():
        with pytest.raises(CiphertextError):
            load_ciphertexts(public, bad, layout)
    # a ciphertext that already took a multiplication is not a fresh one
    from tenseal import ckks_vector_from

    used = (ckks_vector_from(secret, good) * 0.5).serialize()
    with pytest.raises(CiphertextError, match="not a fresh ciphertext"):
        load_ciphertexts(public, [used, *ciphertexts[1:]], layout)
    # the same parameters, another key: caught by the fingerprint
    other = generate_keys()
    foreign, foreign_layout = encrypt_arrays(other, _update(1))
    with pytest.raises(CiphertextError, match="encrypted under another key"):
        load_ciphertexts(public, foreign, foreign_layout)
    # other parameters
    small = generate_keys(HeParams(16384, (60, 40, 60)))
    alien, _ = encrypt_arrays(small, _update(1))
    with pytest.raises(CiphertextError):
        load_ciphertexts(public, alien[:3], layout)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.binary(max_size=4096), layout_text=st.binary(max_size=300))
def test_random_bytes_never_crash_the_deserialisers(public, data, layout_text):
    layout = Layout(("w",), ((10,),), ("float32",), 4096, fingerprint(public))
    with pytest.raises(CiphertextError):
        load_ciphertexts(public, [data], layout)
    with contextlib.suppress(CiphertextError):
        Layout.from_json(layout_text)
    record = ArrayRecord(
        {
            "ckks/layout": Array(np.frombuffer(layout_text, np.uint8)),
            "ckks/0": Array(np.frombuffer(data, np.uint8)),
        }
    )
    with contextlib.suppress(CiphertextError):
        read_encrypted(record)


# ---- through the strategy and the mod ------------------------------------------------
@pytest.mark.usefixtures("task_identity")
class TestEncryptedFedAvg:
    SETTINGS: ClassVar[dict[str, object]] = {
        "num-silos": 3,
        "local-steps": 3,
        "batch-size": 16,
        "partition": "classes:3",
    }

    NODES: ClassVar[dict[int, dict[str, int]]] = {
        100 + i: {"partition-id": i, "num-partitions": 3} for i in range(3)
    }

    def grid(self, mod=None):
        """fedlb's silo app (balance_mod, then the HE mod when given)."""
        app = fedlb_app() if mod is None else fedlb_app(mod)
        return InProcessGrid(dict(self.NODES), dict(self.SETTINGS), app)

    def run(self, grid, he=None, rounds=3, tmp_path=None, **options):
        config = RunConfig.from_mapping(self.SETTINGS)
        pool, _ = federation_data(config)
        strategy = LoadBalancedFedAvg(
            min_available_nodes=3,
            evaluate_with_train=True,
            he=he,
            **options,
            balancing=Balancing(
                batch_size=16,
                local_steps=3,
                balancer=lambda initial: BatchSizeManager(initial, Static()),
                # as under HE (no plaintext update to normalize by its steps): no steps
                # lever, so the plaintext run is the one HE must reproduce
                edge="uniform",
            ),
            keeping=Keeping(reporter=RoundReporter(tmp_path)),
        )
        result = strategy.start(
            grid=grid,
            initial_arrays=ArrayRecord(model_for(config, pool).state_dict()),
            num_rounds=rounds,
            timeout=30,
            train_config=lr_config(),
        )
        return strategy, result.arrays

    def test_three_he_rounds_give_the_plaintext_model(self, secret, public):
        _, plain = self.run(self.grid())
        sizes = set()

        def note_size(reply):
            if reply.has_content() and "arrays" in reply.content:
                sizes.add(reply.content["metrics"].get("num-examples"))
            return reply

        he_grid = self.grid(he_mod(secret))
        he_grid.intercept = note_size
        strategy, encrypted = self.run(he_grid, EncryptedAggregation(public))
        assert len(sizes - {None}) == 3  # non-uniform dataset sizes: the weights matter
        assert not strategy.he.context.is_private()  # the server never held a secret key
        assert is_encrypted(encrypted)
        ciphertexts, layout = read_encrypted(encrypted)
        model = decrypt_arrays(secret, ciphertexts, layout)
        for key, array in plain.items():
            np.testing.assert_allclose(model[key], array.numpy(), atol=1e-4, rtol=0)
        records = strategy.reporter.records
        assert all(not r.failed for r in records)
        assert all(s.fixed_s > 0 for r in records for s in r.silos)  # HE time is fixed cost
        assert records[-1].accuracy is not None  # federated evaluation under HE

    def test_a_corrupt_ciphertext_is_rejected_and_the_round_goes_on(self, secret, public, caplog):
        grid = self.grid(he_mod(secret))

        def corrupt(reply):
            if (
                reply.has_content()
                and reply.metadata.src_node_id == 101
                and "arrays" in reply.content
            ):
                arrays = reply.content["arrays"]
                data = arrays["ckks/1"].numpy().tobytes()
                arrays["ckks/1"] = Array(np.frombuffer(data[: len(data) // 3], np.uint8))
            return reply

        grid.intercept = corrupt
        strategy, encrypted = self.run(grid, EncryptedAggregation(public), rounds=2)
        assert is_encrypted(encrypted)
        for record in strategy.reporter.records:
            assert len(record.failed) == 1
            assert "encrypted update rejected: ciphertext 1" in record.failed[0]
        assert "encrypted update rejected" in caplog.text

    def test_mismatched_keys_and_missing_keys_are_clear_errors(self, secret, public):
        grid = self.grid(he_mod(generate_keys()))
        strategy, _ = self.run(grid, EncryptedAggregation(public), rounds=1)
        assert all("different `fedlb keygen`" in f for f in strategy.reporter.records[0].failed)
        grid = self.grid(he_mod())  # a silo without a key
        strategy, _ = self.run(grid, EncryptedAggregation(public), rounds=1)
        assert all("has no HE key" in f for f in strategy.reporter.records[0].failed)
        grid = self.grid(he_mod(secret))  # a plaintext server
        strategy, _ = self.run(grid, None, rounds=1)
        assert all(
            "refusing to send an unencrypted" in f for f in strategy.reporter.records[0].failed
        )

    def test_the_server_cannot_evaluate_under_he(self, public):
        strategy = LoadBalancedFedAvg(he=EncryptedAggregation(public))
        with pytest.raises(ValueError, match="cannot evaluate"):
            strategy.start(
                grid=self.grid(),
                initial_arrays=ArrayRecord(),
                evaluate_fn=lambda r, a: None,
            )

    def test_the_result_of_an_he_run_refuses_to_be_read_as_plaintext(
        self, secret, public, tmp_path
    ):
        _, model = self.run(self.grid(he_mod(secret)), EncryptedAggregation(public), rounds=1)
        assert isinstance(model, EncryptedModel)
        with pytest.raises(TypeError, match="CKKS-encrypted"):
            model.to_torch_state_dict()
        with pytest.raises(TypeError, match="CKKS-encrypted"):
            model.to_numpy_ndarrays()
        # it saves as its ciphertexts and opens at a silo
        saved = load_encrypted(save_encrypted(model, tmp_path / "model.ckks.npz"))
        ciphertexts, layout = read_encrypted(saved)
        assert set(decrypt_arrays(secret, ciphertexts, layout)) == set(self.plain_keys())
        with pytest.raises(CiphertextError):
            EncryptedModel(ArrayRecord({"w": Array(np.zeros(3, dtype=np.float32))}))

    def plain_keys(self):
        config = RunConfig.from_mapping(self.SETTINGS)
        pool, _ = federation_data(config)
        return model_for(config, pool).state_dict().keys()

    def test_he_mod_works_on_either_side_of_balance_mod(self, secret, public):
        """Outside balance_mod, the HE mod adds its seconds to the report's fixed cost;
        inside it, balance_mod times them as part of the handler. Reported either way."""
        outside = ClientApp(mods=[he_mod(secret), balance_mod()])

        @outside.train()
        def train(msg, context):
            return train_reply(msg, context)

        @outside.evaluate()
        def evaluate(msg, context):
            return evaluate_reply(msg, context)

        he_seconds = []

        def note(reply):
            if reply.has_content() and "arrays" in reply.content:
                metrics = reply.content["metrics"]
                he_seconds.append((metrics[HE_S], metrics[OVERHEAD_S]))
            return reply

        for app in (outside, fedlb_app(he_mod(secret))):
            he_seconds.clear()
            grid = InProcessGrid(dict(self.NODES), dict(self.SETTINGS), app)
            grid.intercept = note
            strategy, model = self.run(grid, EncryptedAggregation(public), rounds=1)
            assert is_encrypted(model)
            assert not strategy.reporter.records[0].failed
            assert len(he_seconds) == 3
            assert all(0 < he_s <= overhead_s for he_s, overhead_s in he_seconds)
            assert all(0 < s.he_s <= s.fixed_s for s in strategy.reporter.records[0].silos)

    def metrics_seen_by_the_aggregations(self, secret, public):
        seen: dict[str, list[dict]] = {"train": [], "evaluate": []}

        def aggregation(kind):
            def aggregate(records, weighting_key):
                seen[kind].extend(dict(r["metrics"]) for r in records)
                return MetricRecord({"calls": 1})

            return aggregate

        self.run(
            self.grid(he_mod(secret)),
            EncryptedAggregation(public),
            rounds=1,
            train_metrics_aggr_fn=aggregation("train"),
            evaluate_metrics_aggr_fn=aggregation("evaluate"),
        )
        assert len(seen["train"]) == len(seen["evaluate"]) == 3
        return seen

    def test_the_train_metric_aggregation_sees_no_fedlb_keys_under_he(self, secret, public):
        """The app's metric aggregation sees its own metrics only, also when the HE mod
        has added its seconds to the replies."""
        for metrics in self.metrics_seen_by_the_aggregations(secret, public)["train"]:
            assert "num-examples" in metrics
            assert not [k for k in metrics if k.startswith(PREFIX)], metrics

    def test_the_evaluate_metric_aggregation_sees_no_fedlb_keys_under_he(self, secret, public):
        for metrics in self.metrics_seen_by_the_aggregations(secret, public)["evaluate"]:
            assert "num-examples" in metrics
            assert not [k for k in metrics if k.startswith(PREFIX)], metrics
