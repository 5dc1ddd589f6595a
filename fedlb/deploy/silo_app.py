"""The silo side: what a ClientApp does with a train or evaluate message.

`train_reply` and `evaluate_reply` are plain functions of (message, context), so they can
serve fedlb's own ClientApp (client_app.py) and anybody's: see docs/flower.md.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from torch.utils.data import DataLoader

from fedlb.flower import balanced_loader
from fedlb.flower.protocol import (
    EVAL_ACC,
    EVAL_EXAMPLES,
    EVAL_LOSS,
    LEARNING_RATE,
    NODE_DATA_PATH,
    NODE_DEVICE,
    NODE_EMULATED_CURVE,
    NODE_EMULATED_SPEED,
    NODE_NUM_PARTITIONS,
    NODE_PARTITION_ID,
    NODE_THREADS,
    TRAIN_LOSS,
    Orders,
    read_emulation,
    sent_config,
)
from fedlb.training import (
    DeviceError,
    choose_device,
    evaluate,
    step_curve,
    tensor_dataset,
    train_epoch,
)

from .model_cache import cpu_state, resident_model
from .run_config import RunConfig
from .task import SiloData, silo_data, silo_data_from_file

log = logging.getLogger("fedlb.flower")

NODE_KEYS = {
    NODE_PARTITION_ID: int,
    NODE_NUM_PARTITIONS: int,
    NODE_EMULATED_SPEED: float,
    NODE_THREADS: int,
}


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
    device: str = "auto"  # where it trains (HE stays on the CPU)
    emulated_curve: str = ""  # a step-time curve to emulate ("NAME", "NAME*K"); '' : none


def node_settings(node_config: Mapping[str, Any]) -> NodeSettings:
    """Check and read the SuperNode's node config."""
    for key, kind in NODE_KEYS.items():
        if key in node_config:
            value = node_config[key]
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise SiloConfigError(f"node config {key} must be a number, got {value!r}")
            if kind is int and not float(value).is_integer():
                raise SiloConfigError(f"node config {key} must be a whole number, got {value!r}")
    data_path = node_config.get(NODE_DATA_PATH)
    if data_path is not None and (not isinstance(data_path, str) or not data_path):
        raise SiloConfigError(f"node config data-path must be a file path, got {data_path!r}")
    has_partition = NODE_PARTITION_ID in node_config and NODE_NUM_PARTITIONS in node_config
    if data_path is None and not has_partition:
        raise SiloConfigError(
            "node config needs partition-id and num-partitions (e.g. --node-config "
            "'partition-id=0 num-partitions=3') or data-path; got " + repr(dict(node_config))
        )
    partition = node_config.get(NODE_PARTITION_ID)
    count = node_config.get(NODE_NUM_PARTITIONS)
    if partition is not None and count is not None and not 0 <= partition < count:
        raise SiloConfigError(
            f"node config partition-id {partition} is outside 0..{count - 1}: num-partitions "
            f"is {count} (partition ids count from 0)"
        )
    speed = float(node_config.get(NODE_EMULATED_SPEED, 0.0))
    if not math.isfinite(speed) or speed < 0:
        raise SiloConfigError(f"node config emulated-speed must be >= 0, got {speed}")
    curve = node_config.get(NODE_EMULATED_CURVE, "")
    if not isinstance(curve, str):
        raise SiloConfigError(f"node config {NODE_EMULATED_CURVE} must name a curve, got {curve!r}")
    if curve.strip():
        try:
            step_curve(curve)
        except ValueError as error:
            raise SiloConfigError(f"node config {NODE_EMULATED_CURVE}: {error}") from error
        if speed > 0:
            raise SiloConfigError(
                f"node config has both emulated-speed {speed:g} and {NODE_EMULATED_CURVE} "
                f"{curve!r}: a silo emulates a speed or a step-time curve, not both"
            )
    threads = int(node_config.get(NODE_THREADS, 0))
    if threads < 0:
        raise SiloConfigError(f"node config threads must be >= 0, got {threads}")
    device = node_config.get(NODE_DEVICE, "auto")
    if not isinstance(device, str):
        raise SiloConfigError(f"node config {NODE_DEVICE} must be a string, got {device!r}")
    try:
        choose_device(device)  # refused here, before any round, where there is no such GPU
    except DeviceError as error:
        raise SiloConfigError(f"node config {NODE_DEVICE}: {error}") from error
    return NodeSettings(
        partition_id=None if partition is None else int(partition),
        num_partitions=None if count is None else int(count),
        data_path=data_path,
        emulated_speed=speed,
        threads=threads,
        device=device,
        emulated_curve=curve.strip(),
    )


