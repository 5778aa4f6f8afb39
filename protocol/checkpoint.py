"""Checkpoints of the whole cluster: layout, atomic parts, the manifest written last, and the choice on recovery.

A checkpoint is a consistent cut (Chandy-Lamport): the master waits until no
batch and no partition-group is in flight, snapshots its own state, and orders
every slave to write its window state (several dispatchers each snapshot and
send a marker; a slave writes once it has all markers: master.coordination); no
message crosses the cut, so every pair is produced either before it (its
results are in the committed result files) or after it (from state and input
that the checkpoint holds).  BiStream (section 3.5) keeps upstream backup for
the same purpose; here the source is rewound to the checkpoint's position.

    <checkpoint.path>/ckpt-000007/
        master.state     mini-buffer contents (R rows, S rows, rows per stream and partition), then a source's
                         arrays if it has any (Kafka streams: keys, rows read ahead); master-d1.state ...
        slave-001.state  every partition-group of slave 1 (slave.mover.encode_group buffers)
        ...
        MANIFEST.json    written last: a checkpoint without it does not exist

Every part is a container of byte records: int64 [MAGIC, n, len_1..len_n],
then the records.  The manifest names each part with its size in bytes, its
record count and the tuples it holds, so a checker can verify it.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import numpy as np

from protocol.access import public
from protocol.strict_json import json_text

MAGIC = 0x53544A4E434B5031  #: "STJNCKP1"
MANIFEST = "MANIFEST.json"
#: 3: tuples carry ts in int64 microseconds (protocol.eventtime), the master's part each row's partition;
#: 4: a dispatcher's section names its channels' sequence numbers "seq" (was "epoch");
#: 5: a group's rows are followed by their matched flags (outer joins);
#: 6: a dispatcher's section holds the lateness state (per stream with [streams]) instead of max_ts,
#: and a declared stream's tuples carry their stream row (the payload log's reference) as id;
#: a master part may hold a source's arrays (Arrow IPC streams) after its three records (Kafka streams)
FORMAT = 6
#: config sections a checkpoint is tied to: resuming with other values would join other data or other pairs
BINDING_SECTIONS = ("cluster", "source", "streams", "generator", "join", "partitioning", "tuning")
#: keys of those sections that say how the cluster runs, not what it joins: free to change on a recovery
UNBOUND_KEYS = {("cluster", "heartbeat_timeout"), ("cluster", "network"), ("cluster", "ports")}
#: a Kafka stream's keys that say what to do when records were deleted before they were read, not what is joined:
#: a recovery that stopped on such a hole may go on past it (streams.NAME.kafka.on_lost = "skip")
UNBOUND_KAFKA_KEYS = {"on_lost"}


class CheckpointError(Exception):
    """A checkpoint is missing a part, is half written, or does not fit the run that wants to resume from it."""


def name_of(ckpt_id: int) -> str:
    return f"ckpt-{ckpt_id:06d}"


def master_part(dispatcher: int) -> str:
    """Rank 0's mini-buffers, or another dispatcher's (cluster.dispatchers > 1)."""
    return "master.state" if dispatcher == 0 else f"master-d{dispatcher}.state"


def slave_part(rank: int) -> str:
    return f"slave-{rank:03d}.state"


def write_atomic(path: Path, data) -> int:
    """Write bytes (or a buffer) under a temporary name, fsync, rename; returns the size."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(memoryview(data))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path.stat().st_size


def pack(records: list[np.ndarray]) -> np.ndarray:
    """Byte records as one container buffer."""
    head = np.array([MAGIC, len(records), *(len(r) for r in records)], dtype=np.int64).view(np.uint8)
    return np.concatenate([head, *[np.asarray(r).view(np.uint8) for r in records]])


