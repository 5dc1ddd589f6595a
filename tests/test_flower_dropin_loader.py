"""The drop-in's balanced loader on Flower's apps (tests/apps), in-process: at its own
batch size it draws the app's own batches, it keeps the app's loader and times its steps,
a carried stream goes on across rounds through the context's state, emulated speeds come
by partition id from the run config, and without balance_mod it says what to add."""

from __future__ import annotations

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict

from fedlb.flower import balance_mod, balanced_loader
from fedlb.flower.protocol import BATCH_SIZE, COMPUTE_S, LOCAL_STEPS, PARTITION_ID, PROTOCOL
from tests.apps.adopt import adopt, app_config, imported


@pytest.mark.usefixtures("task_identity")
def test_at_its_own_batch_size_the_loader_draws_the_apps_own_batches(tmp_path):
    """Round 1 (no orders: B = the loader's 32, τ = len(loader)) of the quickstart's own
    train handler, stock and adopted, from the same torch seed: the same batches, so the
    same model bits and the same train loss."""
    replies = {}
    for balanced in (False, True):
        app, _ = adopt("quickstart_pytorch", tmp_path / str(balanced), balanced=balanced)
        config = app_config(app)
        with imported(app) as modules:
            torch.manual_seed(0)
            weights = ArrayRecord(modules["task"].Net().state_dict())
            message = Message(
                RecordDict({"arrays": weights, "config": ConfigRecord({"lr": 0.1, PROTOCOL: 1})}),
                dst_node_id=1,
                message_type="train",
            )
            context = Context(1, 1, {"partition-id": 1, "num-partitions": 3}, RecordDict(), config)
            torch.manual_seed(7)
            replies[balanced] = modules["client_app"].app(message, context)
    stock, adopted = replies[False].content, replies[True].content
    assert adopted["metrics"]["train_loss"] == stock["metrics"]["train_loss"]
    assert adopted["metrics"][LOCAL_STEPS] == 12  # ceil(383 / 32): the last batch short
    for key, array in stock["arrays"].items():
        assert (array.numpy() == adopted["arrays"][key].numpy()).all(), key


@pytest.mark.usefixtures("task_identity")
def test_balanced_loader_keeps_the_loader_and_times_the_steps():
    from torch.utils.data import DataLoader, TensorDataset

    data = TensorDataset(torch.arange(100.0).unsqueeze(1), torch.zeros(100, dtype=torch.long))
    collated: list[int] = []

    def collate(batch):
        collated.append(len(batch))
        return torch.utils.data.default_collate(batch)

    loader = DataLoader(data, batch_size=10, shuffle=True, collate_fn=collate)
    message = Message(
        RecordDict({"config": ConfigRecord({BATCH_SIZE: 7, PROTOCOL: 1})}),
        dst_node_id=1,
        message_type="train",
    )

    def handler(msg: Message, context: Context) -> Message:
        balanced = balanced_loader(msg, loader)
        assert len(balanced) == 10
        assert balanced.dataset is data
        seen = [x for _ in range(2) for (x, _) in balanced]  # two passes of 10 steps
        # 100 samples at 7: 14 full batches and a short one end the epoch, as the app's
        # own loader ends it; the second pass runs on into the next epoch.
        assert [len(x) for x in seen] == [7] * 14 + [2] + [7] * 5
        assert sorted(int(i) for x in seen[:15] for i in x) == list(range(100))
        return Message(RecordDict({"metrics": MetricRecord({"own": 1})}), reply_to=msg)

    reply = balance_mod()(message, Context(1, 1, {"partition-id": 4}, RecordDict(), {}), handler)
    metrics = reply.content["metrics"]
    assert metrics["own"] == 1
    assert metrics[BATCH_SIZE] == 7
    assert metrics[LOCAL_STEPS] == 20
    assert metrics[PARTITION_ID] == 4
    assert metrics[COMPUTE_S] > 0
    assert collated == [7] * 14 + [2] + [7] * 5  # the app's own collate_fn drew every batch


