"""The ingest desk's shell (master/state/intake.py): the source read, the late files and the input archive.

The desk says how many tuples are due and judges and routes the chunk; this
takes the chunk from the source, writes the late tuples it set aside with
their own columns (`late/late[-dK]-NNNNNN.*`, declared streams' columns from
the payload log) and, with checkpoints, archives every chunk taken; the
source's position and the files' counts are its part of a checkpoint.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import sys

import numpy as np
import pyarrow as pa

from common.chunks import rewind
from master.sources.archive import InputArchive, named
from master.state.intake import Archive, IngestDesk, SetAside
from protocol import eventtime
from protocol.output import NumberedFiles
from protocol.payload import payload_reader
from protocol.tuples import STREAM_NAMES, STREAM_R, STREAM_S

if TYPE_CHECKING:
    from protocol.plan import Plan


class IntakeShell:
    def __init__(self, plan: Plan, source, index: int, k: int):
        self.plan, self.source = plan, source
        out = plan.output.path
        self.payload = payload_reader(plan)  #: declared streams: where late rows find their own columns
        self.stream_names = np.array([s.name for s in plan.streams])  #: late rows' `stream` column
        self.late = NumberedFiles(out / "late", named("late", index, k), plan.output.format, plan.output.flush_rows)
        ck = plan.checkpoint
        self.archive = (
            InputArchive(out / "archive", plan.output.flush_rows, named("input", index, k))
            if ck.enabled and ck.archive
            else None
        )

    def pull(self, desk: IngestDesk, now: float, slot: bool = False, cap: int | None = None) -> int:
        """What the desk says is due, taken from the source and handed to it; returns the tuples taken."""
        limit = desk.due(now, self.source.ended() if desk.streams else None, slot, cap)
        return desk.take(self.source.next_chunk(limit), limit, now) if limit > 0 else 0

    def perform(self, effect: SetAside | Archive) -> None:
        if isinstance(effect, Archive):
            self.archive.add_chunk(effect.chunk)
            return
        self.late.add(
            pa.table(
                {
                    **self._late_columns(effect.chunk, effect.late),
                    "reason": effect.reason,
                    "bound": eventtime.to_seconds(effect.bound),
                }
            )
        )

    def _late_columns(self, chunk, late: np.ndarray) -> dict:
        """The late tuples as the user gave them: the engine's fields, or with declared streams the stream's name
        and both streams' own columns (the other stream's null) from the payload log."""
        stream = chunk.stream[late]
        if self.payload is None:
            return {
                "stream": np.array(STREAM_NAMES)[stream],
                "id": chunk.id[late],
                "ts": eventtime.to_seconds(chunk.ts[late]),
                "key": chunk.key[late],
                "value": chunk.value[late],
            }
        rows = chunk.id[late]
        table = self.payload.both(np.where(stream == STREAM_R, rows, -1), np.where(stream == STREAM_S, rows, -1))
        return {"stream": self.stream_names[stream], **dict(zip(table.column_names, table.columns))}

    def flush(self) -> None:
        """Write the late tuples and the archive held so far (a checkpoint's cut, the end of the run)."""
        self.late.flush()
        if self.archive is not None:
            self.archive.flush()

    def committed(self, m: dict) -> None:
        """A checkpoint holding this dispatcher's part `m` is complete: a source that acknowledges says so."""
        self.source.acknowledge(m["source"])

    def state(self) -> dict:
        """Its part of a checkpoint (after `flush`)."""
        return {
            "source": self.source.position(),
            "late_files": self.late.files,
            "archive_files": self.archive.files if self.archive else 0,
        }

    def records(self) -> list[np.ndarray]:
        """The source's arrays of its position in the last `state` (the checkpoint's part holds them)."""
        return self.source.records()

    def restore(self, m: dict, records: list[np.ndarray] = ()) -> None:
        """Resume at the checkpoint's source position (with its arrays `records`): a ZeroMQ source takes each
        producer's position (what a producer resends from there is taken again; what it cannot resend is counted
        as lost)."""
        if self.plan.source.kind == "zmq":
            print(
                'recover: source.kind = "zmq": producers that resend (control.produce with --ack-endpoint) '
                "repeat what they sent after the checkpoint; what others sent after it is lost and counted "
                "(zmq_ingest.lost_tuples)",
                file=sys.stderr,
                flush=True,
            )
            if m["source"] is not None:  # None: a checkpoint of a version without producer positions
                self.source.seek(m["source"])
        else:
            where = m.get("source")
            rewind(self.source, m["consumed"], {**where, "records": list(records)} if records else where)
        self.late.files = m["late_files"]
        if self.archive is not None:
            self.archive.files = m["archive_files"]
