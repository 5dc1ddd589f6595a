"""fedlb's silo ClientApp. Flower starts a fresh process per message, so this module
imports only what a train or evaluate message needs."""

from __future__ import annotations

from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from fedlb.flower import balance_mod, he_mod

from .silo_app import evaluate_reply, train_reply

# The HE mod is a pass-through unless the node config names an `he-context`. Outside the
# balancing mod, it hands that mod plaintext models (so the silo can report its update's
# norm for the server's StabilityGuard) and adds its own seconds to the fixed cost.
app = ClientApp(mods=[he_mod(), balance_mod()])


@app.train()
def train(msg: Message, context: Context) -> Message:
    return train_reply(msg, context)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    return evaluate_reply(msg, context)
