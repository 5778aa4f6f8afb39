"""The unit every source hands the master, a Chunk of tuples as whole numpy columns in arrival order, and
what a source is (`Source`).

Shared by the file, generator, declared-streams and ZeroMQ sources and the producer, so none of them imports
another.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import NamedTuple

import numpy as np


class Chunk(NamedTuple):
    stream: np.ndarray  # int8, STREAM_R / STREAM_S
    id: np.ndarray  # int64
    ts: np.ndarray  # int64 event time in microseconds (protocol.eventtime), converted once on input
    key: np.ndarray  # int64
    value: np.ndarray  # float64
    terms: np.ndarray  # int64 (n, words): a query's terms of each tuple (protocol.condition); words 0 without


def no_terms(n: int) -> np.ndarray:
    """The terms of n tuples of a run whose query has none (or no query)."""
    return np.zeros((n, 0), np.int64)


def terms_columns(terms: np.ndarray | None) -> dict[str, np.ndarray]:
    """Terms as a table's columns term0, term1, ... (a checkpoint's tables hold flat columns)."""
    return {} if terms is None else {f"term{i}": np.ascontiguousarray(terms[:, i]) for i in range(terms.shape[1])}


def terms_of(table) -> np.ndarray:
    """The terms `terms_columns` put in an Arrow table."""
    count = sum(name.startswith("term") for name in table.column_names)
    if not count:
        return no_terms(table.num_rows)
    return np.stack([table[f"term{i}"].to_numpy() for i in range(count)], axis=1).astype(np.int64)


class InputError(Exception):
    """User mistake in the input; the message names file, row and column."""


class InputLost(InputError):
    """Input the run had not read is gone where it was kept (a Kafka partition's records deleted below the stream's
    position): a restart would meet the same hole, so the job stops with its own exit code (protocol.lifetime)."""


class InputRewound(ConnectionError):
    """A Kafka partition now ends below what a running stream has read: the broker lost records it had acknowledged
    (a crash before it saved them, an unclean leader election).  Reading on would take the records written there
    next for them; a restart resumes from the newest complete checkpoint, whose offsets the broker may still hold
    (if not, that recovery stops with InputLost), so the job ends as a crash (an error of the environment), which
    the supervisor restarts."""


def empty() -> Chunk:
    return Chunk(
        np.empty(0, np.int8),
        np.empty(0, np.int64),
        np.empty(0, np.int64),
        np.empty(0, np.int64),
        np.empty(0, np.float64),
        no_terms(0),
    )


def concat(parts: list[Chunk]) -> Chunk:
    parts = [p for p in parts if len(p.ts)] or parts[:1]  # an empty chunk's terms may be narrower
    if not parts:
        return empty()
    if len(parts) == 1:
        return parts[0]
    return Chunk(*(np.concatenate(cols) for cols in zip(*parts)))


def rows(c: Chunk, a: int, b: int | None = None) -> Chunk:
    """Tuples a..b of `c` (views, no copy)."""
    return Chunk(*(col[a:b] for col in c))


class Source:
    """What the master takes tuples from.  Everything a source can do besides `next_chunk` is declared here
    with what a source that cannot do it answers, so the master asks and never probes; a source that can
    overrides it."""

    #: rows or messages set aside, by reason (a file's bad rows, a live source's bad messages): metrics
    reasons: MappingProxyType = MappingProxyType({})
    #: rows a query's filter dropped where they were read, by stream (R, S): summary and metrics
    filtered: MappingProxyType = MappingProxyType({})
    #: live messages refused for want of the token, by kind (END, TUPLES): metrics
    refused: MappingProxyType = MappingProxyType({})
    #: declared streams: the payload log holding the rows' own columns (protocol.payload.PayloadLog)
    log = None
    #: the input ran out but its end is held back for a test's fault (master.sources.HeldEnd)
    holding = False

    def next_chunk(self, limit: int) -> Chunk | None:
        """At most `limit` tuples in arrival order (none yet: an empty Chunk, live sources only); None when
        exhausted."""
        raise NotImplementedError

    def finish(self) -> dict:
        """Release what the source holds after the run; returns entries for summary.json."""
        return {}

    def position(self) -> dict | None:
        """Where it stands, for a checkpoint to `seek` back to; None: it is rewound by reading it again."""
        return None

    def seek(self, where: dict) -> None:
        """Go back to a `position`."""
        raise NotImplementedError(f"{type(self).__name__} has no position to go back to")

    def records(self) -> list[np.ndarray]:
        """Arrays of the last `position` that a checkpoint's part holds beside it (`seek` finds them in
        `where["records"]`)."""
        return []

    def acknowledge(self, position: dict | None) -> None:
        """A checkpoint holding everything up to `position` is complete (live producers may drop it)."""

    def ended(self) -> list[bool]:
        """Per stream (R, S): every tuple of it has been taken (declared streams end one by one)."""
        return [False, False]

    def partitions(self) -> list[dict]:
        """Partitioned live streams (Kafka topics), per partition: stream, topic, partition, records and bytes
        read, lag: metrics."""
        return []

    #: declared streams, per side: every row below this one has been taken (its payload may go)
    rows_taken: tuple | list = (0, 0)
    #: declared streams: each dispatcher numbers and logs its own rows (Kafka partitions shared out), so each
    #: removes its own payload segments (master.state.payload)
    own_rows = False

    @staticmethod
    def merge(finished: list[dict]) -> dict:
        """The summary entries of several dispatchers' shares of the source (`finish` of each, dispatcher 0's
        first)."""
        return finished[0]


def rewind(source: Source, n: int, position: dict | None = None) -> None:
    """Bring a fresh `source` to a checkpoint's place: its `position` if it has one, else read and drop its
    first `n` tuples (sources are deterministic)."""
    if position is not None:
        source.seek(position)
        return
    while n > 0:
        chunk = source.next_chunk(min(n, 1 << 20))
        if chunk is None:
            raise InputError(f"the input ends {n:,} tuples before the checkpoint's position: is it the same input?")
        n -= len(chunk.ts)
