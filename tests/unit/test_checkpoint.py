"""The checkpoint format and the recovery choices, without MPI: parts, manifests, skipping, pruning, roll-back."""

from __future__ import annotations

import json
import math
import sys

import numpy as np
import pytest

from control.supervise import supervise
from protocol import checkpoint
from protocol.config import load_config


def make(root, ckpt_id, records, complete=True, slaves=2):
    d = root / checkpoint.name_of(ckpt_id)
    size = checkpoint.write_atomic(d / "slave-001.state", checkpoint.pack(records))
    if complete:
        checkpoint.write_manifest(
            d,
            {
                "id": ckpt_id,
                "slaves": slaves,
                "config": load_config(),
                "parts": {"slave-001.state": {"bytes": size, "records": len(records)}},
            },
        )
    return d


def test_pack_round_trip_keeps_every_record():
    rng = np.random.default_rng(1)
    records = [rng.integers(0, 255, n, dtype=np.uint8) for n in (0, 1, 17, 4096)]
    out = checkpoint.unpack(checkpoint.pack(records), "x")
    assert [r.tobytes() for r in out] == [r.tobytes() for r in records]


@pytest.mark.parametrize("cut", [1, 8, 20, -1])
def test_truncated_or_garbled_parts_are_refused(cut):
    buf = checkpoint.pack([np.arange(10, dtype=np.uint8), np.arange(5, dtype=np.uint8)])
    with pytest.raises(checkpoint.CheckpointError, match="part-x"):
        checkpoint.unpack(buf[:cut], "part-x")


def test_newest_complete_checkpoint_wins_and_broken_ones_are_skipped_with_reasons(tmp_path):
    rec = [np.arange(100, dtype=np.uint8)]
    make(tmp_path, 1, rec)
    make(tmp_path, 2, rec)
    make(tmp_path, 3, rec, complete=False)  # crashed before its manifest
    d4 = make(tmp_path, 4, rec)
    (d4 / "slave-001.state").write_bytes(b"short")  # a part lost its tail
    d5 = make(tmp_path, 5, rec)
    (d5 / checkpoint.MANIFEST).write_text("{not json")  # a garbled manifest
    said = []
    directory, manifest = checkpoint.latest_complete(tmp_path, log=said.append)
    assert directory.name == "ckpt-000002" and manifest["id"] == 2
    assert [m.split(":")[0] for m in said] == [f"skipping checkpoint ckpt-00000{i}" for i in (5, 4, 3)]
    assert "not valid JSON" in said[0] and "manifest says" in said[1] and "not completed" in said[2]


def test_prune_keeps_the_newest_complete_ones_and_what_is_newer(tmp_path):
    for i in range(1, 6):
        make(tmp_path, i, [np.zeros(3, np.uint8)], complete=i != 5)
    removed = checkpoint.prune(tmp_path, 2)
    assert [d.name for d in removed] == ["ckpt-000001", "ckpt-000002"]
    assert [d.name for d in checkpoint.checkpoints(tmp_path)] == ["ckpt-000003", "ckpt-000004", "ckpt-000005"]


