"""LoadBalancedFedAvg in-process with silos that bring their own: their own data loader
and batch size in round one, their own data file (or one that does not fit the model),
four hospitals as four silos."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.clientapp import ClientApp

from fedlb.balance import BatchSizeManager, Static
from fedlb.deploy import RunConfig, evaluate_reply, train_reply
from fedlb.flower import Balancing, LoadBalancedFedAvg, balance_mod
from fedlb.flower.protocol import BATCH_SIZE, LOCAL_STEPS, SERVER_ROUND
from tests.flower_fakes import InProcessGrid
from tests.strategy_helpers import (
    BASE,
    MODEL_SPEED,
    make_grid,
    run_config,
    sent_sizes,
    start,
    train_messages,
)

pytestmark = pytest.mark.usefixtures("task_identity")


def own_loader_app(batch_sizes):
    """fedlb's silo app whose silos each build their DataLoader at their own batch size
    (as any app's silos may), from the partition id."""
    app = ClientApp(mods=[balance_mod()])

    def config_of(context):
        own = batch_sizes[context.node_config["partition-id"]]
        return RunConfig.from_mapping({**context.run_config, "batch-size": own})

    @app.train()
    def train(msg, context):
        return train_reply(msg, context, config_of(context))

    @app.evaluate()
    def evaluate(msg, context):
        return evaluate_reply(msg, context, config_of(context))

    return app


def test_round_one_runs_each_silos_own_batch_size_and_sizes_the_balancer():
    """No batch_size or local_steps given: round 1 sends no size and no steps, each silo
    draws its own loader's B0 for its own loop's steps, and the balancer is made from
    those first reports (X = Σ B0_i)."""
    own = {0: 8, 1: 16, 2: 24}
    nodes = {100 + i: {"partition-id": i, "num-partitions": 3} for i in range(3)}
    grid = InProcessGrid(nodes, run_config(), own_loader_app(own))
    made = []

    def balancer(initial):
        made.append(dict(initial))
        return BatchSizeManager(initial, Static())

    strategy = LoadBalancedFedAvg(min_available_nodes=3, balancing=Balancing(balancer=balancer))
    start(strategy, grid, rounds=2)
    first = [m for m in train_messages(grid) if m.content["config"][SERVER_ROUND] == 1]
    assert len(first) == 3
    for msg in first:
        assert BATCH_SIZE not in msg.content["config"]
        assert LOCAL_STEPS not in msg.content["config"]
    assert made == [{"100": 8, "101": 16, "102": 24}]  # made once, from round 1's reports
    assert strategy.manager.total == 48
    assert sent_sizes(grid)[1] == {100: 8, 101: 16, 102: 24}
    first_record, second_record = strategy.reporter.records
    assert {s.node: s.batch_size for s in first_record.silos} == {100: 8, 101: 16, 102: 24}
    # τ_i: each silo's own loop (one pass over its data at B0_i), kept in round 2
    steps = {s.node: s.local_steps for s in first_record.silos}
    assert steps[100] > steps[101] > steps[102]
    assert {s.node: s.local_steps for s in second_record.silos} == steps


def test_a_silo_with_its_own_data_file(tmp_path):
    from fedlb.data import load_digits

    digits = load_digits()
    own = tmp_path / "hospital.npz"
    np.savez(own, x=digits.x[:200], y=digits.y[:200])
    grid = make_grid()
    grid.nodes[102] = {"data-path": str(own), MODEL_SPEED: BASE / 4}
    strategy = LoadBalancedFedAvg(
        min_available_nodes=3, balancing=Balancing(batch_size=16, local_steps=3)
    )
    start(strategy, grid, rounds=2)
    record = strategy.reporter.records[-1]
    assert not record.failed
    by_node = {s.node: s for s in record.silos}
    assert by_node[102].num_examples == 160  # 200 minus the 20% it holds out
    assert by_node[102].silo == "node-102"  # no partition: named by its node


def test_a_data_file_that_does_not_fit_the_model_is_an_error_reply(tmp_path):
    wrong = tmp_path / "wrong.npz"
    np.savez(wrong, x=np.zeros((50, 3, 4), dtype=np.float32), y=np.zeros(50))
    grid = make_grid()
    grid.nodes[102] = {"data-path": str(wrong)}
    strategy = LoadBalancedFedAvg(
        min_available_nodes=3, balancing=Balancing(batch_size=16, local_steps=3)
    )
    result = start(strategy, grid, rounds=1)
    assert result.arrays is not None  # the other two silos carried the round
    failed = " ".join(strategy.reporter.records[-1].failed)
    assert "samples have shape (3, 4)" in failed
    assert "takes (1, 8, 8)" in failed


def test_four_hospitals_as_four_silos(tmp_path):
    """A tabular dataset with natural silos: heart-disease split by hospital."""
    rng = np.random.default_rng(0)
    header = (
        "id,age,sex,dataset,cp,trestbps,chol,fbs,restecg,thalch,exang,oldpeak,slope,ca,thal,num"
    )
    hospitals = ["Cleveland", "Hungary", "Switzerland", "VA Long Beach"]
    rows = [header]
    for i in range(160):
        rows.append(
            f"{i},{rng.integers(30, 75)},{rng.choice(['Male', 'Female'])},{hospitals[i % 4]},"
            f"asymptomatic,{rng.integers(100, 180)},{rng.integers(150, 300)},FALSE,normal,"
            f"{rng.integers(90, 190)},TRUE,{rng.uniform(0, 3):.1f},flat,0,normal,"
            f"{rng.integers(0, 3)}"
        )
    (tmp_path / "heart_disease_uci.csv").write_text("\n".join(rows) + "\n")
    nodes = {
        200 + i: {"partition-id": i, "num-partitions": 4, "emulated-speed": 200.0 * (i + 1)}
        for i in range(4)
    }
    settings = run_config(
        **{
            "num-silos": 4,
            "dataset": "heart-disease",
            "data-dir": str(tmp_path),
            "partition": "natural",
        }
    )
    grid = InProcessGrid(nodes, settings)
    strategy = LoadBalancedFedAvg(
        min_available_nodes=4, balancing=Balancing(batch_size=8, local_steps=3)
    )
    start(strategy, grid, rounds=2)
    record = strategy.reporter.records[-1]
    assert not record.failed
    # 160 patients, 20% held out for the server, each hospital's rest split 80/20
    examples = [s.num_examples for s in record.silos]
    assert len(examples) == 4
    assert all(20 <= n <= 32 for n in examples)
