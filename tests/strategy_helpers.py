"""Shared helpers of the LoadBalancedFedAvg tests (tests/test_flower_strategy_*.py and
the other tests that drive the strategy in-process): silos on the model clock in an
InProcessGrid, starting a run, reading the sizes and messages the server sent."""

from __future__ import annotations

import numpy as np
from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict

from fedlb.balance import BatchSizeManager, Static
from fedlb.deploy import RunConfig
from fedlb.deploy.task import federation_data, model_for
from fedlb.experiments.profiles import EmulatedClock, SpeedProfile
from fedlb.flower.protocol import BATCH_SIZE, SERVER_ROUND
from tests.flower_fakes import InProcessGrid, fedlb_app, lr_config

BASE = 500.0  # samples/s of a factor-1 silo (well above what real compute needs)


MODEL_SPEED = "model-speed"  # this file's node config key: the silo's speed on the model clock


def static(initial):
    """A balancer that never moves a size: plain FedAvg."""
    return BatchSizeManager(initial, Static())


def run_config(**overrides):
    values = {"num-silos": 3, "local-steps": 3, "batch-size": 16, "evaluate-every": 2}
    values.update(overrides)
    return values


def model_clock(context):
    """Silos on the model clock: they report t = o + τ·B/v for their node config's speed
    (exact, whatever else runs on this machine); silos without one report measured time."""
    speed = context.node_config.get(MODEL_SPEED)
    return None if speed is None else EmulatedClock("model", SpeedProfile(speed, overhead=0.02))


def make_grid(factors=(1, 2, 4), emulated=False, **overrides):
    """Silos `factors` times slower than BASE samples/s: on the model clock, or with
    emulated=True measured, each step padded with sleep to the silo's emulated speed."""
    key = "emulated-speed" if emulated else MODEL_SPEED
    nodes = {
        100 + i: {"partition-id": i, "num-partitions": len(factors), key: BASE / f}
        for i, f in enumerate(factors)
    }
    app = fedlb_app() if emulated else fedlb_app(clock=model_clock)
    return InProcessGrid(nodes, run_config(**overrides), app)


def initial_arrays(config):
    pool, _ = federation_data(config)
    return ArrayRecord(model_for(config, pool).state_dict())


def start(strategy, grid, rounds=3):
    config = RunConfig.from_mapping(grid.run_config)
    return strategy.start(
        grid=grid,
        initial_arrays=initial_arrays(config),
        num_rounds=rounds,
        timeout=30,
        train_config=lr_config(),
    )


def train_messages(grid):
    return [m for m in grid.sent if m.metadata.message_type == "train"]


def sent_sizes(grid):
    """[{node: B} of round 1, of round 2, ...]; None where no size was sent (the silo's own)"""
    by_round: dict[int, dict[int, int | None]] = {}
    for msg in train_messages(grid):
        config = msg.content["config"]
        by_round.setdefault(config[SERVER_ROUND], {})[msg.metadata.dst_node_id] = config.get(
            BATCH_SIZE
        )
    return [by_round[k] for k in sorted(by_round)]


def is_train_from(reply, node):
    return reply.metadata.src_node_id == node and reply.metadata.message_type == "train"


def with_metrics(reply, **changes):
    metrics = MetricRecord(dict(reply.content["metrics"]))
    for key, value in changes.items():
        if value is None:
            del metrics[key]
        else:
            metrics[key] = value
    return Message(
        RecordDict({"arrays": reply.content["arrays"], "metrics": metrics}),
        reply_to=_original(reply),
    )


def _original(reply):
    """A stand-in for the message `reply` answers (same ids), to build a new reply."""
    fake = Message(RecordDict(), dst_node_id=reply.metadata.src_node_id, message_type="train")
    fake.metadata.__dict__["_message_id"] = reply.metadata.reply_to_message_id
    return fake


def _arr(value):
    from flwr.app import Array

    return Array(np.asarray(value))
