"""The model on the wire as one array: fewer objects for Flower to move.

Flower 1.42 sends a message's content as a tree of objects (the message, its RecordDict,
each record, each Array and its chunks), each pushed and pulled in its own HTTP request
at every hop: ServerApp -> SuperLink -> SuperNode -> ClientApp and back. A LeNet-5 is ~24
objects per message, ~250 requests per 3-silo round, and on a real GPU federation
(docs/benchmarks.md, one NVIDIA H100) those requests were most of the 1.4-2 s a round took
beyond the slowest silo's compute. Packed, the model is one float32 vector: ~6 objects.

The server packs what it sends (`pack`), with the layout (each array's key and shape) in
the message's ConfigRecord; fedlb's balancing mod unpacks it before the app sees the
message (the app reads its usual ArrayRecord) and packs the train reply the same way; the
server unpacks the replies before anything reads them. Only a model of float32 arrays is
packed (the common case; the flat vector keeps element-wise mods such as Flower's
clipping meaningful), never ciphertexts: anything else travels as it is.
"""

from __future__ import annotations

import json
from collections import OrderedDict

import numpy as np
from flwr.app import Array, ArrayRecord, Message, RecordDict

PACKED = "fedlb.packed"  # the one array's key in a packed ArrayRecord
LAYOUT = "fedlb.packed-layout"  # ConfigRecord: JSON [[key, [shape...]], ...]

Layout = list[tuple[str, tuple[int, ...]]]


def packable(arrays: ArrayRecord) -> bool:
    """Whether `arrays` is worth packing and can be: several float32 arrays."""
    return (
        len(arrays) > 1
        and PACKED not in arrays
        and all(str(a.dtype) == "float32" for a in arrays.values())
    )


def pack(arrays: ArrayRecord) -> tuple[ArrayRecord, Layout]:
    """(one ArrayRecord holding every array's values end to end, its layout)."""
    layout = [(key, tuple(a.shape)) for key, a in arrays.items()]
    flat = np.concatenate([a.numpy().reshape(-1) for a in arrays.values()]).astype(
        np.float32, copy=False
    )
    return ArrayRecord(OrderedDict({PACKED: Array(flat)})), layout


def layout_text(layout: Layout) -> str:
    """A layout as the LAYOUT value a ConfigRecord carries."""
    return json.dumps([[key, list(shape)] for key, shape in layout])


def read_layout(text: object) -> Layout | None:
    """A LAYOUT value as [(key, shape)], or None where it is not one."""
    if not isinstance(text, str):
        return None
    try:
        entries = json.loads(text)
        return [(str(key), tuple(int(n) for n in shape)) for key, shape in entries]
    except (ValueError, TypeError):
        return None


def unpack(record: ArrayRecord, layout: Layout) -> ArrayRecord | None:
    """The arrays `pack` packed, or None where `record` is not a packed record of that
    layout (another size, another dtype: a damaged or foreign reply, left as it is)."""
    if list(record.keys()) != [PACKED]:
        return None
    packed = record[PACKED]
    if str(packed.dtype) != "float32" or len(packed.shape) != 1:
        return None
    sizes = [int(np.prod(shape)) for _, shape in layout]
    if packed.shape[0] != sum(sizes):
        return None
    flat = packed.numpy()
    out: OrderedDict[str, Array] = OrderedDict()
    start = 0
    for (key, shape), size in zip(layout, sizes, strict=True):
        out[key] = Array(np.ascontiguousarray(flat[start : start + size].reshape(shape)))
        start += size
    return ArrayRecord(out)


def sent_layout(content: RecordDict) -> Layout | None:
    """The layout a message's ConfigRecord carries (None: its model is not packed)."""
    for config in content.config_records.values():
        if LAYOUT in config:
            return read_layout(config[LAYOUT])
    return None


def unpack_in_place(msg: Message, layout: Layout) -> bool:
    """Replace `msg`'s packed ArrayRecord by its arrays; whether it was one."""
    if msg.has_error() or not msg.has_content():
        return False
    for key, record in list(msg.content.array_records.items()):
        arrays = unpack(record, layout)
        if arrays is not None:
            msg.content[key] = arrays
            return True
    return False


def pack_in_place(msg: Message, layout: Layout) -> bool:
    """Pack `msg`'s ArrayRecord where it holds exactly `layout`'s float32 arrays."""
    if msg.has_error() or not msg.has_content():
        return False
    for key, record in list(msg.content.array_records.items()):
        shapes = [(k, tuple(a.shape)) for k, a in record.items()]
        if shapes == list(layout) and packable(record):
            msg.content[key] = pack(record)[0]
            return True
    return False
