"""The output layout both roles write into: `results/`, `late/`, `rejected/`, `archive/`, `aggregates/`,
`metrics/`, `metrics.prom`, `summary.json`.

Files are written whole through pyarrow (Parquet or CSV); a file is first
written under a temporary name and then renamed, so a reader never sees half a
file.
"""

from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from protocol import faults

#: the `kind` of a row of a join other than inner (defined beside the join types, which the wire reads too)
from protocol.predicates import LEFT_MATCHED, LEFT_UNMATCHED, MATCHED, RIGHT_UNMATCHED  # noqa: F401

RESULT_COLUMNS = ("r_id", "s_id", "r_key", "s_key", "r_ts", "s_ts", "r_value", "s_value", "delay")
#: Their types; no result has a missing value, and Parquet writes required columns without the per-value
#: definition levels of nullable ones (a third less time per row, measured on 500,000 result rows).
RESULT_SCHEMA = pa.schema(
    [pa.field(c, pa.int64() if c.endswith(("_id", "_key")) else pa.float64(), nullable=False) for c in RESULT_COLUMNS]
)

#: The results of a join other than inner: the same columns, nullable (the missing side's are null), and `kind`
OUTER_RESULT_SCHEMA = pa.schema(
    [pa.field(c, RESULT_SCHEMA.field(c).type, nullable=c != "delay") for c in RESULT_COLUMNS]
    + [pa.field("kind", pa.string(), nullable=False)]
)


def empty_table(schema: pa.Schema) -> pa.Table:
    """A table of `schema` without rows (pyarrow's Schema.empty_table imports pandas: a third of a second of a
    rank's first batch)."""
    return pa.Table.from_batches([], schema)


def result_schema(join_type: str) -> pa.Schema:
    """The single file's result columns for a join of `join_type`."""
    return RESULT_SCHEMA if join_type == "inner" else OUTER_RESULT_SCHEMA


OUTPUT_PARTS = (
    "results",
    "late",
    "rejected",
    "archive",
    "aggregates",
    "metrics",
    "metrics.prom",
    "summary.json",
    "keys.parquet",
    "keys.csv",
    "payload",
    "kafka-sink.json",
)
#: the Kafka sink's run id (its transactional.id and its markers' name), kept across recoveries (master.sink)
SINK_RUN = "kafka-sink.json"
#: the parts that are single files (keys.*: the key dictionary earlier versions wrote)
FILE_PARTS = {"metrics.prom", "summary.json", "keys.parquet", "keys.csv", SINK_RUN}
#: the files this engine writes in those folders (and their temporaries `.NAME.tmp`): result and partial
#: aggregate files of a slave, late tuples and the input archive of a dispatcher, rejected input (a file's
#: listing, a ZeroMQ source's, a Kafka stream's; each dispatcher's own), the metrics log
OWN_FILE = re.compile(
    r"\.?(slave-\d{3}-\d{6}|(late|input)(-d\d+)?-\d{6}|(zmq-)?rejected(-d\d+|-[RS])?"
    r"|(kafka-rejected-[RS]-|rejected-)(d\d+-)?\d{6}"
    r"|samples-\d{8}T\d{6}-\d{6})\.(parquet|csv)(\.tmp)?"
    r"|\.?(\d{12,}-\d{12,}|schema)\.arrow(\.\d+\.tmp)?"
)  # the payload log's (protocol.payload)
OWN_FOLDERS = {"aggregates/_pending", "payload/R", "payload/S"}  #: folders inside the parts that are the engine's own


class OutputError(Exception):
    """The output folder holds what this engine did not write where it must write: it refuses to start rather
    than delete a user's file or mix its results with it."""


def foreign_files(root: Path) -> list[Path]:
    """What lies where this engine writes (its parts of `root`) and was not written by it."""
    found = []
    for part in OUTPUT_PARTS:
        target = root / part
        if part in FILE_PARTS:
            if target.exists() and not target.is_file():
                found.append(target)
            continue
        if target.exists() and not target.is_dir():
            found.append(target)
            continue
        stack = [target] if target.is_dir() else []
        while stack:
            for f in stack.pop().iterdir():
                if f.is_dir() and str(f.relative_to(root)) in OWN_FOLDERS:
                    stack.append(f)
                elif not (f.is_file() and OWN_FILE.fullmatch(f.name)):
                    found.append(f)
    return sorted(found)