def unpack(buf: np.ndarray, where: str) -> list[np.ndarray]:
    """Inverse of `pack`; `where` names the part in errors."""
    if len(buf) < 16 or buf[:8].view(np.int64)[0] != MAGIC:
        raise CheckpointError(f"{where}: not a checkpoint part (bad magic or too short)")
    n = int(buf[8:16].view(np.int64)[0])
    if n < 0 or len(buf) < 16 + 8 * n:
        raise CheckpointError(f"{where}: header names {n} records but the part has {len(buf)} bytes")
    sizes = buf[16 : 16 + 8 * n].view(np.int64)
    ends = 16 + 8 * n + np.cumsum(sizes)
    if (sizes < 0).any() or (n and ends[-1] != len(buf)):
        raise CheckpointError(f"{where}: record sizes do not add up to the part's {len(buf)} bytes")
    starts = np.concatenate([[16 + 8 * n], ends[:-1]]).astype(np.int64)
    return [buf[a:b] for a, b in zip(starts.tolist(), ends.tolist())]


#: A slave part's records are partition-groups as slave.mover.encode_group writes them: int64 head [partition,
#: global depth, directory entries, buckets, next bucket id], the directory entries, per bucket [id, local depth,
#: R rows, S rows], then the rows, then a matched flag (uint8) per row, padded to whole 8-byte words.
#: Decoded here so a checker (control.checkpoints) needs no slave code.
GROUP_HEAD = 5


def group_layout(buf: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """(head, directory entries, bucket table [id, local depth, R rows, S rows], byte offset of the rows)."""
    n_entries, n_buckets = (int(x) for x in buf[16:32].view(np.int64))
    ints = buf[: (GROUP_HEAD + n_entries + 4 * n_buckets) * 8].view(np.int64)
    table = ints[GROUP_HEAD + n_entries :].reshape(-1, 4)
    return ints[:GROUP_HEAD], ints[GROUP_HEAD : GROUP_HEAD + n_entries], table, len(ints) * 8


def group_partition(buf: np.ndarray) -> int:
    """The partition-group a slave part's record holds."""
    return int(buf[:8].view(np.int64)[0])


def part_tuples(name: str, data: bytes, size: int) -> int:
    """Tuples held by one part: the master's mini-buffer rows (records of `size` bytes: protocol.plan.Plan.dtype),
    or the sum over a slave's group states."""
    records = unpack(np.frombuffer(data, dtype=np.uint8), name)
    if name.startswith("master"):  # R rows, S rows, the rows per stream and partition (then a source's arrays)
        if len(records) < 3 or any(len(r) % size for r in records[:2]):
            raise CheckpointError(f"{name}: not R rows, S rows and partition counts of {size}-byte tuples")
        counts = int(records[2].view(np.int64).sum())
        rows = sum(len(r) // size for r in records[:2])
        if counts != rows:
            raise CheckpointError(f"{name}: {rows} rows, but its partition counts add up to {counts}")
        return rows
    return sum(int(group_layout(r)[2][:, 2:].sum()) for r in records)


def table_records(tables: list) -> list[np.ndarray]:
    """Arrow tables as byte records of a part (an IPC stream each): a source's arrays after the mini-buffers.
    (pyarrow is imported here: the checkpoint check's Spark workers load this module without it.)"""
    import pyarrow as pa

    out = []
    for table in tables:
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
        out.append(np.frombuffer(sink.getvalue(), np.uint8))
    return out


def record_tables(records: list[np.ndarray]) -> list:
    """Inverse of `table_records`."""
    import pyarrow as pa

    return [pa.ipc.open_stream(pa.py_buffer(np.ascontiguousarray(r))).read_all() for r in records]


def read_part(path: Path) -> list[np.ndarray]:
    return unpack(np.fromfile(path, dtype=np.uint8), str(path))


def write_manifest(directory: Path, manifest: dict) -> None:
    """Strict JSON (protocol.strict_json): no NaN or Infinity, which most parsers refuse (event times are
    integers here, their sentinels too: protocol.eventtime)."""
    manifest = {"format": FORMAT, "created": time.time(), **manifest}
    write_atomic(directory / MANIFEST, json_text(manifest, indent=1, sort_keys=True).encode())


def load_manifest(directory: Path) -> dict:
    """The manifest of a complete checkpoint, after checking that every part it names is there in full."""
    path = directory / MANIFEST
    if not path.is_file():
        raise CheckpointError(f"{directory}: no {MANIFEST} (the checkpoint was not completed)")
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path}: format {manifest.get('format')!r}, this version reads {FORMAT}")
    for name, part in manifest["parts"].items():
        f = directory / name
        if not f.is_file():
            raise CheckpointError(f"{directory}: part {name} named by the manifest is missing")
        if f.stat().st_size != part["bytes"]:
            raise CheckpointError(f"{f}: {f.stat().st_size} bytes, the manifest says {part['bytes']}")
    return manifest


def checkpoints(root: Path) -> list[Path]:
    """Checkpoint folders under `root`, oldest first (complete or not)."""
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith("ckpt-"))


