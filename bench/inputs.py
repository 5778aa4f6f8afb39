"""The bench's input files: the generated workload written once as Parquet, long enough for the rates run, kept
in a cache folder between runs and between bench invocations (a run counts toward a capacity only
if its input lasts at least `bench.search.MIN_INPUT_SECONDS` at its rate, so at millions of tuples per second the
files hold hundreds of millions of tuples, and generating them costs minutes).

A file is named by its generator config (the workload's keys and its event-time length) and the generator's code,
so runs of the same workload share it.  The lengths come from a ladder: the workload's own duration times LADDER^k, the
shortest rung that holds the tuples a run needs, so a few files serve every rate and a run lasts 1 to LADDER times its
minimum.  Files are written streamed, chunk by chunk, in row groups: memory stays bounded whatever the size.
The cache deletes only what it wrote (a folder of its naming holding its `meta.json`), least recently used
first, once it holds more than its limit.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import time
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from protocol.plan import Generator, load_plan
from protocol.eventtime import to_seconds
from protocol.tuples import STREAM_NAMES
from common import workload
from common.workload import GeneratorSource

LADDER = math.sqrt(2)  #: file lengths are the workload's duration times LADDER^k
HEADROOM = 1.01  #: a rung must hold this many times the tuples needed (the counts are Poisson)
CHUNK_ROWS = 1 << 20  #: rows generated and written at a time: one row group each
FILE, META = "input.parquet", "meta.json"
DEFAULT_DIR = Path("bench-data")
DEFAULT_LIMIT_GB = 40.0  #: --data-limit: the cache deletes its least recently used files above this


def expected_tuples(gen: Generator) -> float:
    """Tuples the generator config makes on average: both streams at `rate` each for `duration` seconds."""
    return 2 * gen.rate * gen.duration


def rung(base_duration: float, rate_per_stream: float, tuples: float) -> float:
    """The event-time length of the shortest ladder file (base_duration x LADDER^k, k >= 0) that holds
    HEADROOM x `tuples` on average."""
    need = HEADROOM * tuples / (2 * rate_per_stream)
    k = max(0, math.ceil(math.log(need / base_duration, LADDER) - 1e-9)) if need > base_duration else 0
    return round(base_duration * LADDER**k, 3)


def write_input(gen: Generator, path: Path, rows: int | None = None) -> int:
    """The generator's tuples as an input file (the file source's columns: stream, id, ts in seconds, key, value)
    at `path`, written CHUNK_ROWS at a time as row groups, under a temporary name renamed at the end (an
    interrupted write leaves no file that looks whole).  `rows`: stop after that many (the generator must make
    at least as many).  Returns the rows written."""
    src = GeneratorSource(gen)
    tmp = path.with_name(f".{path.name}.tmp")
    names = pa.array(list(STREAM_NAMES))
    written, writer = 0, None
    try:
        while (rows is None or written < rows) and (c := src.next_chunk(CHUNK_ROWS)) is not None:
            n = len(c.id) if rows is None else min(len(c.id), rows - written)
            stream = pa.DictionaryArray.from_arrays(pa.array(c.stream[:n].astype(np.int32)), names).cast(pa.string())
            table = pa.table(
                {"stream": stream, "id": c.id[:n], "ts": to_seconds(c.ts[:n]), "key": c.key[:n], "value": c.value[:n]}
            )
            if writer is None:  # dictionary encoding for the stream names only, as protocol.output writes them
                writer = pq.ParquetWriter(tmp, table.schema, use_dictionary=["stream"])
            writer.write_table(table, row_group_size=CHUNK_ROWS)
            written += n
    finally:
        if writer is not None:
            writer.close()
    if rows is not None and written < rows:
        tmp.unlink(missing_ok=True)
        raise ValueError(f"the generator made {written:,} tuples, fewer than the {rows:,} asked for")
    os.replace(tmp, path)
    return written


class InputCache:
    """Input files by generator config in `directory` (created), at most `limit_bytes` of them (0 = no limit)."""

    def __init__(self, directory: Path, limit_bytes: float = 0):
        self.directory, self.limit = Path(directory), limit_bytes
        self.used: dict[str, dict] = {}  #: the files this bench used, by path: their meta (for the report)

    def folder(self, gen: Generator) -> Path:
        """Named by the generator config and the generator's code: a changed generator makes new files, so the
        cluster never reads tuples other than those the kernel limit and the peer generate."""
        key = json.dumps(asdict(gen), sort_keys=True).encode() + Path(workload.__file__).read_bytes()
        return self.directory / hashlib.sha1(key).hexdigest()[:16]

    def file(self, settings: list[str], tuples: float = 0) -> Path:
        """The input file of the workload `settings`, long enough for `tuples` (0: the workload's own length):
        from the cache, or generated and kept there."""
        gen = load_plan(None, settings).generator
        if tuples > expected_tuples(gen):
            gen = replace(gen, duration=rung(gen.duration, gen.rate, tuples))
        folder = self.folder(gen)
        meta_path = folder / META
        if meta_path.exists():
            meta = json.loads(meta_path.read_text())
            meta["generated"] = False
            os.utime(meta_path)  # recently used: evicted last
        else:
            folder.mkdir(parents=True, exist_ok=True)
            print(
                f"bench: generating {expected_tuples(gen):,.0f} tuples into {folder / FILE} (kept for later runs)",
                flush=True,
            )
            began = time.monotonic()
            n = write_input(gen, folder / FILE)
            meta = {
                "generator": asdict(gen),
                "tuples": n,
                "bytes": (folder / FILE).stat().st_size,
                "generate_seconds": round(time.monotonic() - began, 1),
            }
            meta_path.write_text(json.dumps(meta, indent=1))
            meta["generated"] = True
        path = str(folder / FILE)
        self.used.setdefault(path, {"path": path, **meta})
        self.evict(keep={folder})
        return folder / FILE

    def owned(self) -> list[Path]:
        """The cache's own folders: a 16-hex name holding its meta.json (nothing else is ever deleted)."""
        if not self.directory.is_dir():
            return []
        return [
            d
            for d in self.directory.iterdir()
            if d.is_dir()
            and len(d.name) == 16
            and all(c in "0123456789abcdef" for c in d.name)
            and (d / META).is_file()
        ]

    def evict(self, keep: set[Path]) -> list[Path]:
        """Delete the least recently used folders (not in `keep`) while the cache holds more than its limit."""
        if not self.limit:
            return []
        size = lambda d: sum(f.stat().st_size for f in d.iterdir() if f.is_file())
        folders = sorted(self.owned(), key=lambda d: (d / META).stat().st_mtime)
        total, gone = sum(map(size, folders)), []
        for d in folders:
            if total <= self.limit:
                break
            if d in keep:
                continue
            total -= size(d)
            for f in (d / FILE, d / f".{FILE}.tmp", d / META):
                f.unlink(missing_ok=True)
            with contextlib.suppress(OSError):  # something else in it: the folder stays
                d.rmdir()
            gone.append(d)
        return gone