def check_owned(root: Path) -> None:
    """Raise OutputError if anything this engine did not write lies where it writes."""
    foreign = foreign_files(root)
    if foreign:
        shown = ", ".join(str(f) for f in foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
        raise OutputError(
            f"output.path: {shown} {'is' if len(foreign) == 1 else 'are'} not written by this engine "
            "but lie where it writes its output: move them away or choose another output.path (the "
            "engine removes only the files it wrote)"
        )


def reset_output(path: str | Path) -> int:
    """Remove what an earlier run wrote in `path`: the engine's own files only (OWN_FILE in its parts, the
    summary).  Anything else there (a user's file, an input placed in `results/`) is an OutputError and nothing
    is removed.  Returns the files removed."""
    root = Path(path)
    check_owned(root)
    removed = 0
    for part in OUTPUT_PARTS:
        target = root / part
        if target.is_file():
            target.unlink()
            removed += 1
        elif target.is_dir():
            own = sorted(target.rglob("*"), key=lambda f: -len(f.parts))  # files before their folders
            for f in own:
                if f.is_dir():
                    f.rmdir()
                else:
                    f.unlink()
                    removed += 1
            target.rmdir()
    root.mkdir(parents=True, exist_ok=True)
    return removed


def write_table(directory: str | Path, stem: str, table: pa.Table, fmt: str) -> Path:
    """Write `table` as `directory/stem.{parquet,csv}` atomically; returns the path."""
    d = Path(directory)
    final = d / f"{stem}.{fmt}"
    tmp = d / f".{stem}.{fmt}.tmp"
    try:
        faults.fail("write")
        d.mkdir(parents=True, exist_ok=True)
        if fmt == "parquet":  # dictionary encoding for strings only: on ids, keys and times it tripled the write time
            strings = [f.name for f in table.schema if pa.types.is_string(f.type) or pa.types.is_large_string(f.type)]
            pq.write_table(table, tmp, use_dictionary=strings)
        else:
            pacsv.write_csv(table, tmp)
        os.replace(tmp, final)
    except OSError as e:  # Arrow's message names no file: the operator needs the path (a full disk, a read-only folder)
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise OSError(e.errno, f"cannot write {final}: {e.strerror or e}") from e
    return final


class NumberedFiles:
    """Tables gathered and written as numbered files, `directory/prefix-NNNNNN.fmt`, one once `flush_rows` rows
    are in (or when flushed: at a checkpoint's cut, at the end).  `files` counts them: a checkpoint records it
    as its commit and a recovery sets it back, so a restarted run numbers on and writes each file again under
    its name.  Result files, partial aggregates, late tuples, rejected rows and the input archive all go out
    this way."""

    def __init__(self, directory: str | Path, prefix: str, fmt: str, flush_rows: float):
        self.directory, self.prefix, self.fmt, self.flush_rows = Path(directory), prefix, fmt, flush_rows
        self.files = 0
        self.parts: list[pa.Table] = []
        self.waiting = 0  #: rows gathered, not written yet

    def add(self, table: pa.Table) -> int:
        """Gather `table`; returns the files written (0 or 1)."""
        self.parts.append(table)
        self.waiting += table.num_rows
        return self.flush() if self.waiting >= self.flush_rows else 0

    def flush(self) -> int:
        """Write what is gathered as the next file; returns the files written (0 or 1)."""
        if not self.parts:
            return 0
        self.write(f"{self.prefix}-{self.files:06d}", self.merged(self.parts))
        self.parts, self.waiting = [], 0
        self.files += 1
        return 1

    def merged(self, parts: list[pa.Table]) -> pa.Table:
        """The gathered tables as one file's table."""
        return pa.concat_tables(parts)

    def write(self, stem: str, table: pa.Table) -> None:
        write_table(self.directory, stem, table, self.fmt)


def read_tables(directory: str | Path, columns: list[str] | None = None) -> pa.Table | None:
    """All Parquet/CSV files of one output folder as one table (None if there are none); only `columns` are
    read if given."""
    d = Path(directory)
    if not d.is_dir():
        return None
    parts = []
    for f in sorted(d.iterdir()):
        if f.suffix == ".parquet":
            parts.append(pq.read_table(f, columns=columns))
        elif f.suffix == ".csv":
            parts.append(pacsv.read_csv(f, convert_options=pacsv.ConvertOptions(include_columns=columns)))
    if not parts:
        return None
    return pa.concat_tables(parts, promote_options="default")
