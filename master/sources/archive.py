"""The input archive: every tuple the master took from its source, in arrival order, as Parquet.

It is BiStream's upstream backup (section 3.5) made durable: the checkpoint
manifest records how many archive files belong to the cut, and `control.replay`
can feed any time range of it back into a cluster.  The columns are those of
the file source, so an archive file is also valid input: ts in seconds, the float64 nearest to
the microseconds the engine holds, which the file source reads back to the same microseconds.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa

from protocol.eventtime import to_seconds
from protocol.output import NumberedFiles
from protocol.tuples import STREAM_NAMES

PREFIX = "input"


def named(prefix: str, index: int, k: int) -> str:
    """The file prefix of dispatcher `index`'s own output (late tuples, archive): several write side by side."""
    return prefix if k == 1 else f"{prefix}-d{index}"


class InputArchive(NumberedFiles):
    def __init__(self, directory: Path, flush_rows: int, prefix: str = PREFIX):
        """`prefix` names the files: several dispatchers archive their shares side by side."""
        super().__init__(directory, prefix, "parquet", flush_rows)

    def add_chunk(self, chunk) -> None:
        self.add(
            pa.table(
                {
                    "stream": np.array(STREAM_NAMES)[chunk.stream],
                    "id": chunk.id,
                    "ts": to_seconds(chunk.ts),
                    "key": chunk.key,
                    "value": chunk.value,
                }
            )
        )
