"""The listing of rejected input rows in `rejected/`: the single file's and declared streams' (master.sources.streams)
and a Kafka stream's records (master.sources.kafka_input), written as the run passes them."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

from protocol.checkpoint import numbered
from protocol.output import NumberedFiles


class RejectedListing(NumberedFiles):
    """The rejected rows in `rejected/<prefix>-NNNNNN.*`, a file per `flush_rows` rows (or per checkpoint):
    written as the run passes them, so neither the master nor a reader holds them whole.  Counted by their column
    `reason` (a Kafka stream lists its records under a prefix of its own: master.sources.kafka_input)."""

    def __init__(self, directory: Path, fmt: str, flush_rows: int, prefix: str = "rejected"):
        super().__init__(directory, prefix, fmt, flush_rows)
        self.rows = 0  #: rejected rows listed
        self.reasons: Counter = Counter()  #: rejected rows by reason since the start or a recovery (metrics)

    def add(self, table: pa.Table) -> int:
        reason = pc.if_else(pc.starts_with(table["reason"], "duplicate id"), "duplicate id", table["reason"])
        self.reasons.update({v["values"]: v["counts"] for v in pc.value_counts(reason).to_pylist()})
        return super().add(table)

    def write(self, stem: str, table: pa.Table) -> None:
        super().write(stem, table)
        self.rows += table.num_rows

    def roll_back(self, files: int, rows: int) -> None:
        """Back to a checkpoint: its first `files` files (`rows` rows) stay, the later ones are written again."""
        for number, f in numbered(self.directory, self.prefix):
            if number >= files:
                f.unlink()
        self.files, self.rows, self.parts, self.waiting = files, rows, [], 0
        self.reasons.clear()
