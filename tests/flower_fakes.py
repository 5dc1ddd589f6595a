"""An in-process Grid for strategy tests: messages are handled by real ClientApp handlers
(fedlb's silo functions or a test's own) in this process, no SuperLink involved."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from flwr.app import ConfigRecord, Context, Error, Message, MessageType, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid

from fedlb.deploy import evaluate_reply, train_reply
from fedlb.flower import balance_mod
from fedlb.flower.protocol import LEARNING_RATE

Handler = Callable[[Message, Context], Message]
Mod = Callable[[Message, Context, Handler], Message]  # as ClientApp(mods=...) takes them


def fedlb_app(*mods: Mod, clock=None, config=None) -> ClientApp:
    """fedlb's silo app as fedlb's client_app builds it (extra mods such as he_mod outside
    balance_mod, so that it sees plaintext models), with a silo clock, or a RunConfig
    instead of the run config."""
    app = ClientApp(mods=[*mods, balance_mod(clock)])

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        return train_reply(msg, context, config)

    @app.evaluate()
    def evaluate(msg: Message, context: Context) -> Message:
        return evaluate_reply(msg, context, config)

    return app


def lr_config(rate: float = 0.1) -> ConfigRecord:
    """The train config fedlb's ServerApp sends: its silo app's learning rate."""
    return ConfigRecord({LEARNING_RATE: rate})


class InProcessGrid(Grid):
    """Each node is a (node_config, train handler, evaluate handler); replies are computed
    at push time. `sent` keeps every pushed message; `drop` lists nodes that never reply;
    `before_round[k](grid)` runs when the server first looks for nodes after round k - 1's
    training (to change membership between rounds, or to raise: the server dying)."""

    def __init__(
        self,
        nodes: dict[int, dict],
        run_config: dict,
        train: Handler | ClientApp | None = None,
        evaluate: Handler | None = None,
    ):
        self.nodes = nodes
        self.run_config = run_config
        app = fedlb_app() if train is None else train
        self.handlers = {MessageType.TRAIN: app, MessageType.EVALUATE: evaluate or app}
        self.sent: list[Message] = []
        self.replies: dict[str, Message] = {}
        self.drop: set[int] = set()
        self.intercept: Callable[[Message], Message] | None = None  # tamper with replies
        self.before_round: dict[int, Callable[[InProcessGrid], None]] = {}
        self.trained = 0  # the last round whose train messages were pushed

    def set_run(self, run):
        pass

    @property
    def run(self):
        raise NotImplementedError

    def create_message(self, *args, **kwargs):
        raise NotImplementedError

    def get_node_ids(self) -> Iterable[int]:
        change = self.before_round.pop(self.trained + 1, None)
        if change is not None:
            change(self)
        return list(self.nodes)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        ids = []
        for msg in messages:
            if msg.metadata.message_type == MessageType.TRAIN:
                self.trained = max(self.trained, msg.content["config"]["server-round"])
            msg.metadata.__dict__["_message_id"] = msg.object_id
            self.sent.append(msg)
            ids.append(msg.metadata.message_id)
            node = msg.metadata.dst_node_id
            if node in self.drop:
                continue
            context = Context(
                run_id=1,
                node_id=node,
                node_config=dict(self.nodes[node]),
                state=RecordDict(),
                run_config=dict(self.run_config),
            )
            try:
                reply = self.handlers[msg.metadata.message_type](msg, context)
            except Exception as error:  # as Flower does: the exception becomes an error reply
                reply = Message(
                    Error(code=0, reason=f"{type(error).__name__}: {error}"), reply_to=msg
                )
            if self.intercept is not None:
                reply = self.intercept(reply)
            self.replies[msg.metadata.message_id] = reply
        return ids

    def send_and_receive(self, messages, *, timeout=None):
        return self.pull_messages(list(self.push_messages(messages)))

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return [self.replies.pop(i) for i in list(message_ids) if i in self.replies]


def record_lines(round_: int, silos: int = 2) -> list[str]:
    """rounds.jsonl's lines of a plain round `round_` of `silos` silos, as fedlb writes them."""
    from fedlb.flower import RoundRecord
    from fedlb.flower.records import SiloRound

    return RoundRecord(
        round_,
        "model",
        [
            SiloRound(f"silo-{i}", i, 16, 3, 1.0, 0.1, 1.1, 0.0, 0.5, 10, 0.0, 16)
            for i in range(silos)
        ],
        1.1,
        1.0,
        0.9,
        0.1,
        2.0,
    ).json_lines()
