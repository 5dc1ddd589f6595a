"""The silo side: what a ClientApp does with a train or evaluate message.

`train_reply` and `evaluate_reply` are plain functions of (message, context), so they can
serve fedlb's own ClientApp (client_app.py) and anybody's: see docs/flower.md.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict

from fedlb.training import (
    EmulatedSpeed,
    Pace,
    ResizableBatchSampler,
    ResourceProbe,
    evaluate,
    tensor_dataset,
    train_steps,
)

from .config import RunConfig
from .task import SiloData, model_for, silo_data, silo_data_from_file

log = logging.getLogger("fedlb.flower")

NODE_KEYS = {"partition-id": int, "num-partitions": int, "emulated-speed": float, "threads": int}


class SiloConfigError(ValueError):
    """A node config the silo cannot run with."""


@dataclass(frozen=True)
class NodeSettings:
    """What a SuperNode's --node-config says about its silo."""

    partition_id: int | None  # its part of the federation's dataset (or just its label)
    num_partitions: int | None
    data_path: str | None  # its own data file instead of a partition
    emulated_speed: float  # samples/s to emulate; 0: real speed
    threads: int  # torch threads; 0: torch's default


def node_settings(node_config: Mapping[str, Any]) -> NodeSettings:
    """Check and read the SuperNode's node config."""
    for key, kind in NODE_KEYS.items():
        if key in node_config:
            value = node_config[key]
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise SiloConfigError(f"node config {key} must be a number, got {value!r}")
            if kind is int and not float(value).is_integer():
                raise SiloConfigError(f"node config {key} must be a whole number, got {value!r}")
    data_path = node_config.get("data-path")
    if data_path is not None and (not isinstance(data_path, str) or not data_path):
        raise SiloConfigError(f"node config data-path must be a file path, got {data_path!r}")
    has_partition = "partition-id" in node_config and "num-partitions" in node_config
    if data_path is None and not has_partition:
        raise SiloConfigError(
            "node config needs partition-id and num-partitions (e.g. --node-config "
            "'partition-id=0 num-partitions=3') or data-path; got " + repr(dict(node_config))
        )
    if has_partition and not 0 <= node_config["partition-id"] < node_config["num-partitions"]:
        raise SiloConfigError(
            f"node config partition-id {node_config['partition-id']} is outside 0.."
            f"{node_config['num-partitions'] - 1}: num-partitions is "
            f"{node_config['num-partitions']} (partition ids count from 0)"
        )
    speed = float(node_config.get("emulated-speed", 0.0))
    if not math.isfinite(speed) or speed < 0:
        raise SiloConfigError(f"node config emulated-speed must be >= 0, got {speed}")
    threads = int(node_config.get("threads", 0))
    if threads < 0:
        raise SiloConfigError(f"node config threads must be >= 0, got {threads}")
    partition = node_config.get("partition-id")
    count = node_config.get("num-partitions")
    return NodeSettings(
        partition_id=None if partition is None else int(partition),
        num_partitions=None if count is None else int(count),
        data_path=data_path,
        emulated_speed=speed,
        threads=threads,
    )


class SiloClock(Protocol):
    """Emulated time for one silo (fedlb.experiments provides them): `pace` slows its steps
    (measured clock), `fixed_cost` is slept as its fixed cost, `report` says which
    (compute-s, overhead-s) to report (the model clock's, or the measured ones)."""

    @property
    def name(self) -> str: ...

    def pace(self, server_round: int) -> Pace | None: ...

    def fixed_cost(self, server_round: int) -> float: ...

    def report(
        self, server_round: int, batch_size: int, steps: int, compute_s: float, fixed_s: float
    ) -> tuple[float, float]: ...


def _silo(
    context: Context, config: RunConfig | None = None
) -> tuple[RunConfig, SiloData, NodeSettings]:
    config = config or RunConfig.from_mapping(context.run_config)
    node = node_settings(context.node_config)
    if node.threads > 0:
        # Several silos sharing one machine (a demo, a test) would oversubscribe its cores.
        import torch

        torch.set_num_threads(node.threads)
    if node.data_path is not None:
        data = silo_data_from_file(config, node.data_path)
    else:
        assert node.partition_id is not None
        assert node.num_partitions is not None
        data = silo_data(config, node.partition_id, node.num_partitions)
    return config, data, node