@pytest.mark.usefixtures("task_identity")
def test_a_carried_stream_goes_on_across_rounds_through_the_contexts_state():
    """balanced_loader(msg, loader, context): the batch stream lives in context.state (which
    Flower keeps per run on the SuperNode), so round 2 goes on where round 1 stopped, at
    round 2's batch size; each pass over the data ends with a short batch (FLamby's stream).
    Without it, round 2 starts a fresh epoch."""
    from torch.utils.data import DataLoader, TensorDataset

    data = TensorDataset(torch.arange(10), torch.zeros(10, dtype=torch.long))
    loader = DataLoader(data, batch_size=4, shuffle=True)
    state = RecordDict()  # the SuperNode's, across the run's messages

    def round_of(batch_size: int, steps: int, carry: bool, server_round: int) -> list[list[int]]:
        message = Message(
            RecordDict(
                {
                    "config": ConfigRecord(
                        {
                            BATCH_SIZE: batch_size,
                            LOCAL_STEPS: steps,
                            "server-round": server_round,
                            PROTOCOL: 1,
                        }
                    )
                }
            ),
            dst_node_id=1,
            message_type="train",
        )
        drawn: list[list[int]] = []

        def handler(msg: Message, context: Context) -> Message:
            balanced = balanced_loader(msg, loader, context if carry else None)
            drawn.extend(x.tolist() for x, _ in balanced)
            return Message(RecordDict({"metrics": MetricRecord({"own": 1})}), reply_to=msg)

        balance_mod()(message, Context(1, 1, {"partition-id": 0}, state, {}), handler)
        return drawn

    torch.manual_seed(0)
    first = round_of(4, 5, carry=True, server_round=1)
    assert [len(b) for b in first] == [4, 4, 2, 4, 4]
    torch.manual_seed(1)  # a new round reseeds: the carried epoch goes on, the next is new
    second = round_of(3, 3, carry=True, server_round=2)
    assert [len(b) for b in second] == [2, 3, 3]  # epoch 2's last 2, then epoch 3 at B=3
    epoch_2 = first[3] + first[4] + second[0]
    assert sorted(epoch_2) == list(range(10))
    assert sorted(i for batch in first[:3] for i in batch) == list(range(10))
    fresh = round_of(4, 3, carry=False, server_round=3)
    assert [len(b) for b in fresh] == [4, 4, 2]


@pytest.mark.parametrize(
    ("listed", "partition", "expected"),
    [
        ("400,200,100", 2, 100.0),
        ("", 2, 0.0),  # declared but empty: real speed
        ("400,oops", 0, "must list samples/s per partition-id"),
        ("400,200", 2, "no entry for this silo's partition-id 2"),
        ("400,-1", 1, "must be a number >= 0"),
        ("400,inf", 1, "must be finite"),
    ],
)
def test_emulated_speeds_by_partition_id_from_the_run_config(listed, partition, expected):
    from fedlb.flower.protocol import read_emulation

    node, run = {"partition-id": partition}, {"fedlb-emulated-speeds": listed}
    if isinstance(expected, float):
        assert read_emulation(node, run).speed == expected
    else:
        with pytest.raises(ValueError, match=expected):
            read_emulation(node, run)
    assert read_emulation({"partition-id": 0, "emulated-speed": 7.0}, {}).speed == 7.0


@pytest.mark.usefixtures("task_identity")
def test_balanced_loader_without_the_mod_says_what_to_add():
    from torch.utils.data import DataLoader, TensorDataset

    loader = DataLoader(TensorDataset(torch.zeros(4, 1)), batch_size=2)
    with pytest.raises(RuntimeError, match=r"ClientApp\(mods=\[balance_mod\(\)\]\)"):
        balanced_loader(Message(RecordDict(), dst_node_id=1, message_type="train"), loader)