def latest_complete(root: Path, log=print) -> tuple[Path, dict] | None:
    """The newest checkpoint whose manifest and parts are all there; each one skipped is logged with why."""
    for directory in reversed(checkpoints(root)):
        try:
            return directory, load_manifest(directory)
        except CheckpointError as e:
            log(f"skipping checkpoint {directory.name}: {e}")
    return None


def check_binding(manifest: dict, document: dict) -> None:
    """Refuse to resume with different join-relevant settings (the slave count may differ: `reassign`): the
    config as written then and now (`document`: protocol.plan.Plan.document), compared key by key."""
    for section in BINDING_SECTIONS:
        for key, value in public(document)[section].items():
            then = manifest["config"].get(section, {}).get(key)
            if section == "streams":
                then, value = _bound_stream(then), _bound_stream(value)
            if then != value and (section, key) not in UNBOUND_KEYS:
                raise CheckpointError(
                    f"{section}.{key} is {value!r} but was {then!r} when checkpoint "
                    f"{manifest['id']} was taken: resume with the same setting"
                )


def _bound_stream(spec: dict | None) -> dict | None:
    """A stream's settings without its Kafka table's UNBOUND_KAFKA_KEYS."""
    if not spec or not spec.get("kafka"):
        return spec
    return {**spec, "kafka": {k: v for k, v in spec["kafka"].items() if k not in UNBOUND_KAFKA_KEYS}}


def slaves_of(manifest: dict) -> list[int]:
    """The slave ranks of the run that took the checkpoint."""
    k = manifest["config"]["cluster"]["dispatchers"]
    return list(range(k, k + manifest["slaves"]))


def reassign(partition_map: np.ndarray, slaves: list[int], then: list[int]) -> np.ndarray:
    """The partition map of a checkpoint taken on slaves `then`, for a run on `slaves` (fewer, more or others).

    The partition-groups are the units of state (paper 003, IV-C), so a rescale is a placement: on the same
    slaves nothing changes; else a group stays where its slave remains, a group of a slave gone goes to the
    slave holding fewest, then the slaves holding most give groups to those holding fewest until their counts
    differ by at most one (new slaves get their share).  Unused hot-key slots (-1) stay unused."""
    new = np.array(partition_map, dtype=np.int64)
    if sorted(then) == sorted(slaves):
        return new
    count = {r: int((new == r).sum()) for r in slaves}
    fewest = lambda: min(slaves, key=lambda r: (count[r], r))
    for g in np.flatnonzero((new >= 0) & ~np.isin(new, slaves)):
        new[g] = fewest()
        count[int(new[g])] += 1
    while True:
        most, least = max(slaves, key=lambda r: (count[r], -r)), fewest()
        if count[most] - count[least] <= 1:
            return new
        new[np.flatnonzero(new == most)[-1]] = least
        count[most] -= 1
        count[least] += 1


def slave_assignment(manifest: dict, slaves: list[int]) -> dict[str, list]:
    """Per slave of the resuming run (str(rank)): [slave part, its partition-groups to install] pairs; None for
    the groups when the slave takes its own part whole (the same slaves as at the checkpoint)."""
    then = slaves_of(manifest)
    if sorted(then) == sorted(slaves):
        return {str(r): [[slave_part(r), None]] for r in slaves}
    old = np.array(manifest["master"]["controller"]["partition_map"], dtype=np.int64)
    new = reassign(old, slaves, then)
    out: dict[str, list] = {str(r): [] for r in slaves}
    for owner in then:
        for rank in slaves:
            groups = np.flatnonzero((old == owner) & (new == rank)).tolist()
            if groups:
                out[str(rank)].append([slave_part(owner), groups])
    return out