def _check_curve(context: Context, config: RunConfig) -> None:
    """A step-time curve is one model's: emulating it for another would time that model
    as this one. Refused before the silo trains (the round's reply names why)."""
    try:
        name = read_emulation(context.node_config, context.run_config).curve
        curve = step_curve(name) if name else None
    except ValueError as error:
        raise SiloConfigError(str(error)) from error
    if curve is not None and curve.model != config.model:
        raise SiloConfigError(
            f"this silo emulates the step-time curve {curve.name}, measured on model "
            f"{curve.model}, but the run trains {config.model}: give it a {config.model} "
            "curve, or run that model"
        )


def _silo(
    context: Context, config: RunConfig | None = None
) -> tuple[RunConfig, SiloData, NodeSettings]:
    config = config or RunConfig.from_mapping(context.run_config)
    node = node_settings(context.node_config)
    _check_curve(context, config)
    if node.num_partitions is not None and node.num_partitions != config.num_silos:
        # Another split of the data than the other silos': overlapping, or missing parts.
        raise SiloConfigError(
            f"this silo has num-partitions {node.num_partitions}, but the run has num-silos "
            f"{config.num_silos}: restart it with --num-partitions {config.num_silos}"
        )
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


def _device(node: NodeSettings) -> torch.device:
    """The silo's training device; a GPU becomes the current CUDA device, so that the
    balanced loader's step timing waits for the work queued on it."""
    device = choose_device(node.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


def train_reply(msg: Message, context: Context, config: RunConfig | None = None) -> Message:
    """Train at the batch size and for the steps the server sent (through
    `balanced_loader`: `balance_mod()` must be among the ClientApp's mods) with the run's
    learning rate and momentum; reply with the weights, the dataset size and the loss.

    `config` replaces the run config (Flower's simulation passes none)."""
    config, data, node = _silo(context, config)
    sent = sent_config(msg)
    orders = Orders.read(sent)
    lr = sent.get(LEARNING_RATE)
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not math.isfinite(lr) or lr <= 0:
        raise SiloConfigError(f"the server sent {LEARNING_RATE}={lr!r}, not a finite number > 0")

    device = _device(node)
    weights = next(iter(msg.content.array_records.values())).to_torch_state_dict()
    with resident_model(config, data.train, device, weights) as model:
        return _train(msg, context, config, data, node, orders, lr, device, model)


def _train(
    msg: Message,
    context: Context,
    config: RunConfig,
    data: SiloData,
    node: NodeSettings,
    orders: Orders,
    lr: float,
    device: torch.device,
    model: torch.nn.Module,
) -> Message:
    """train_reply's round with the global model loaded on `device`."""
    evaluation: dict[str, float | int] = {}
    if orders.evaluate_first and len(data.test):
        # The server asks for the incoming global model's evaluation with this update:
        # a fixed per-round cost of this silo (balance_mod times it as one).
        loss, accuracy = evaluate(model, tensor_dataset(data.test.x, data.test.y), device=device)
        evaluation = {EVAL_LOSS: loss, EVAL_ACC: accuracy, EVAL_EXAMPLES: len(data.test)}

    dataset = tensor_dataset(data.train.x, data.train.y)
    # Each round draws a fresh, reproducible stream of batches (or, carried, continues the
    # stream whose seed round 1 drew).
    torch.manual_seed(
        config.seed * 1_000_003 + (node.partition_id or 0) * 1009 + orders.server_round
    )
    carry = context if config.batch_stream == "carried" else None
    loader = balanced_loader(
        msg, DataLoader(dataset, batch_size=config.batch_size, shuffle=True), carry
    )
    train_loss = train_epoch(model, loader, lr, config.momentum, device=device)
    # the update travels (and is encrypted) from host memory; the model stays on its device
    # for the next message this process serves (fedlb.deploy.model_cache)
    update = ArrayRecord(cpu_state(model))
    metrics = MetricRecord({"num-examples": len(data.train), TRAIN_LOSS: train_loss, **evaluation})
    return Message(RecordDict({"arrays": update, "metrics": metrics}), reply_to=msg)


def evaluate_reply(msg: Message, context: Context, config: RunConfig | None = None) -> Message:
    """Evaluate the global model on this silo's held-out split."""
    config, data, node = _silo(context, config)
    if len(data.test) == 0:
        raise SiloConfigError("this silo has no held-out samples: raise silo-test-fraction")
    device = _device(node)
    weights = next(iter(msg.content.array_records.values())).to_torch_state_dict()
    with resident_model(config, data.test, device, weights) as model:
        loss, accuracy = evaluate(model, tensor_dataset(data.test.x, data.test.y), device=device)
    metrics = MetricRecord({"num-examples": len(data.test), EVAL_LOSS: loss, EVAL_ACC: accuracy})
    return Message(RecordDict({"metrics": metrics}), reply_to=msg)
