"""The drop-in: a standard Flower PyTorch app (written as Flower's template writes it)
made load-balanced with a strategy swap and three lines in its train handler."""

from __future__ import annotations

import time

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from torch import nn
from torch.utils.data import TensorDataset

from fedlb.flower import LoadBalancedFedAvg, LocalRound
from tests.flower_fakes import InProcessGrid

pytestmark = pytest.mark.usefixtures("task_identity")


# ---- the user's app, as in Flower's PyTorch template -----------------------------------
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Sequential(nn.Linear(20, 32), nn.ReLU(), nn.Linear(32, 3))

    def forward(self, x):
        return self.fc(x)


def load_data(partition_id: int):
    generator = torch.Generator().manual_seed(partition_id)
    x = torch.randn(300, 20, generator=generator)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()
    return TensorDataset(x, y)


def train_fn(net, batches, lr, seconds_per_sample):
    """The app's own training loop (plus a sleep standing in for slower hardware)."""
    optimiser = torch.optim.SGD(net.parameters(), lr=lr)
    total = 0.0
    count = 0
    for x, y in batches:
        optimiser.zero_grad()
        loss = nn.functional.cross_entropy(net(x), y)
        loss.backward()
        optimiser.step()
        time.sleep(seconds_per_sample * len(y))
        total += loss.item()
        count += 1
    return total / count


def train(msg: Message, context: Context) -> Message:
    model = Net()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    trainset = load_data(context.node_config["partition-id"])
    # -- the drop-in: train τ steps at the server's batch size, timed -------------------
    with LocalRound(msg, trainset) as local:
        loss = train_fn(
            model, local.loader, local.learning_rate, context.node_config["seconds-per-sample"]
        )
    metrics = {"train_loss": loss, "num-examples": len(trainset), **local.metrics()}
    # ------------------------------------------------------------------------------------
    content = RecordDict(
        {"arrays": ArrayRecord(model.state_dict()), "metrics": MetricRecord(metrics)}
    )
    return Message(content=content, reply_to=msg)


def evaluate(msg: Message, context: Context) -> Message:
    model = Net()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    data = load_data(100 + context.node_config["partition-id"])
    with torch.no_grad():
        accuracy = float((model(data.tensors[0]).argmax(1) == data.tensors[1]).float().mean())
    metrics = MetricRecord({"num-examples": len(data), "eval-acc": accuracy, "eval-loss": 0.0})
    return Message(RecordDict({"metrics": metrics}), reply_to=msg)


# ---- the test --------------------------------------------------------------------------
def test_a_standard_flower_app_becomes_load_balanced():
    # seconds per sample, speeds 4 : 2 : 1; large enough that real compute is noise next to it
    slow = {100: 0.002, 101: 0.004, 102: 0.008}
    nodes = {
        n: {"partition-id": i, "seconds-per-sample": s} for i, (n, s) in enumerate(slow.items())
    }
    grid = InProcessGrid(nodes, {}, train, evaluate)
    strategy = LoadBalancedFedAvg(  # instead of FedAvg(...)
        batch_size=24, local_steps=4, learning_rate=0.1, min_available_nodes=3
    )
    result = strategy.start(
        grid=grid,
        initial_arrays=ArrayRecord(Net().state_dict()),
        num_rounds=3,
        timeout=30,
        train_config=ConfigRecord(),
    )
    sizes = strategy.current_sizes()
    assert sum(sizes.values()) == 72
    assert sizes[100] > sizes[101] > sizes[102]
    assert sizes[100] / sizes[102] == pytest.approx(4, rel=0.35)
    assert result.arrays is not None
    records = strategy.reporter.records
    assert records[-1].efficiency > 0.8
    assert all(not r.rejected for r in records)


def test_local_round_refuses_a_server_that_is_not_load_balanced():
    msg = Message(
        RecordDict({"config": ConfigRecord({"server-round": 1})}),
        dst_node_id=1,
        message_type="train",
    )
    with pytest.raises(ValueError, match="no usable 'batch-size'"):
        LocalRound(msg, load_data(0))