def inherited(counts: dict[str, int], slaves: list[int]) -> dict[str, int]:
    """The committed file counts of slaves that are not in this run (by str(rank)): a later checkpoint keeps
    them, so their files stay committed and a slave that comes back numbers on after them."""
    return {r: n for r, n in counts.items() if int(r) not in slaves}


def clear(root: Path) -> None:
    """Remove every checkpoint under `root` (a fresh run must never resume from an older run's state)."""
    for d in checkpoints(root):
        shutil.rmtree(d)


def prune(root: Path, keep: int) -> list[Path]:
    """Remove checkpoints older than the `keep` newest complete ones (and unfinished ones older than those)."""
    folders = checkpoints(root)
    complete = [d for d in folders if (d / MANIFEST).is_file()]
    if len(complete) <= keep:
        return []
    oldest_kept = complete[-keep]
    removed = [d for d in folders if d.name < oldest_kept.name]
    for d in removed:
        shutil.rmtree(d, ignore_errors=True)
    return removed


def numbered(directory: Path, prefix: str) -> list[tuple[int, Path]]:
    """Files `prefix-NNNNNN.*` of `directory` with their number (the commit log's unit)."""
    if not directory.is_dir():
        return []
    out = []
    for f in directory.iterdir():
        stem = f.name.split(".", 1)[0]
        if stem.startswith(prefix + "-") and stem[len(prefix) + 1 :].isdigit():
            out.append((int(stem[len(prefix) + 1 :]), f))
    return sorted(out)


#: partial aggregates a slave wrote after the last complete checkpoint wait here, where Spark's file source
#: does not look (it skips names starting with "_"); a complete checkpoint publishes those it covers
PENDING_AGGREGATES = "aggregates/_pending"


def publish_aggregates(out: Path, counts: dict[str, int] | None) -> int:
    """Move staged partial-aggregate files below their slave's committed count (all, with None) into
    `aggregates/`, where the merger reads them; returns the files moved.  Published files are never removed
    again, so the merger never counts a partial twice, whatever crashes follow."""
    pending = out / PENDING_AGGREGATES
    moved = 0
    for prefix in {f.name.rsplit("-", 1)[0] for f in pending.glob("slave-*")} if pending.is_dir() else ():
        for number, f in numbered(pending, prefix):
            if counts is None or number < counts.get(prefix, 0):
                os.replace(f, pending.parent / f.name)
                moved += 1
    return moved


def roll_back_output(out: Path, commit: dict) -> int:
    """Remove output written after the checkpoint (and half-written temporaries); returns files removed.

    `commit` maps a folder of the output (`results`, `late`, `archive`) to {file prefix: files committed};
    a file numbered at or past its count was written after the checkpoint and will be written again.  In the
    slaves' folders a slave the checkpoint does not name committed none: its files came from a run on more
    slaves after the checkpoint (a rescaled recovery, then a crash).
    """
    removed = 0
    for folder, prefixes in commit.items():
        d = out / folder
        if not d.is_dir():
            continue
        for f in d.glob(".*.tmp"):
            f.unlink()
            removed += 1
        if folder in SLAVE_FOLDERS:
            others = {f.name[: len("slave-000")] for f in d.glob("slave-[0-9][0-9][0-9]-*")}
            prefixes = {**dict.fromkeys(others - set(prefixes), 0), **prefixes}
        for prefix, count in prefixes.items():
            for number, f in numbered(d, prefix):
                if number >= count:
                    f.unlink()
                    removed += 1
    return removed


#: the output folders whose files are numbered per slave (`slave-NNN-MMMMMM.*`)
SLAVE_FOLDERS = ("results", PENDING_AGGREGATES)