def test_roll_back_removes_exactly_what_was_written_after_the_cut(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    for rank, n in ((1, 4), (2, 2)):
        for i in range(n):
            (results / f"slave-{rank:03d}-{i:06d}.parquet").touch()
    (results / ".slave-001-000004.parquet.tmp").touch()
    (results / "slave-003-000000.parquet").touch()  # a slave the checkpoint's run did not have: after it
    removed = checkpoint.roll_back_output(tmp_path, {"results": {"slave-001": 2, "slave-002": 0}})
    assert removed == 6
    assert sorted(f.name for f in results.iterdir()) == ["slave-001-000000.parquet", "slave-001-000001.parquet"]


def test_binding_refuses_another_join_setting_but_not_how_the_cluster_runs():
    cfg = load_config()
    manifest = {"id": 7, "slaves": 4, "config": json.loads(json.dumps(cfg))}
    checkpoint.check_binding(manifest, cfg)
    checkpoint.check_binding(manifest, load_config(None, ["cluster.heartbeat_timeout=9", "cluster.network=10.0.0.0/8"]))
    other = load_config(None, ["join.window=3.0"])
    with pytest.raises(checkpoint.CheckpointError, match="join.window is 3.0 but was 1.0"):
        checkpoint.check_binding(manifest, other)
    with pytest.raises(checkpoint.CheckpointError, match="cluster.dispatchers is 2 but was 1"):
        checkpoint.check_binding(manifest, load_config(None, ["cluster.dispatchers=2"]))


def test_binding_lets_a_recovery_skip_records_deleted_below_its_kafka_offsets_but_not_read_another_topic():
    """A recovery stopped by records deleted before they were read goes on with on_lost = "skip" (a checkpoint of a
    version before the key has none); another topic is another input."""
    stream = lambda name, topic, *extra: [  # noqa: E731
        f'streams.{name}.kafka={{bootstrap = "b:1", topic = "{topic}"{"".join(extra)}}}',
        f'streams.{name}.schema={{id = "int64", k = "int64", t = "int64"}}',
        f'streams.{name}.key="k"',
        f'streams.{name}.time="t"',
    ]
    cfg = load_config(None, [*stream("r", "a"), *stream("s", "b")])
    then = json.loads(json.dumps(cfg))
    del then["streams"]["r"]["kafka"]["on_lost"]
    manifest = {"id": 3, "slaves": 4, "config": then}
    checkpoint.check_binding(manifest, load_config(None, [*stream("r", "a", ', on_lost = "skip"'), *stream("s", "b")]))
    with pytest.raises(checkpoint.CheckpointError, match="streams.r is"):
        checkpoint.check_binding(manifest, load_config(None, [*stream("r", "c"), *stream("s", "b")]))


def shell(tmp_path, script):
    """A command that fails its first runs and records its arguments, as a crashing cluster would."""
    s = tmp_path / "cmd.py"
    s.write_text(script)
    return [sys.executable, str(s)]


CRASH_TWICE = """
import sys, pathlib
log = pathlib.Path(sys.argv[0]).with_name("calls")
calls = log.read_text().splitlines() if log.exists() else []
log.write_text("\\n".join(calls + [" ".join(sys.argv[1:])]))
sys.exit(0 if len(calls) >= 2 else 137)
"""


def test_supervisor_restarts_with_recover_until_the_run_succeeds(tmp_path):
    said = []
    assert supervise([*shell(tmp_path, CRASH_TWICE), "--config", "x"], 5, 0, log=said.append) == 0
    assert (tmp_path / "calls").read_text().splitlines() == [
        "--config x",
        "--config x --recover",
        "--config x --recover",
    ]
    assert len(said) == 2 and "restart 2 of 5" in said[1]


def test_supervisor_gives_up_after_its_restarts_and_never_retries_a_user_error(tmp_path):
    said = []
    assert supervise(shell(tmp_path, CRASH_TWICE), 1, 0, log=said.append) == 137
    assert "all 1 restarts are used" in said[-1]
    assert supervise(shell(tmp_path, "raise SystemExit(2)"), 5, 0, log=said.append) == 2
    assert len(said) == 2


def test_publish_moves_only_what_a_checkpoint_covers_and_never_takes_it_back(tmp_path):
    pending = tmp_path / checkpoint.PENDING_AGGREGATES
    pending.mkdir(parents=True)
    for rank, n in ((1, 3), (2, 2)):
        for i in range(n):
            (pending / f"slave-{rank:03d}-{i:06d}.parquet").touch()
    assert checkpoint.publish_aggregates(tmp_path, {"slave-001": 2, "slave-002": 0}) == 2
    published = sorted(f.name for f in (tmp_path / "aggregates").glob("slave-*"))
    assert published == ["slave-001-000000.parquet", "slave-001-000001.parquet"]
    # a crash now: the roll-back removes the uncovered staged files, published ones stay
    checkpoint.roll_back_output(tmp_path, {checkpoint.PENDING_AGGREGATES: {"slave-001": 2, "slave-002": 0}})
    assert not any(pending.iterdir())
    assert sorted(f.name for f in (tmp_path / "aggregates").glob("slave-*")) == published


def test_a_manifest_is_strict_json_and_keeps_integer_event_times_exact(tmp_path):
    from protocol import eventtime

    unserved = {
        "max_ts": eventtime.NEG_INF,
        "sent_watermark": {"1": 2_500_000, "2": eventtime.NEG_INF},
        "stats": {"delay_max": math.nan, "lag": math.inf},
    }
    checkpoint.write_manifest(
        tmp_path,
        {"id": 1, "parts": {}, "master": dict(unserved), "dispatchers": {"1": dict(unserved, max_ts=7_000_001)}},
    )
    text = (tmp_path / checkpoint.MANIFEST).read_text()
    assert "Infinity" not in text and "NaN" not in text
    m = checkpoint.load_manifest(tmp_path)
    assert m["master"]["max_ts"] == eventtime.NEG_INF and m["master"]["sent_watermark"]["2"] == eventtime.NEG_INF
    assert m["dispatchers"]["1"]["max_ts"] == 7_000_001 and m["master"]["stats"] == {"delay_max": None, "lag": None}


def test_a_checkpoint_of_an_older_format_is_refused_with_a_message(tmp_path):
    # format 3 named each channel's sequence numbers "epoch" (format 4 had no matched flags); this version reads
    # only its own format
    d = make(tmp_path, 1, [np.arange(5, dtype=np.uint8)])
    manifest = json.loads((d / checkpoint.MANIFEST).read_text())
    assert manifest["format"] == checkpoint.FORMAT == 6
    manifest.update(format=3, master={"epoch": {"1": 7}})
    (d / checkpoint.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(checkpoint.CheckpointError, match=r"MANIFEST.json: format 3, this version reads 6"):
        checkpoint.load_manifest(d)
    said = []
    assert checkpoint.latest_complete(tmp_path, log=said.append) is None
    assert said == [f"skipping checkpoint ckpt-000001: {d / checkpoint.MANIFEST}: format 3, this version reads 6"]
