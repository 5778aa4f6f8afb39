"""Orders between dispatchers (BiStream 3.2.3; master.coordination says what each is for): kinds, fields, and
their encoding.

An order is one byte buffer: an int64 with its kind, then its fields as strict JSON (protocol.strict_json),
each kind with exactly its own fields (`FIELDS`).  Orders carry no tuple data: moves, checkpoint parts and
positions, key ranges, how far the payload log is done with, hot keys' fences and sketch counters.
"""

from __future__ import annotations

import enum
import json

import numpy as np

from protocol.strict_json import json_text


class Order(enum.IntEnum):
    HOLD = 1  #: rank 0 -> the others: hold partition-group `partition`, moving from `supplier` to `consumer`
    READY = 2  #: -> rank 0: my batches to both slaves of the move of `partition` are joined; my watermark `cap`
    RELEASE = 3  #: rank 0 -> the others: `partition` is installed at its consumer: send its held tuples there
    CHECKPOINT = 4  #: rank 0 -> the others: take your part of checkpoint `id`
    SNAPSHOT = 5  #: -> rank 0: my part of checkpoint `id` is written: its files (`part`), my state (`master`)
    DONE = 6  #: -> rank 0: my input is exhausted and joined
    FINISH = 7  #: rank 0 -> the others: every dispatcher is done: stop the slaves
    COMMITTED = 8  #: rank 0 -> a dispatcher: a checkpoint holding your `source` position is complete
    RANGES = 9  #: rank 0 -> the others: the key ranges' `bounds` every dispatcher routes by (band, less joins)
    PAYLOAD = 10  #: -> rank 0: the watermark my batches are done with, and the rows I have `taken` per side
    PRUNE = 11  #: rank 0 -> the others (each writes its own rows' payload): remove your segments `below` per side
    HOT_HOLD = 12  #: rank 0 -> the others: hold hot `key`'s groups for its split (`split`) or merge on slave `owner`
    HOT_READY = (
        13  #: -> rank 0: my batches to the owner of hot `key`'s split or merge, sent before its hold, are joined
    )
    HOT_RELEASE = 14  #: rank 0 -> the others: the owner split or merged `key`: route it by the new grid, or none
    SKETCH = 15  #: -> rank 0: my frequent-keys counters (`keys`, `counts`) over the `seen` keys since the last


#: each kind's fields, all of them, and no others
FIELDS: dict[Order, tuple[str, ...]] = {
    Order.HOLD: ("partition", "supplier", "consumer", "reason"),
    Order.READY: ("partition", "cap"),
    Order.RELEASE: ("partition",),
    Order.CHECKPOINT: ("id",),
    Order.SNAPSHOT: ("id", "part", "master"),
    Order.DONE: (),
    Order.FINISH: (),
    Order.COMMITTED: ("source",),
    Order.RANGES: ("bounds",),
    Order.PAYLOAD: ("watermark", "taken"),
    Order.PRUNE: ("below",),
    Order.HOT_HOLD: ("key", "split", "partition", "owner", "first", "count"),
    Order.HOT_READY: ("key",),
    Order.HOT_RELEASE: ("key",),
    Order.SKETCH: ("keys", "counts", "seen"),
}


def encode(kind: Order, **fields) -> np.ndarray:
    """The order as one uint8 buffer; ValueError if `fields` are not exactly its kind's."""
    if set(fields) != set(FIELDS[kind]):
        raise ValueError(f"{kind.name} carries {sorted(FIELDS[kind])}, not {sorted(fields)}")
    body = json_text(fields).encode()
    return np.concatenate([np.array([int(kind)], dtype=np.int64).view(np.uint8), np.frombuffer(body, np.uint8)])


def decode(buf: np.ndarray) -> tuple[Order, dict]:
    """Inverse of `encode`: (kind, fields)."""
    kind = Order(int(buf[:8].view(np.int64)[0]))
    fields = json.loads(buf[8:].tobytes())
    if set(fields) != set(FIELDS[kind]):
        raise ValueError(f"a {kind.name} order with fields {sorted(fields)}, not {sorted(FIELDS[kind])}")
    return kind, fields
