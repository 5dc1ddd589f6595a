"""The messages LoadBalanced sends: the wrapped strategy's own, each given a content of its
own (FedAvg gives every message one RecordDict, and its config is the same object every
round), with a silo's orders in its ConfigRecord and, where the silo's `balance_mod()`
unpacks it, the model packed (fedlb.flower.packing); messages to silos sitting out held
back."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from logging import INFO
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict

from .composition import in_dtypes
from .grid import SiloView
from .membership import say
from .packing import LAYOUT, Layout, layout_text, pack, packable


def config_name(content: RecordDict, preferred: str | None) -> str:
    """The name of the train message's ConfigRecord (the wrapped strategy's
    `configrecord_key` where the message has it, else its first ConfigRecord, else
    "config", Flower's default, for a new one)."""
    names = list(content.config_records.keys())
    if preferred in names:
        return str(preferred)
    return names[0] if names else (preferred or "config")


def with_config(content: RecordDict, name: str, config: ConfigRecord) -> RecordDict:
    """A new RecordDict: `content`'s records, its ConfigRecord `name` replaced by
    `config` (a message's content is its own: FedAvg gives every message the same one)."""
    records: dict[str, Any] = dict(content.items())
    records[name] = config
    return RecordDict(records)


def held_back(
    messages: list[Message], view: SiloView, label: Callable[[int], str], strategy: str
) -> list[Message]:
    """The strategy's messages less those to silos sitting out (it was shown them only so
    as not to wait for them), unless that would leave none."""
    kept = [m for m in messages if m.metadata.dst_node_id not in view.sitting_out]
    held = len(messages) - len(kept)
    if not held or not kept:
        return messages
    say(
        INFO,
        "%d message(s) of %s held back: %s sitting out (missed a round, or a partition "
        "claimed twice)",
        held,
        strategy,
        ", ".join(sorted(label(n) for n in view.sitting_out)),
    )
    return kept


@dataclass
class Packing:
    """The round's model packed, and its layout (as text, for the ConfigRecord)."""

    arrays: ArrayRecord  # the model the strategy was given: what gets packed
    packed: ArrayRecord
    layout: Layout
    text: str

    @classmethod
    def of(cls, arrays: ArrayRecord, allowed: bool) -> Packing | None:
        """The packing of `arrays` where it is `allowed` and packable (float32 arrays)."""
        if not allowed or not packable(arrays):
            return None
        packed, layout = pack(arrays)
        return cls(arrays, packed, layout, layout_text(layout))

    def into(self, content: RecordDict, config: str) -> RecordDict:
        """`content` with the model (the ArrayRecord the strategy was given) packed and
        the layout in its ConfigRecord `config`."""
        names = [k for k, record in content.array_records.items() if record is self.arrays]
        if not names:
            return content
        current = content.config_records.get(config, ConfigRecord())
        out = with_config(content, config, ConfigRecord({**current, LAYOUT: self.text}))
        for name in names:
            out[name] = self.packed
        return out


def own_content(
    msg: Message,
    preferred: str | None,
    config: Callable[[ConfigRecord], ConfigRecord],
    packing: Packing | None,
) -> None:
    """Give `msg` a content of its own: its ConfigRecord (the strategy's
    `configrecord_key`, else its first) made by `config` from the strategy's, and the
    model packed where `packing` is given."""
    name = config_name(msg.content, preferred)
    made = config(msg.content.config_records.get(name, ConfigRecord()))
    content = with_config(msg.content, name, made)
    msg.content = packing.into(content, name) if packing is not None else content


def in_sent_dtypes(
    arrays: ArrayRecord,
    sent: dict[str, tuple[tuple[int, ...], str]],
    strategy_name: str,
    once: Callable[[str], bool],
) -> ArrayRecord:
    """The aggregate in the dtypes the model was `sent` in (`composition.dtypes_of`; said
    once, where `once` lets it, when the wrapped strategy returned others)."""
    if not sent:
        return arrays
    arrays, cast = in_dtypes(arrays, sent)
    if cast and once("dtypes"):
        say(
            INFO,
            "%s returned the model in other dtypes than the app's (%s%s): the silos get "
            "it in the app's, as its load_state_dict would make it; the strategy's own "
            "state keeps its precision",
            strategy_name,
            ", ".join(cast[:3]),
            ", ..." if len(cast) > 3 else "",
        )
    return arrays
