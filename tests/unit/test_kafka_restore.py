"""What a recovery of Kafka streams restores besides the merge (tests/unit/test_partition_merge.py): the key
dictionaries (master.sources.keys.KeyMapper.dictionaries) give a fresh mapper every code back, and the payload log
goes on at the checkpoint's stream rows (protocol.payload.PayloadLog.resume); a partition the broker cut short
below what was read ends a running job as a crash, which a recovery mends, and stops a recovery past it."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pytest

from common.chunks import InputError, InputLost, InputRewound
from master.sources.kafka_input import KafkaStream
from master.sources.partitions import PartitionMerge

from master.sources.keys import KeyMapper
from protocol.checkpoint import record_tables, table_records
from protocol.payload import PayloadLog, PayloadReader


def test_a_restored_mapper_codes_every_value_as_the_first_did_and_goes_on_counting():
    rng = np.random.default_rng(3)
    words = [f"user-{i}" for i in rng.integers(0, 500, 3000)]
    ints = rng.integers(0, 7, 3000)
    for kinds, parts in (
        (["string"], lambda a, b: [pa.array(words[a:b])]),
        (["string", "int"], lambda a, b: [pa.array(words[a:b]), ints[a:b]]),
    ):
        first = KeyMapper(kinds)
        before = first.keys(parts(0, 2000))
        (table,) = record_tables(table_records([first.dictionaries()]))
        second = KeyMapper(kinds)
        second.restore(table)
        assert second.distinct == first.distinct
        np.testing.assert_array_equal(second.keys(parts(0, 2000)), before)
        np.testing.assert_array_equal(second.keys(parts(2000, 3000)), first.keys(parts(2000, 3000)))


def test_the_payload_log_resumed_at_a_row_lists_the_segments_before_it_and_removes_those_after(tmp_path):
    """Segments of rows 0-9, 10-19, 20-29 written; resumed at row 20, the first two are listed (released as
    before, by their own largest times, which each segment keeps: not by the stream's largest at the checkpoint,
    which a run cut short by the next fault may never pass), the third is gone, and rows written again from 20
    (numbered otherwise now) are what a reader finds."""
    log = PayloadLog(tmp_path, "a")
    log.write_schema(0, pa.schema([("x", pa.int64())]))
    for first in (0, 10, 20):
        rows = np.arange(first, first + 10)
        log.write(0, rows, rows * 1000, pa.table({"x": rows}))
    fresh = PayloadLog(tmp_path, "b")
    fresh.resume(0, 20, 29_000)
    assert [(s.first, s.last, s.ts_max) for s in fresh.segments[0]] == [(0, 9, 9_000), (10, 19, 19_000)]
    assert sorted(int(p.name[:12]) for p in (tmp_path / "payload" / "R").glob("0*.arrow")) == [0, 10]
    rows = np.arange(20, 25)
    fresh.write(0, rows, rows * 1000, pa.table({"x": rows + 100}))
    got = PayloadReader(tmp_path, ("r_", "s_")).gather(0, np.array([5, 15, 20, 24]))["r_x"].to_pylist()
    assert got == [5, 15, 120, 124]
    assert fresh.release(0, 20, 9_000) == (0, 0)
    assert fresh.release(0, 20, 10_000) == (1, log.segments[0][0].size)  # the stream's largest is 29,000
    assert fresh.release(0, 20, 30_000) == (1, log.segments[0][1].size)


def test_a_segment_written_without_its_largest_time_is_resumed_with_the_stream_s(tmp_path):
    """A segment of an earlier version (no TS_MAX) is released once the stream's largest at the checkpoint is passed."""
    folder = tmp_path / "payload" / "R"
    folder.mkdir(parents=True)
    with pa.OSFile(str(folder / "000000000000-000000000009.arrow"), "wb") as sink:
        table = pa.table({"__row": np.arange(10), "x": np.arange(10)})
        with pa.ipc.new_file(sink, table.schema) as writer:
            writer.write_table(table)
    log = PayloadLog(tmp_path, "a")
    log.resume(0, 10, 29_000)
    assert [s.ts_max for s in log.segments[0]] == [29_000]


def test_a_partition_ending_below_what_was_read_restarts_a_running_job_and_stops_a_recovery_past_it():
    """The broker lost records the stream had read (a crash before it saved them), so partition 0 now ends at 816,
    below offset 839.  Met by the running client (its offset given), the job ends as a crash (InputRewound: an
    OSError, exit 1, which the supervisor restarts from the last complete checkpoint); met at a recovery's
    checkpointed offset, it stops (InputLost, exit 8): that checkpoint holds records the broker no longer has."""
    stream = SimpleNamespace(
        name="views",
        assigned=[("views", 0)],
        merge=SimpleNamespace(position=np.array([839])),
        bounded=False,
        on_lost="stop",
    )
    gone, low, high = np.array([0]), np.array([0]), np.array([816])
    with pytest.raises(InputRewound, match="offset 839 lies beyond the partition's end 816.*newest complete"):
        KafkaStream._skip_gone(stream, gone, low, high, 839)
    with pytest.raises(InputLost, match="offset 839 lies beyond the partition's end 816.*on_lost"):
        KafkaStream._skip_gone(stream, gone, low, high)
    assert issubclass(InputRewound, OSError) and not issubclass(InputRewound, InputError)


def test_a_recovery_told_to_skip_reads_a_partition_cut_below_its_checkpoint_on_from_the_end(capsys):
    """on_lost = "skip": the checkpoint's offset 839 beyond the end 816 is logged, listed as `rewound` (816..838,
    kept in the stream's checkpoint part) and the partition read on from 816, where the broker writes what the
    stream has not read; the other partition, within its offsets, stays where it was."""
    merge = PartitionMerge(np.array([839, 20]), np.array([816, 50]), bounded=False, delay=0, idle_timeout=0)
    stream = SimpleNamespace(
        name="views",
        assigned=[("views", 0), ("views", 1)],
        merge=merge,
        bounded=False,
        on_lost="skip",
        rewound_ranges=[],
        rewound=np.zeros(2, np.int64),
        lost_ranges=[],
    )
    KafkaStream._skip_gone(stream, np.array([0]), np.array([0]), np.array([816]))
    assert merge.position.tolist() == [816, 20] and merge.unreleased().tolist() == [816, 20]
    assert stream.rewound_ranges == [{"topic": "views", "partition": 0, "first": 816, "last": 838}]
    assert stream.rewound.tolist() == [23, 0]
    assert stream.lost_ranges == []
    assert "offset 839 lies beyond the partition's end 816" in capsys.readouterr().err