def _config_value(msg: Message, key: str, kind: type) -> Any:
    config = next(iter(msg.content.config_records.values()))
    if key not in config:
        raise SiloConfigError(f"the server's message has no {key}")
    value = config[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise SiloConfigError(f"the server sent {key}={value!r}, not a finite number")
    if kind is int and not float(value).is_integer():
        raise SiloConfigError(f"the server sent {key}={value!r}, not a whole number")
    return kind(value)


def _config_flag(msg: Message, key: str) -> bool:
    config = next(iter(msg.content.config_records.values()))
    return config.get(key) is True


def train_reply(
    msg: Message,
    context: Context,
    config: RunConfig | None = None,
    clock: SiloClock | None = None,
) -> Message:
    """Train τ steps at the batch size and learning rate the server sent; reply with the
    weights and the metrics the balancer needs.

    `config` replaces the run config (Flower's simulation passes none); `clock` emulates
    this silo's speed for experiments (it takes precedence over node-config emulation).
    """
    probe = ResourceProbe()
    config, data, node = _silo(context, config)
    speed = node.emulated_speed
    batch_size = _config_value(msg, "batch-size", int)
    steps = _config_value(msg, "local-steps", int)
    lr = _config_value(msg, "learning-rate", float)
    server_round = _config_value(msg, "server-round", int)

    start = time.perf_counter()
    model = model_for(config, data.train)
    model.load_state_dict(next(iter(msg.content.array_records.values())).to_torch_state_dict())
    evaluation: dict[str, float | int] = {}
    if _config_flag(msg, "evaluate") and len(data.test):
        # The server asks for the incoming global model's evaluation with this update:
        # a fixed per-round cost of this silo, so it is timed as one.
        loss, accuracy = evaluate(model, tensor_dataset(data.test.x, data.test.y))
        evaluation = {"eval-loss": loss, "eval-acc": accuracy, "eval-examples": len(data.test)}
    fixed = time.perf_counter() - start

    dataset = tensor_dataset(data.train.x, data.train.y)
    # Each round draws a fresh, reproducible stream of batches.
    sampler = ResizableBatchSampler(
        dataset,
        batch_size,
        seed=config.seed * 1_000_003 + (node.partition_id or 0) * 1009 + server_round,
    )
    result = train_steps(
        model,
        dataset,
        sampler,
        steps,
        lr,
        config.momentum,
        pace=clock.pace(server_round)
        if clock is not None
        else (EmulatedSpeed(speed) if speed > 0 else None),
    )

    start = time.perf_counter()
    arrays = ArrayRecord(model.state_dict())
    fixed += time.perf_counter() - start
    compute = result.compute_s
    if clock is not None:
        time.sleep(clock.fixed_cost(server_round))
        fixed += clock.fixed_cost(server_round)
        compute, fixed = clock.report(server_round, batch_size, steps, compute, fixed)
    resources = probe.sample()
    metrics = MetricRecord(
        {
            "num-examples": len(data.train),
            "batch-size": batch_size,
            "local-steps": steps,
            "compute-s": compute,
            "overhead-s": fixed,
            "cpu": resources.cpu,
            "mem": resources.mem,
            "train-loss": result.loss,
            **({} if node.partition_id is None else {"partition-id": node.partition_id}),
            "emulated-speed": speed,
            **({"model-clock": 1} if clock is not None and clock.name == "model" else {}),
            **evaluation,
        }
    )
    if speed > 0 and result.real_compute_s > result.compute_s * 0.999:
        log.warning(
            "silo %s cannot keep up with its emulated speed %.0f samples/s",
            node.partition_id,
            speed,
        )
    return Message(RecordDict({"arrays": arrays, "metrics": metrics}), reply_to=msg)


def evaluate_reply(msg: Message, context: Context, config: RunConfig | None = None) -> Message:
    """Evaluate the global model on this silo's held-out split."""
    config, data, _ = _silo(context, config)
    if len(data.test) == 0:
        raise SiloConfigError("this silo has no held-out samples: raise silo-test-fraction")
    model = model_for(config, data.test)
    model.load_state_dict(next(iter(msg.content.array_records.values())).to_torch_state_dict())
    loss, accuracy = evaluate(model, tensor_dataset(data.test.x, data.test.y))
    metrics = MetricRecord(
        {"num-examples": len(data.test), "eval-loss": loss, "eval-acc": accuracy}
    )
    return Message(RecordDict({"metrics": metrics}), reply_to=msg)
