"""The master's buffer: per stream, one mini-buffer per partition (paper 003, IV-B, Figure 3).

Tuples are hash-partitioned into mini-buffers as whole batches; at its slot a
slave receives the drained mini-buffers of exactly its partitions, so draining
never scans the tuples of other slaves.  Chunks are held as opaque fixed-size
records (numpy void) so that joining thousands of small chunks is a plain memory
copy, without numpy's per-array field promotion for structured dtypes.
"""

from __future__ import annotations

import numpy as np

from protocol.arrays import label_order, records, take_rows
from protocol.tuples import partition_of


class MiniBuffers:
    def __init__(self, partitions: int, dtype: np.dtype):
        self.partitions, self.dtype = partitions, dtype
        self._chunks: list[list[list[np.ndarray]]] = [[[] for _ in range(partitions)] for _ in range(2)]
        self.counts = np.zeros((2, partitions), dtype=np.int64)  #: buffered tuples per stream and partition
        #: per partition, the drain that last emptied it (`together`); distinct until one does
        self.drained = -1 - np.arange(partitions)
        self._drains = 0

    def __len__(self) -> int:
        return int(self.counts.sum())

    def add(self, stream: int, rows: np.ndarray, part: np.ndarray | None = None) -> None:
        """Partition `rows` (one stream, arrival order) into the mini-buffers, keeping order inside each;
        `part` gives each row's partition (default: its key's hash partition)."""
        if len(rows) == 0:
            return
        if part is None:
            part = partition_of(rows["key"], self.partitions)
        order, sizes = self.order(part)
        self.add_ordered(stream, take_rows(rows, order), sizes)

    def order(self, part: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(the stable order that groups rows by partition, the rows per partition) for partitions `part`."""
        return label_order(part, self.partitions), np.bincount(part, minlength=self.partitions)

    def add_ordered(self, stream: int, rows: np.ndarray, sizes: np.ndarray) -> None:
        """Append `rows`, already grouped by partition in partition order (`order`), `sizes[p]` rows of each p:
        the master builds the rows of its common case in that order, so they are not gathered twice."""
        pieces = np.split(records(rows), np.cumsum(sizes)[:-1])
        chunks = self._chunks[stream]
        for p in np.flatnonzero(sizes).tolist():
            chunks[p].append(pieces[p])
        self.counts[stream] += sizes

    def oldest_arrival(self, partitions: np.ndarray) -> float:
        """The earliest arrival stamp among the tuples buffered for `partitions` (inf if none).  Every chunk
        holds its rows in arrival order, so only each chunk's first record is read, not the tuples."""
        heads = [c[:1] for chunks in self._chunks for p in partitions.tolist() for c in chunks[p]]
        return float(np.concatenate(heads).view(self.dtype)["arrival"].min()) if heads else np.inf

    def drain(
        self, partitions: np.ndarray, out: tuple[np.ndarray, np.ndarray] | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """Remove and return (R, S) tuples buffered for `partitions`; into `out` (R rows, S rows of exactly
        the sizes `counts` gives, e.g. a message's body) if given."""
        res = []
        self.emptied(partitions)
        for stream in range(2):
            chunks = self._chunks[stream]
            taken = [c for p in partitions.tolist() for c in chunks[p]]
            for p in partitions.tolist():
                chunks[p] = []
            self.counts[stream, partitions] = 0
            if out is not None:
                if taken:
                    np.concatenate(taken, out=records(out[stream]))
                res.append(out[stream])
            else:
                res.append(np.concatenate(taken).view(self.dtype) if taken else np.empty(0, dtype=self.dtype))
        return res[0], res[1]

    def emptied(self, partitions) -> None:
        """`partitions` are empty now, together (drained, or a hot key's new sub-groups)."""
        self._drains += 1
        self.drained[partitions] = self._drains

    def together(self, partitions: range) -> bool:
        """Whether `partitions` were last emptied together or hold nothing: then a tuple added to several of them
        at once has either left all of them or none."""
        part = slice(partitions.start, partitions.stop)
        return bool((self.drained[part] == self.drained[partitions.start]).all() or not self.counts[:, part].any())

    def take_key(self, partition: int, key: int) -> tuple[np.ndarray, np.ndarray]:
        """Remove and return (R, S) rows of `key` buffered for `partition` (a key that became hot is re-routed)."""
        out = []
        for stream in range(2):
            chunks = self._chunks[stream][partition]
            rows = np.concatenate(chunks).view(self.dtype) if chunks else np.empty(0, dtype=self.dtype)
            mine = rows["key"] == key
            rest = rows[~mine]
            self._chunks[stream][partition] = [records(rest)] if len(rest) else []
            self.counts[stream, partition] = len(rest)
            out.append(rows[mine])
        return out[0], out[1]

    def snapshot(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(R, S) rows buffered now, partition by partition in arrival order, and the rows per stream and
        partition, without draining (checkpoints): a row's partition is not always its key's hash partition (key
        ranges copy R rows, hot keys route to grids), so a restore must not derive it again."""
        out = []
        for stream in range(2):
            taken = [c for chunks in self._chunks[stream] for c in chunks]
            out.append(np.concatenate(taken).view(self.dtype) if taken else np.empty(0, dtype=self.dtype))
        return out[0], out[1], self.counts.copy()

    def restore(self, r: np.ndarray, s: np.ndarray, counts: np.ndarray) -> None:
        """Put back what `snapshot` returned, each row in the partition it was buffered for."""
        for stream, rows in ((0, r), (1, s)):
            self.add_ordered(stream, rows, counts[stream])
