"""Two declared streams (`[streams.NAME]`): config, key codes, the merge, errors, and the cluster
differentially against an independent reference computed on the original files.

The reference reads the files with Python's csv/datetime and pyarrow's readers on its own, maps the user's
key values to ints with a Python dict, judges lateness within each stream (the contract of the merge:
docs/input.md), and joins with tests/reference.py.
"""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest

from master.sources.keys import KeyMapper
from master.sources import open_source
from protocol import eventtime
from common.chunks import InputError, concat
from protocol.config import ConfigError, load_config
from protocol.plan import compile_plan
from protocol.output import read_tables
from protocol.output import LEFT_UNMATCHED, MATCHED, RIGHT_UNMATCHED
from tests.runs import free_port, run_cluster, soak, write_config
from tests.cluster.test_balance_cluster import FORCED_CHURN, straggler
from tests.reference import encode_pairs, late_flags, micros, reference_outer, reference_pairs
from tests.cluster.test_zmq_cluster import finish, start

ROOT = Path(__file__).resolve().parent.parent.parent
EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)


def micros_of_iso(text: str) -> int:
    d = datetime.fromisoformat(text)
    d = d if d.tzinfo else d.replace(tzinfo=timezone.utc)
    return (d - EPOCH) // (datetime(1970, 1, 1, 0, 0, 0, 1, tzinfo=timezone.utc) - EPOCH)


def reference(r: dict, s: dict, window: float, max_delay, dispatchers: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """(encoded pairs, late ids encoded stream * 2**40 + id) of streams given as {"id", "ts" (us), "key"
    (hashable per row)} in file order: lateness within each stream, by `max_delay` (seconds: one for both,
    or (R's, S's)), keys mapped by a dict.  With several dispatchers each judges its share: every k-th tuple
    of the merged order, which is sorted by (the stream's running max minus its max_delay, R before S, row)."""
    delays = (max_delay, max_delay) if np.ndim(max_delay) == 0 else max_delay
    codes: dict = {}
    rows = []  # (merge key, side, row, id, ts, key code) in the merged order
    for side, (x, delay) in enumerate(zip((r, s), delays)):
        top = None
        for row, (i, t, k) in enumerate(zip(np.asarray(x["id"]).tolist(), np.asarray(x["ts"]).tolist(), x["key"])):
            top = t if top is None else max(top, t)
            rows.append((top - micros(delay), side, row, i, t, codes.setdefault(k, len(codes))))
    rows.sort()
    late = np.zeros(len(rows), bool)
    for d in range(dispatchers):
        for side, delay in enumerate(delays):
            mine = [p for p in range(d, len(rows), dispatchers) if rows[p][1] == side]
            late[mine] = late_flags(np.array([rows[p][4] for p in mine], np.int64), delay)
    stream, ids, ts, keys = (np.array([row[c] for row in rows], np.int64) for c in (1, 3, 4, 5))
    pairs, _ = reference_pairs(stream[~late], ids[~late], ts[~late], keys[~late], window, 1e9)
    return pairs, np.sort(stream[late] * 2**40 + ids[late])


def streams_cfg(tmp_path, r: dict, s: dict, **sections) -> dict:
    p = tmp_path / "streams.toml"
    text = "".join(
        f"[streams.{name}]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in spec.items())
        for name, spec in (("views", r), ("buys", s))
    )
    p.write_text(text + f'[output]\npath = "{tmp_path / "out"}"\n')
    return load_config(p, [f"{k}={v}" for k, v in sections.items()])


def drain(src, limit=1000):
    parts = []
    while (c := src.next_chunk(limit)) is not None:
        parts.append(c)
    return concat(parts)


# --------------------------------------------------------------------------- config


def test_streams_config_sides_keys_and_overrides(tmp_path):
    cfg = streams_cfg(
        tmp_path,
        {"path": "a.csv", "key": "u", "time": "t"},
        {
            "path": "b.csv",
            "key": "u",
            "time": "t",
            "side": "R",
            "max_delay": "250ms",
            "payload": ["p"],
            "prefix": "b{stream}.",
        },
        **{"streams.views.time_unit": "ms", "streams.views.idle_timeout": "2m", "join.max_delay": "3s"},
    )
    assert cfg["source"]["kind"] == "streams"
    assert list(cfg["streams"]) == ["buys", "views"]  # side = "R" puts buys first
    assert cfg["streams"]["views"] == {
        "path": "a.csv",
        "key": ["u"],
        "time": "t",
        "time_unit": "ms",
        "id": "",
        "side": "S",
        "max_delay": 3.0,
        "idle_timeout": 120.0,  # join.max_delay's
        "payload": "*",
        "prefix": "views_",
        "endpoint": "",
        "producers": 1,
        "ack_endpoint": "",
        "schema": {},
        "time_format": [],
        "kafka": {},
    }
    assert (cfg["streams"]["buys"]["max_delay"], cfg["streams"]["buys"]["idle_timeout"]) == (0.25, 0.0)
    assert cfg["streams"]["buys"]["payload"] == ["p"] and cfg["streams"]["buys"]["prefix"] == "bbuys."
    assert load_config()["streams"] == {}  # the single-source form is untouched


@pytest.mark.parametrize(
    "r,s,words",
    [
        ({"path": "a", "key": "u", "time": "t"}, {"path": "b", "key": ["u", "v"], "time": "t"}, "as many key columns"),
        (
            {"path": "a", "key": "u", "time": "t", "side": "S"},
            {"path": "b", "key": "u", "time": "t", "side": "S"},
            "one must be R",
        ),
        ({"path": "a", "key": "u"}, {"path": "b", "key": "u", "time": "t"}, "streams.views.time: required"),
        (
            {"path": "a", "key": "u", "time": "t", "colour": 1},
            {"path": "b", "key": "u", "time": "t"},
            "streams.views.colour",
        ),
        ({"path": "a", "key": "u", "time": "u"}, {"path": "b", "key": "u", "time": "t"}, "different columns"),
        ({"path": "a", "key": [], "time": "t"}, {"path": "b", "key": "u", "time": "t"}, "streams.views.key"),
        (
            {"path": "a", "key": "u", "time": "t", "time_unit": "min"},
            {"path": "b", "key": "u", "time": "t"},
            "time_unit",
        ),
        (
            {"path": "a", "key": "u", "time": "t", "payload": "p"},
            {"path": "b", "key": "u", "time": "t"},
            "views.payload",
        ),
        ({"path": "a", "key": "u", "time": "t", "prefix": 1}, {"path": "b", "key": "u", "time": "t"}, "views.prefix"),
        (
            {"path": "a", "key": "u", "time": "t", "max_delay": "5 parsecs"},
            {"path": "b", "key": "u", "time": "t"},
            "streams.views.max_delay: expected a number of seconds or a duration",
        ),
        (
            {"path": "a", "key": "u", "time": "t"},
            {"path": "b", "key": "u", "time": "t", "idle_timeout": -1},
            "streams.buys.idle_timeout: expected a duration >= 0",
        ),
        (
            {"path": "a", "key": "u", "time": "t", "max_delay": True},
            {"path": "b", "key": "u", "time": "t"},
            "streams.views.max_delay: expected a duration",
        ),
    ],
)
def test_streams_config_mistakes_name_the_key(tmp_path, r, s, words):
    with pytest.raises(ConfigError, match=words):
        streams_cfg(tmp_path, r, s)


def test_streams_and_a_file_source_are_refused_together(tmp_path):
    with pytest.raises(ConfigError, match="one or the other"):
        streams_cfg(
            tmp_path,
            {"path": "a", "key": "u", "time": "t"},
            {"path": "b", "key": "u", "time": "t"},
            **{"source.kind": "file", "source.path": "x.csv"},
        )


# --------------------------------------------------------------------------- key codes


def test_key_codes_are_exact_and_in_order_of_first_appearance():
    m = KeyMapper(["string"])
    a = m.keys([pa.array(["u_1", "u_2", "u_1", "é", "u_10"])])
    b = m.keys([pa.array(["u_10", "u_3", "é", "u_1 "])])  # a trailing space is another value
    np.testing.assert_array_equal(a, [0, 1, 0, 2, 3])
    np.testing.assert_array_equal(b, [3, 4, 2, 5])
    assert m.distinct == 6


def test_composite_and_binary_key_codes_follow_the_tuples_of_values():
    rng = np.random.default_rng(3)
    users = np.array([f"u_{i}" for i in rng.integers(0, 30, 5000)])
    blobs = [bytes([0, int(i)]) if i % 2 else bytes([int(i)]) + b"\x00" for i in rng.integers(0, 6, 5000)]
    region = rng.integers(-2, 3, 5000)
    m = KeyMapper(["string", "binary", "int"])
    codes = np.concatenate(
        [
            m.keys([pa.array(users[i : i + 999]), pa.array(blobs[i : i + 999], pa.binary()), region[i : i + 999]])
            for i in range(0, 5000, 999)
        ]
    )
    mine: dict = {}
    expected = [mine.setdefault(t, len(mine)) for t in zip(users.tolist(), blobs, region.tolist())]
    np.testing.assert_array_equal(codes, expected)
    assert m.distinct == len(mine)


# --------------------------------------------------------------------------- merge, errors


def test_merge_keeps_each_streams_order_judges_lateness_within_it_and_ignores_batch_sizes(tmp_path, monkeypatch):
    """Two Parquet streams with disorder and jumps, read in batches of 7 rows, views with max_delay 2 s, buys
    0.5 s: the merged order is sorted by (its stream's running max minus its max_delay, side), keeps each
    stream's order, and ingest's rule on the merged order (master.state.lateness.Lateness, also against the join's
    watermark) finds late exactly the tuples late within their own stream."""
    import common.stream_file as sf
    from master.state.lateness import Lateness

    rng = np.random.default_rng(5)
    data = {}
    for name, n in (("views", 300), ("buys", 200)):
        ts = np.cumsum(rng.integers(0, 40_000, n)) + 1_700_000_000_000_000 - rng.integers(0, 900_000, n)
        ts[rng.integers(0, n, 5)] -= 30_000_000  # far behind: late within the stream
        data[name] = ts
        pq.write_table(
            pa.table({"k": rng.integers(0, 9, n), "t": pa.array(ts, pa.timestamp("us"))}),
            tmp_path / f"{name}.parquet",
            row_group_size=50,
        )
    delays = {"views": 2.0, "buys": 0.5}
    cfg = streams_cfg(
        tmp_path,
        {"path": str(tmp_path / "views.parquet"), "key": "k", "time": "t", "max_delay": "2s"},
        {"path": str(tmp_path / "buys.parquet"), "key": "k", "time": "t", "max_delay": "500ms"},
    )
    assert [s["max_delay"] for s in cfg["streams"].values()] == [2.0, 0.5]
    whole = drain(open_source(compile_plan(cfg)), 10_000)
    monkeypatch.setattr(sf, "BATCH_ROWS", 7)
    small = drain(open_source(compile_plan(cfg)), 13)
    for a, b in zip(whole, small):
        np.testing.assert_array_equal(a, b)
    running = np.zeros(len(whole.ts), np.int64)
    lateness = Lateness([2_000_000, 500_000])
    late, below_watermark = [], []
    for i in range(0, len(whole.ts), 37):  # the watermark moves between batches, as at the master
        flags, _, below = lateness.judge(whole.ts[i : i + 37], whole.stream[i : i + 37], 0.0)
        late.append(flags)
        below_watermark.append(below)
    late, below_watermark = np.concatenate(late), np.concatenate(below_watermark)
    assert not below_watermark.any()
    for side, name in enumerate(data):
        mine = whole.stream == side
        np.testing.assert_array_equal(whole.id[mine], np.arange(len(data[name])))  # numbered rows, in order
        np.testing.assert_array_equal(whole.ts[mine], data[name])
        np.testing.assert_array_equal(late[mine], late_flags(data[name], delays[name]))
        running[mine] = np.maximum.accumulate(data[name]) - int(delays[name] * 1_000_000)
    order = np.lexsort((whole.stream, running))
    np.testing.assert_array_equal(order, np.arange(len(order)))  # sorted by (own watermark, side), stable
    assert late.sum() >= 8


def test_the_same_instants_in_every_time_form_give_the_same_tuples(tmp_path):
    """R: timestamp[ns, tz=Europe/Paris] and timestamp[s] files (a folder); S: epoch milliseconds as integers in
    JSON lines (time_unit = "ms"), then ISO text with an offset in CSV (a glob): one instant list either way."""
    micros = np.sort(np.random.default_rng(4).integers(0, 600, 40)) * 1_000_000 + 1_795_000_000_000_000
    half, keys = len(micros) // 2, 100 + 7 * np.arange(len(micros))
    (tmp_path / "r").mkdir()
    pq.write_table(
        pa.table({"k": keys[:half], "t": pa.array(micros[:half] * 1000, pa.timestamp("ns", "Europe/Paris"))}),
        tmp_path / "r" / "a.parquet",
    )
    pq.write_table(
        pa.table({"k": keys[half:], "t": pa.array(micros[half:] // 1_000_000, pa.timestamp("s"))}),
        tmp_path / "r" / "b.parquet",
    )
    with open(tmp_path / "s-1.jsonl", "w") as f:
        f.writelines(json.dumps({"k": k, "t": m // 1000}) + "\n" for k, m in zip(keys[:half].tolist(), micros.tolist()))
    iso = [
        datetime.fromtimestamp(m // 1_000_000 - 5400, timezone.utc).strftime("%Y-%m-%d %H:%M:%S-01:30")
        for m in micros[half:].tolist()
    ]
    pacsv.write_csv(pa.table({"k": keys[half:], "t": iso}), tmp_path / "s-2.csv")
    cfg = streams_cfg(
        tmp_path,
        {"path": str(tmp_path / "r"), "key": "k", "time": "t"},
        {"path": str(tmp_path / "s-*"), "key": "k", "time": "t", "time_unit": "ms"},
    )
    got = drain(open_source(compile_plan(cfg)))
    for side in (0, 1):
        np.testing.assert_array_equal(got.ts[got.stream == side], micros)
        np.testing.assert_array_equal(got.key[got.stream == side], keys)  # integer keys as they are, not codes


def test_a_recovery_seeks_to_the_same_next_tuple_with_the_same_key_codes_and_lists_each_bad_row_once(tmp_path):
    rng = np.random.default_rng(8)
    for name, n in (("views", 900), ("buys", 700)):
        users = [f"u_{i}" for i in rng.integers(0, 300, n)]
        times = [f"2026-11-25T10:{m:02d}:00Z" for m in np.sort(rng.integers(0, 60, n)).tolist()]
        times[n // 2] = "noon"
        pacsv.write_csv(pa.table({"user": users, "at": times}), tmp_path / f"{name}.csv")
    cfg = streams_cfg(
        tmp_path,
        {"path": str(tmp_path / "views.csv"), "key": "user", "time": "at"},
        {"path": str(tmp_path / "buys.csv"), "key": "user", "time": "at"},
        **{"output.flush_rows": 1},
    )
    first = open_source(compile_plan(cfg))
    head = concat([first.next_chunk(300), first.next_chunk(300)])
    where = first.position()
    first.finish()
    again = open_source(compile_plan(cfg))
    again.seek(where)
    rest = drain(again, 256)
    whole = drain(open_source(compile_plan(cfg), listed=False), 5000)  # lists nothing
    for a, b in zip(whole, concat([head, rest])):
        np.testing.assert_array_equal(a, b)
    assert again.finish()["rejected"] == 2
    listed = read_tables(tmp_path / "out" / "rejected")
    assert sorted(listed["row"].to_pylist()) == [351, 451] and set(listed["stream"].to_pylist()) == {"views", "buys"}


def test_missing_columns_wrong_types_and_paths_are_one_error_naming_them(tmp_path):
    pq.write_table(pa.table({"user": ["a"], "at": [True]}), tmp_path / "bool.parquet")
    pq.write_table(pa.table({"user": [[1]], "at": [1.0]}), tmp_path / "list.parquet")
    (tmp_path / "ok.csv").write_text("user,at\na,2026-01-01T00:00:00Z\n")
    (tmp_path / "words.csv").write_text("user,at\na,yesterday\nb,today\n")
    (tmp_path / "nouser.csv").write_text("name,at\na,1\n")
    ok = {"path": str(tmp_path / "ok.csv"), "key": "user", "time": "at"}
    cases = [
        ("bool.parquet", "has column at of type bool, expected a time"),
        ("list.parquet", "has column user of type list<element: int64>, expected an integer, a string or binary"),
        ("words.csv", "has column at of type string (e.g. 'yesterday'), expected a time"),
        ("nouser.csv", "lacks column(s) user; columns found: name, at"),
        ("none.csv", "streams.buys.path: '" + str(tmp_path / "none.csv") + "' does not exist"),
        ("*.json", "matches no file"),
    ]
    for name, words in cases:
        with pytest.raises(InputError) as err:
            open_source(compile_plan(streams_cfg(tmp_path, ok, {**ok, "path": str(tmp_path / name)})))
        assert words in str(err.value) and (name in str(err.value) or "*" in name), str(err.value)


def test_a_repeated_id_is_a_rejected_row_naming_the_row_it_repeats(tmp_path):
    """An id seen again in a declared stream is one rejected row (`duplicate id`), the run goes on."""
    (tmp_path / "v.csv").write_text("vid,user,at\n1,a,1.0\n2,b,2.0\n1,a,3.0\n")
    (tmp_path / "b.csv").write_text("bid,user,at\n1,a,1.0\n")
    src = open_source(
        compile_plan(
            streams_cfg(
                tmp_path,
                {"path": str(tmp_path / "v.csv"), "key": "user", "time": "at", "id": "vid"},
                {"path": str(tmp_path / "b.csv"), "key": "user", "time": "at"},
            )
        )
    )
    assert len(drain(src).ts) == 3 and src.reasons == {"duplicate id": 1}
    assert src.finish()["rejected"] == 1
    listed = read_tables(tmp_path / "out" / "rejected")
    assert listed["reason"].to_pylist() == ["duplicate id 1 (first seen at stream row 1)"]
    assert listed["row"][0].as_py() == 3


def test_a_bad_config_or_input_of_streams_exits_2_before_the_run(tmp_path):
    (tmp_path / "a.csv").write_text("user,at\na,1\n")
    cfg = write_config(
        tmp_path,
        {
            "streams.views.path": str(tmp_path / "a.csv"),
            "streams.views.key": "user",
            "streams.views.time": "at",
            "streams.buys.path": str(tmp_path / "a.csv"),
            "streams.buys.key": "usr",
            "streams.buys.time": "at",
        },
    )
    from deploy.launch import mpi_env, mpirun_command

    proc = subprocess.run(
        mpirun_command(2, ["--config", str(cfg)]), env=mpi_env(), capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2, proc.stderr
    assert "lacks column(s) usr" in proc.stderr and "a.csv" in proc.stderr and "streams.buys" in proc.stderr


# --------------------------------------------------------------------------- the cluster


def read_impressions(folder: Path) -> dict:
    rows = [row for f in sorted(folder.glob("*.csv")) for row in csv.DictReader(f.open())]
    return {
        "id": [int(r["impression_id"]) for r in rows],
        "ts": [micros_of_iso(r["shown_at"]) for r in rows],
        "key": [r["user_id"] for r in rows],
    }


def read_clicks(path: Path) -> dict:
    t = pq.read_table(path)
    return {
        "id": t["click_id"].to_numpy(),
        "ts": t["clicked_at"].cast(pa.int64()).to_numpy() * 1000,
        "key": t["user_id"].to_pylist(),
    }


def run_clicks_example(tmp_path, *settings: str):
    """examples/clicks/make_data.py, then clicks.toml on 3 ranks with `settings` (--set values); the run, the
    data folder and the output folder."""
    data = tmp_path / "data"
    subprocess.run(
        [sys.executable, str(ROOT / "examples/clicks/make_data.py"), str(data)], check=True, capture_output=True
    )
    out = tmp_path / "out"
    from deploy.launch import mpi_env, mpirun_command

    args = [
        "--config",
        str(ROOT / "examples/clicks/clicks.toml"),
        "--set",
        f"streams.impressions.path={data / 'impressions'}",
        "--set",
        f"streams.clicks.path={data / 'clicks.parquet'}",
        "--set",
        f"output.path={out}",
        "--set",
        "output.progress=0",
        "--set",
        "metrics.endpoint=127.0.0.1:0",
    ]
    for item in settings:
        args += ["--set", item]
    proc = subprocess.run(mpirun_command(3, args), env=mpi_env(), capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr
    return data, out


def test_the_clicks_example_with_two_dispatchers_equals_the_reference_and_carries_the_users_columns(tmp_path):
    """examples/clicks end to end on 2 dispatchers and 1 slave: the result pairs are the reference's on the
    original files, and each result row holds both sides' own columns as in the files (user ids, ad_id,
    cost, the times as timestamps), named <stream>_<column>; the payload log is gone after the run."""
    data, out = run_clicks_example(tmp_path, "cluster.dispatchers=2")
    r, s = read_impressions(data / "impressions"), read_clicks(data / "clicks.parquet")
    pairs, late = reference(r, s, (0.0, 30.0), 5.0)
    results = read_tables(out / "results")
    assert len(pairs) > 1000 and len(late) == 0
    np.testing.assert_array_equal(
        encode_pairs(results["impressions_impression_id"].to_numpy(), results["clicks_click_id"].to_numpy()), pairs
    )
    assert results.column_names == [
        "impressions_impression_id",
        "impressions_user_id",
        "impressions_ad_id",
        "impressions_shown_at",
        "clicks_click_id",
        "clicks_user_id",
        "clicks_clicked_at",
        "clicks_cost",
        "delay",
    ]
    assert results.schema.field("clicks_clicked_at").type == pa.timestamp("us", "UTC")
    impressions = pacsv.read_csv(sorted((data / "impressions").glob("*.csv"))[1])
    ads = dict(zip(impressions["impression_id"].to_pylist(), impressions["ad_id"].to_pylist()))
    clicks = pq.read_table(data / "clicks.parquet")
    cost = dict(zip(clicks["click_id"].to_pylist(), clicks["cost"].to_pylist()))
    users_r, times_r = dict(zip(r["id"], r["key"])), dict(zip(r["id"], r["ts"]))
    rows = zip(
        *(
            results[c].to_pylist()
            for c in (
                "impressions_impression_id",
                "impressions_user_id",
                "impressions_ad_id",
                "clicks_click_id",
                "clicks_user_id",
                "clicks_cost",
            )
        )
    )
    checked = 0
    for imp, user_r, ad, click, user_s, c in rows:
        assert user_r == user_s == users_r[imp] and c == cost[click]
        if imp in ads:
            assert ad == ads[imp]
            checked += 1
    assert checked > 100
    shown = results["impressions_shown_at"].cast(pa.int64()).to_numpy()
    np.testing.assert_array_equal(shown, [times_r[i] for i in results["impressions_impression_id"].to_pylist()])
    summary = json.loads((out / "summary.json").read_text())
    assert summary["input"] == {"R": len(r["id"]), "S": len(s["id"])}
    assert summary["streams"] == {"R": "impressions", "S": "clicks"}
    assert summary["keys"]["distinct"] == len(set(r["key"]) | set(s["key"]))
    assert not (out / "payload").exists()


def test_the_result_stream_of_declared_streams_carries_the_users_columns_in_order(tmp_path):
    """examples/clicks as a full join on 2 dispatchers, paced, with the ordered result stream: a subscriber of
    both sockets gets TABLEs whose rows are those of the results/ files, columns and all, each once, plus their
    stream time (a pair's later time, an impression alone its shown_at + 30 s, a click alone its clicked_at),
    never below a punctuation sent before them and merged in stream-time order; the rows equal the reference."""
    port = free_port(consecutive=2)
    sub = start(
        "control.subscribe",
        "--endpoint",
        f"tcp://127.0.0.1:{port}",
        "--dispatchers",
        2,
        "--ordered",
        "--out",
        tmp_path / "sub.parquet",
        "--progress",
        0,
    )
    data, out = run_clicks_example(
        tmp_path,
        "cluster.dispatchers=2",
        "join.type=full",
        "source.rate=3000",
        f"output.zmq_endpoint=tcp://127.0.0.1:{port}",
        "output.ordered=true",
        "output.wait_subscribers=1",
    )
    got = finish(sub)
    assert got["ended"] and not (got["gaps"] or got["covered"] or got["non_monotone"]), got
    assert got["punctuations"] > 10, got
    streamed, files = pq.read_table(tmp_path / "sub.parquet"), read_tables(out / "results")
    assert streamed.column_names == files.column_names + ["time", "punctuation_before"]
    ids = ("impressions_impression_id", "clicks_click_id", "kind")
    rows = [sorted(zip(*(t[c].to_pylist() for c in ids)), key=str) for t in (streamed, files)]
    assert rows[0] == rows[1] and len(set(rows[0])) == len(rows[0])
    assert (
        streamed.drop_columns(["delay", "time", "punctuation_before"])
        .sort_by([(c, "ascending") for c in ids[:2]])
        .equals(files.drop_columns(["delay"]).sort_by([(c, "ascending") for c in ids[:2]]))
    )
    r, s = read_impressions(data / "impressions"), read_clicks(data / "clicks.parquet")
    pairs, late = reference(r, s, (0.0, 30.0), 5.0)
    want = reference_outer(pairs, r["id"], s["id"], "full")
    kind = streamed["kind"].to_numpy(zero_copy_only=False)
    r_id, s_id = (streamed[c].fill_null(-1).to_numpy() for c in ids[:2])
    assert len(late) == 0 and len(want[0]) > 5000 and len(want[1]) > 1000 and len(want[2]) > 20
    np.testing.assert_array_equal(np.sort(encode_pairs(r_id[kind == MATCHED], s_id[kind == MATCHED])), want[0])
    np.testing.assert_array_equal(np.sort(r_id[kind == LEFT_UNMATCHED]), want[1])
    np.testing.assert_array_equal(np.sort(s_id[kind == RIGHT_UNMATCHED]), want[2])
    shown, clicked = (
        streamed[c].cast(pa.int64()).fill_null(np.iinfo(np.int64).min).to_numpy()
        for c in ("impressions_shown_at", "clicks_clicked_at")
    )
    expected = np.where(
        kind == MATCHED, np.maximum(shown, clicked), np.where(kind == LEFT_UNMATCHED, shown + 30_000_000, clicked)
    )
    np.testing.assert_array_equal(micros(streamed["time"].to_numpy()), expected)
    time, before = streamed["time"].to_numpy(), streamed["punctuation_before"].to_numpy()
    assert (time >= before).all() and (np.diff(time) >= 0).all()
    assert json.loads((out / "summary.json").read_text())["result_stream"]["results"] == streamed.num_rows


def test_results_of_declared_streams_read_as_they_are_in_pandas_and_duckdb(tmp_path):
    """The clicks example's results (CSV) opened by pandas and DuckDB without any schema given: the same pairs
    as DuckDB's interval join over the two original files (clicks 0 to 30 s after an impression)."""
    import duckdb
    import pandas as pd

    data, out = run_clicks_example(tmp_path, "output.format=csv", "streams.clicks.prefix=c_")
    frame = pd.concat(pd.read_csv(f) for f in sorted((out / "results").glob("*.csv")))
    assert {"impressions_ad_id", "c_cost", "c_clicked_at"} <= set(frame.columns)
    got = sorted(zip(frame["impressions_impression_id"], frame["c_click_id"]))
    con = duckdb.connect()
    ref = con.sql(f"""select i.impression_id, c.click_id from read_csv('{data}/impressions/*.csv') i
                      join read_parquet('{data}/clicks.parquet') c on i.user_id = c.user_id
                      and epoch_us(c.clicked_at) - epoch_us(i.shown_at::timestamptz)
                          between 0 and 30000000""").fetchall()
    assert got == sorted(ref) and len(got) > 1000
    duck = con.sql(f"select c_click_id, c_cost, c_clicked_at from read_csv('{out}/results/*.csv')").fetchall()
    assert len(duck) == len(got) and all(isinstance(c, float) for _, c, _ in duck)


def test_composite_keys_without_ids_from_json_lines_and_a_folder_of_csv_equal_the_reference_across_a_crash(tmp_path):
    """R: JSON lines, epoch milliseconds (time_unit = "ms"), no id; S: two CSV files with ISO text in +01:00,
    no id, a bad time cell and an empty key cell (rejected rows), and rows late within their own stream;
    the key is (user, region). One dispatcher, two slaves; slave rank 2 is killed as it writes its part of the second
    checkpoint and the supervisor recovers from the first: the input is read again and coded again,
    each pair is written once."""
    rng = np.random.default_rng(11)
    t0 = 1_795_000_000_000
    n_r, n_s = 1500, 1200
    r_ms = t0 + np.cumsum(rng.integers(0, 40, n_r)) - rng.integers(0, 500, n_r)
    r_ms[[200, 900]] -= 20_000  # 20 s behind its stream: late
    r_user, r_region = [f"u_{i}" for i in rng.integers(0, 40, n_r)], rng.integers(0, 3, n_r)
    with open(tmp_path / "views.jsonl", "w") as f:
        for u, g, t in zip(r_user, r_region.tolist(), r_ms.tolist()):
            f.write(json.dumps({"user": u, "region": g, "at": t, "page": "/x"}) + "\n")
    s_us = (t0 + np.cumsum(rng.integers(0, 50, n_s)) - rng.integers(0, 500, n_s)) * 1000 + rng.integers(0, 1000, n_s)
    s_us[700] -= 30_000_000
    s_user, s_region = [f"u_{i}" for i in rng.integers(0, 40, n_s)], rng.integers(0, 3, n_s)
    iso = [
        datetime.fromtimestamp(t // 1_000_000 + 3600, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S")
        + f".{t % 1_000_000:06d}+01:00"
        for t in s_us.tolist()
    ]
    iso[100], s_user[333] = "soon", ""
    (tmp_path / "buys").mkdir()
    for i, (a, b) in enumerate(((0, 600), (600, n_s))):
        pacsv.write_csv(
            pa.table({"user": s_user[a:b], "region": s_region[a:b], "t": iso[a:b]}), tmp_path / "buys" / f"part-{i}.csv"
        )
    run = run_cluster(
        tmp_path,
        3,
        {
            "streams.views.path": str(tmp_path / "views.jsonl"),
            "streams.views.key": ["user", "region"],
            "streams.views.time": "at",
            "streams.views.time_unit": "ms",
            "streams.buys.path": str(tmp_path / "buys"),
            "streams.buys.key": ["user", "region"],
            "streams.buys.time": "t",
            "join.window": "2s",
            "join.max_delay": "1500ms",
            "partitioning.partitions": 8,
            "source.rate": 2000.0,
            "epochs.distribution": "100ms",
            "checkpoint.interval": 2,
            "output.flush_rows": 1,
        },
        wrapper=[sys.executable, "-m", "control.supervise", "--backoff", "0.1", "--restarts", "3", "--"],
        env={"STREAMJOIN_FAULT": f"2:checkpoint:2:{tmp_path / 'fault-fired'}"},
    )
    assert run.returncode == 0, run.stderr
    assert (tmp_path / "fault-fired").exists() and run.summary["checkpoints"]["recovered_from"] is not None
    bad = np.zeros(n_s, bool)
    bad[[100, 333]] = True
    r = {"id": np.arange(n_r), "ts": r_ms * 1000, "key": list(zip(r_user, r_region.tolist()))}
    s = {
        "id": np.flatnonzero(~bad),
        "ts": s_us[~bad],
        "key": [k for k, b in zip(zip(s_user, s_region.tolist()), bad) if not b],
    }
    pairs, late = reference(r, s, 2.0, 1.5)
    assert len(pairs) > 500 and len(late) == 3
    np.testing.assert_array_equal(run.pairs(("views_row", "buys_row")), pairs)
    np.testing.assert_array_equal(run.late_ids(("views_row", "buys_row"), ("views", "buys")), late)
    results = read_tables(run.out / "results")
    assert results.column_names == [
        "views_row",
        "views_user",
        "views_region",
        "views_at",
        "views_page",
        "buys_row",
        "buys_user",
        "buys_region",
        "buys_t",
        "delay",
    ]
    assert pc.all(pc.equal(results["views_user"], results["buys_user"])).as_py()
    assert pc.all(pc.equal(results["views_page"], "/x")).as_py()
    rejected = read_tables(run.out / "rejected").sort_by("row")
    assert [
        (Path(f).name, row, c) for f, row, c in zip(*(rejected[x].to_pylist() for x in ("file", "row", "column")))
    ] == [("part-0.csv", 101, "t"), ("part-0.csv", 334, "user+region")]
    assert run.summary["keys"]["distinct"] == len(set(r["key"]) | set(s["key"]))


def check_left_join(run, r: dict, s: dict, window: float, max_delay: float, ids: tuple[str, str]) -> None:
    """A left join's pairs and R rows alone, identified by the streams' `ids`, are the reference's; no row late."""
    pairs, late = reference(r, s, window, max_delay)
    assert len(pairs) > 1000 and len(late) == 0
    np.testing.assert_array_equal(run.pairs(ids), pairs)
    np.testing.assert_array_equal(run.alone("r", ids), np.setdiff1d(r["id"], pairs // 2**32))


def test_payload_of_every_type_survives_a_left_join_with_hot_keys_moves_and_a_crash_and_spark_reads_it(tmp_path, spark):
    """Parquet streams whose payload holds a decimal, a list, text with nulls and a struct, times as
    timestamp[ns, Europe/Paris] (R) and int64 milliseconds (S); a left join with a hot key (a third of the
    tuples), groups moving at every reorganization and slave rank 2 killed as it writes its part of the
    second checkpoint, under the supervisor.
    Every pair and every R row alone equals the reference, and each result row's payload is its
    own rows' (looked up by id in the input) with the Arrow types kept; Spark reads the folder as it is."""
    import decimal

    rng = np.random.default_rng(5)
    n_r, n_s, t0 = 3000, 2500, 1_795_000_000_000
    r_ms = t0 + np.cumsum(rng.integers(0, 4, n_r))
    s_ms = t0 + np.cumsum(rng.integers(0, 5, n_s)) - rng.integers(0, 300, n_s)
    r_key, s_key = rng.integers(0, 60, n_r), rng.integers(0, 60, n_s)
    r_key[rng.random(n_r) < 0.33], s_key[rng.random(n_s) < 0.33] = 7, 7
    price = [decimal.Decimal(int(x)).scaleb(-2) for x in rng.integers(0, 10**6, n_r)]
    tags = [[int(x)] * int(x % 4) for x in rng.integers(0, 100, n_r)]
    note = [None if x % 5 == 0 else f"note {x}" for x in range(n_r)]
    pq.write_table(
        pa.table(
            {
                "oid": np.arange(n_r) + 10**9,
                "acct": r_key,
                "placed": pa.array(r_ms * 1_000_000, pa.timestamp("ns", "Europe/Paris")),
                "price": pa.array(price, pa.decimal128(12, 2)),
                "tags": pa.array(tags, pa.list_(pa.int32())),
                "note": pa.array(note, pa.string()),
                "venue": pa.array([{"id": int(x), "open": bool(x % 2)} for x in r_key]),
            }
        ),
        tmp_path / "orders.parquet",
        row_group_size=700,
    )
    pq.write_table(
        pa.table({"fid": np.arange(n_s), "acct": s_key, "at": s_ms, "qty": (np.arange(n_s) % 9).astype(np.int16)}),
        tmp_path / "fills.parquet",
        row_group_size=600,
    )
    run = run_cluster(
        tmp_path,
        4,
        {
            "streams.orders.path": str(tmp_path / "orders.parquet"),
            "streams.orders.key": "acct",
            "streams.orders.time": "placed",
            "streams.orders.id": "oid",
            "streams.fills.path": str(tmp_path / "fills.parquet"),
            "streams.fills.key": "acct",
            "streams.fills.time": "at",
            "streams.fills.time_unit": "ms",
            "streams.fills.id": "fid",
            "join.type": "left",
            "join.window": "150ms",
            "join.max_delay": "400ms",
            "source.rate": 2000.0,
            "epochs.distribution": "100ms",
            "epochs.reorganization": 0.3,
            "partitioning.partitions": 16,
            "hotkeys.enabled": True,
            "hotkeys.threshold": 0.15,
            "balance.buffer_capacity": 50,
            "balance.supplier_threshold": 1e-9,
            "balance.consumer_threshold": 1e-9,
            "balance.choice": "random",
            "checkpoint.interval": 6,
            "output.result_chunk_rows": 64,
        },
        wrapper=[sys.executable, "-m", "control.supervise", "--backoff", "0.1", "--restarts", "3", "--"],
        env={"STREAMJOIN_FAULT": f"2:checkpoint:2:{tmp_path / 'fault-fired'}"},
    )
    assert run.returncode == 0, run.stderr
    assert (tmp_path / "fault-fired").exists() and run.summary["checkpoints"]["recovered_from"] is not None
    r = {"id": np.arange(n_r) + 10**9, "ts": r_ms * 1000, "key": r_key.tolist()}
    ids = ("orders_oid", "fills_fid")
    check_left_join(run, r, {"id": np.arange(n_s), "ts": s_ms * 1000, "key": s_key.tolist()}, 0.15, 0.4, ids)
    # a group moved and a hot key was split, in the crashed run or the restarted one (a split made before the
    # checkpoint the restart resumes from is in its state, not in its summary's log)
    assert "moved partition-group" in run.stderr and "split out of partition-group" in run.stderr, run.stderr
    results = read_tables(run.out / "results")
    assert results.schema.field("orders_price").type == pa.decimal128(12, 2)
    assert results.schema.field("orders_tags").type == pa.list_(pa.int32())
    assert results.schema.field("orders_placed").type == pa.timestamp("us", "Europe/Paris")
    assert results.schema.field("fills_at").type == pa.timestamp("us", "UTC")
    row = results["orders_oid"].to_numpy() - 10**9
    assert results["orders_price"].to_pylist() == [price[i] for i in row]
    assert results["orders_tags"].to_pylist() == [tags[i] for i in row]
    assert results["orders_note"].to_pylist() == [note[i] for i in row]
    assert results["orders_venue"].to_pylist() == [{"id": int(r_key[i]), "open": bool(r_key[i] % 2)} for i in row]
    matched = pc.is_valid(results["fills_fid"])
    fid = results["fills_fid"].filter(matched).to_numpy()
    assert results["fills_qty"].filter(matched).to_pylist() == (fid % 9).tolist()
    np.testing.assert_array_equal(results["fills_at"].filter(matched).cast(pa.int64()).to_numpy(), s_ms[fid] * 1000)
    assert results["fills_qty"].filter(pc.invert(matched)).null_count == len(results) - len(fid)
    frame = spark.read.parquet(str(run.out / "results"))
    assert frame.count() == len(results)
    assert dict(frame.dtypes)["orders_price"] == "decimal(12,2)" and dict(frame.dtypes)["orders_tags"] == "array<int>"
    assert frame.filter("kind = 'left_unmatched'").count() == len(run.alone("r", ids))


@pytest.mark.parametrize("dispatchers", [1, soak(2)])
def test_the_payload_log_keeps_only_what_results_may_still_need_across_moves_and_a_crash(tmp_path, dispatchers):
    """A left join of two streams of Parquet files of 100 rows (segments of the log), paced over 2 s, with 1 and 2
    dispatchers, groups moving at every reorganization (FORCED_CHURN), a checkpoint every 3 epochs (keep 1) and
    the second slave killed as it writes its part of the third, under the supervisor.  Segments are removed
    once no pair or row alone can need them (master.state.payload): the log holds a small part of the input at
    its peak, and every result still carries its own rows' columns -- a segment removed too early would end
    the run with `PayloadError` or null columns."""
    rng = np.random.default_rng(31)
    n_r, n_s, t0 = 6000, 6000, 1_795_000_000_000
    r_ms, s_ms = t0 + np.cumsum(rng.integers(0, 3, n_r)), t0 + np.cumsum(rng.integers(0, 3, n_s))
    r_key, s_key = rng.integers(0, 40, n_r), rng.integers(0, 40, n_s)
    views = pa.table({"ad": np.arange(n_r), "user": r_key, "at": r_ms, "text": [f"ad {i}" for i in range(n_r)]})
    clicks = pa.table({"click": np.arange(n_s), "user": s_key, "at": s_ms, "cost": np.arange(n_s) * 0.5})
    for name, table in (("views", views), ("clicks", clicks)):
        (tmp_path / name).mkdir()
        for i in range(0, len(table), 100):  # a file is read as one batch: one segment of the log each
            pq.write_table(table.slice(i, 100), tmp_path / name / f"part-{i // 100:03d}.parquet")
    run = run_cluster(
        tmp_path,
        3 + dispatchers,
        {
            **{
                f"streams.{name}.{k}": v
                for name, ident in (("views", "ad"), ("clicks", "click"))
                for k, v in (
                    ("path", str(tmp_path / name)),
                    ("key", "user"),
                    ("time", "at"),
                    ("time_unit", "ms"),
                    ("id", ident),
                )
            },
            "join.type": "left",
            "join.window": "100ms",
            "join.max_delay": "50ms",
            **FORCED_CHURN,
            "source.rate": 6000.0,
            "partitioning.partitions": 16,
            "checkpoint.interval": 3,
            "checkpoint.keep": 1,
            "cluster.dispatchers": dispatchers,
        },
        wrapper=[sys.executable, "-m", "control.supervise", "--backoff", "0.1", "--restarts", "3", "--"],
        env={
            "STREAMJOIN_FAULT": f"{dispatchers + 1}:checkpoint:3:{tmp_path / 'fault-fired'}",
            **straggler(dispatchers),
        },
    )
    assert run.returncode == 0, run.stderr
    assert (tmp_path / "fault-fired").exists() and run.summary["checkpoints"]["recovered_from"] is not None
    assert "moved partition-group" in run.stderr, run.stderr
    check_left_join(
        run,
        {"id": np.arange(n_r), "ts": r_ms * 1000, "key": r_key.tolist()},
        {"id": np.arange(n_s), "ts": s_ms * 1000, "key": s_key.tolist()},
        0.1,
        0.05,
        ("views_ad", "clicks_click"),
    )
    results = read_tables(run.out / "results")
    ad = results["views_ad"].to_numpy()
    assert results["views_text"].to_pylist() == [f"ad {i}" for i in ad]
    matched = pc.is_valid(results["clicks_click"])
    click = results["clicks_click"].filter(matched).to_numpy()
    np.testing.assert_array_equal(results["clicks_cost"].filter(matched).to_numpy(), click * 0.5)
    s = run.summary
    # segments went before the end, under the moves and the restart; with two dispatchers the straggler answers
    # two batches an epoch and falls ever further behind, so most of the input may wait for it to the end
    assert s["payload_log_removed_bytes"] > 0 or dispatchers > 1, s
    assert not (run.out / "payload").exists()


@pytest.mark.parametrize("dispatchers", [soak(1), 2])
def test_the_payload_log_holds_a_small_part_of_a_long_input_at_once(tmp_path, dispatchers):
    """Two streams of 80 Parquet files of 100 rows each, paced over 5.3 s, an inner join with a 100 ms window:
    segments go as the slaves answer, so at its peak the log holds what is read ahead and what the slaves have
    not answered yet, not the input; with two dispatchers rank 0 removes by the other's reports too."""
    rng = np.random.default_rng(32)
    n = 8000
    for name in ("views", "clicks"):
        (tmp_path / name).mkdir()
        t = pa.table(
            {
                "seq": np.arange(n),
                "user": rng.integers(0, 50, n),
                "at": 1_795_000_000_000 + np.cumsum(rng.integers(0, 2, n)),
                "text": [f"{name} {i}" for i in range(n)],
            }
        )
        for i in range(0, n, 100):
            pq.write_table(t.slice(i, 100), tmp_path / name / f"part-{i // 100:03d}.parquet")
    run = run_cluster(
        tmp_path,
        3 + dispatchers,
        {
            **{
                f"streams.{name}.{k}": v
                for name in ("views", "clicks")
                for k, v in (("path", str(tmp_path / name)), ("key", "user"), ("time", "at"), ("time_unit", "ms"))
            },
            "join.window": "100ms",
            "join.max_delay": "50ms",
            "source.rate": 3000.0,
            "cluster.dispatchers": dispatchers,
        },
    )
    assert run.returncode == 0, run.stderr
    s = run.summary
    assert s["results"] > 0 and s["payload_log_removed_bytes"] > 0.5 * s["payload_log_bytes"], s
    # about a fifth when the host is quiet; slaves that fall behind (a loaded host) hold more of it
    assert s["payload_log_peak_bytes"] < 0.75 * s["payload_log_bytes"], s
    assert f"at most {s['payload_log_peak_bytes'] / 2**20:.1f} MiB on disk at once" in run.stderr  # the summary
    assert not (run.out / "payload").exists()


# --------------------------------------------------------------------------- lateness per stream, idleness


def disordered(rng, n: int, start: int, step: int, disorder: int) -> np.ndarray:
    """n event times in microseconds, rising by up to `step` and each up to `disorder` behind."""
    return start + np.cumsum(rng.integers(0, step, n)) - rng.integers(0, disorder, n)


def test_each_stream_its_own_max_delay_with_two_dispatchers_across_a_crash_equals_the_reference(tmp_path):
    """views (CSV, max_delay 1.5 s, out of order by up to 2 s) and buys (Parquet, 300 ms, up to 1 s), views
    ending half way through buys: 2 dispatchers and 2 slaves, slave rank 3 killed at its first batch after
    its part of the second checkpoint and the run recovered from the first or a later one.  Pairs and late
    tuples are the reference's (each dispatcher judges each stream of its share by that stream's max_delay),
    late/ states each stream's bound, and summary.json each stream's max_delay and late count."""
    rng = np.random.default_rng(21)
    t0 = 1_795_000_000_000_000
    n_r, n_s = 1200, 2400
    r_ts, s_ts = disordered(rng, n_r, t0, 30_000, 2_000_000), disordered(rng, n_s, t0, 30_000, 1_000_000)
    r_key, s_key = rng.integers(0, 50, n_r), rng.integers(0, 50, n_s)
    pacsv.write_csv(
        pa.table({"view": np.arange(n_r), "user": r_key, "at": eventtime.to_seconds(r_ts)}), tmp_path / "views.csv"
    )
    pq.write_table(
        pa.table({"buy": np.arange(n_s), "user": s_key, "at": pa.array(s_ts, pa.timestamp("us"))}),
        tmp_path / "buys.parquet",
        row_group_size=300,
    )
    run = run_cluster(
        tmp_path,
        4,
        {
            "streams.views.path": str(tmp_path / "views.csv"),
            "streams.views.key": "user",
            "streams.views.time": "at",
            "streams.views.id": "view",
            "streams.views.max_delay": "1500ms",
            "streams.buys.path": str(tmp_path / "buys.parquet"),
            "streams.buys.key": "user",
            "streams.buys.time": "at",
            "streams.buys.id": "buy",
            "streams.buys.max_delay": 0.3,
            "join.window": "1s",
            "join.max_delay": "10s",
            "cluster.dispatchers": 2,
            "partitioning.partitions": 8,
            "source.rate": 1000.0,
            "epochs.distribution": "100ms",
            "checkpoint.interval": 2,
            "output.flush_rows": 50,
        },
        wrapper=[sys.executable, "-m", "control.supervise", "--backoff", "0.1", "--restarts", "3", "--"],
        env={"STREAMJOIN_FAULT": f"3:batch-after-checkpoint:1:{tmp_path / 'fault-fired'}"},
    )
    assert run.returncode == 0, run.stderr
    assert (tmp_path / "fault-fired").exists() and run.summary["checkpoints"]["recovered_from"] is not None
    r = {"id": np.arange(n_r), "ts": r_ts, "key": r_key.tolist()}
    s = {"id": np.arange(n_s), "ts": s_ts, "key": s_key.tolist()}
    pairs, late = reference(r, s, 1.0, (1.5, 0.3), dispatchers=2)
    late_r, late_s = int((late < 2**40).sum()), int((late >= 2**40).sum())
    assert len(pairs) > 1000 and 0 < late_r < late_s
    # one max_delay for both (join.max_delay = 1.5 s) would set aside other tuples: the per-stream rule is used
    assert not np.array_equal(reference(r, s, 1.0, 1.5, dispatchers=2)[1], late)
    ids = ("views_view", "buys_buy")
    np.testing.assert_array_equal(run.pairs(ids), pairs)
    np.testing.assert_array_equal(run.late_ids(ids, ("views", "buys")), late)
    lateness = run.summary["lateness"]
    assert {side: (x["stream"], x["max_delay"], x["late"], x["idle"]) for side, x in lateness.items()} == {
        "R": ("views", 1.5, late_r, []),
        "S": ("buys", 0.3, late_s, []),
    }
    t = read_tables(run.out / "late")
    assert set(t["reason"].to_pylist()) == {
        "late: ts below the largest ts of stream views before it minus streams.views.max_delay (1.5)",
        "late: ts below the largest ts of stream buys before it minus streams.buys.max_delay (0.3)",
    }
    # the bound is the stream's largest ts before it in its dispatcher's share minus its max_delay: above the
    # tuple, by at most the disorder less the max_delay
    ts = pc.coalesce(t["views_at"], t["buys_at"]).cast(pa.int64()).to_numpy()
    bound, stream = (t[c].to_numpy(zero_copy_only=False) for c in ("bound", "stream"))
    gap = micros(bound) - ts
    assert (gap > 0).all() and (gap[stream == "views"] <= 500_000).all() and (gap[stream == "buys"] <= 700_000).all()


def test_a_stream_that_pauses_goes_idle_lets_the_watermark_on_and_changes_no_result(tmp_path):
    """A paced run (source.rate) where views has no tuple for 18 s of event time (the merge meanwhile takes
    buys', about 2,200 tuples: 1.1 s of wall clock) and streams.views.idle_timeout = 300 ms: summary.json lists views'
    idle period (begun after 300 ms, ended when views resumed, the watermark then past views' own bound), and
    pairs and late tuples are the reference's: the merge by each stream's watermark never lets a resumed
    stream's on-time tuple fall below the join's watermark."""
    rng = np.random.default_rng(22)
    t0 = 1_795_000_000_000_000
    r_ts = np.concatenate(
        [disordered(rng, 300, t0, 20_000, 200_000), disordered(rng, 300, t0 + 21_000_000, 20_000, 200_000)]
    )
    s_ts = disordered(rng, 3000, t0, 16_000, 200_000)
    r_key, s_key = rng.integers(0, 30, len(r_ts)), rng.integers(0, 30, len(s_ts))
    for name, ts, key in (("views", r_ts, r_key), ("buys", s_ts, s_key)):
        pq.write_table(pa.table({"user": key, "at": pa.array(ts, pa.timestamp("us"))}), tmp_path / f"{name}.parquet")
    run = run_cluster(
        tmp_path,
        3,
        {
            "streams.views.path": str(tmp_path / "views.parquet"),
            "streams.views.key": "user",
            "streams.views.time": "at",
            "streams.views.idle_timeout": "300ms",
            "streams.views.max_delay": "100ms",
            "streams.buys.path": str(tmp_path / "buys.parquet"),
            "streams.buys.key": "user",
            "streams.buys.time": "at",
            "join.window": "500ms",
            "join.max_delay": "150ms",
            "partitioning.partitions": 4,
            "source.rate": 2000.0,
            "source.batch": 64,
            "epochs.distribution": "50ms",
            "output.progress": 0.2,
        },
    )
    assert run.returncode == 0, run.stderr
    pairs, late = reference(
        {"id": np.arange(len(r_ts)), "ts": r_ts, "key": r_key.tolist()},
        {"id": np.arange(len(s_ts)), "ts": s_ts, "key": s_key.tolist()},
        0.5,
        (0.1, 0.15),
    )
    assert len(pairs) > 1000 and len(late) > 10
    ids = ("views_row", "buys_row")
    np.testing.assert_array_equal(run.pairs(ids), pairs)
    np.testing.assert_array_equal(run.late_ids(ids, ("views", "buys")), late)
    views, buys = run.summary["lateness"]["R"], run.summary["lateness"]["S"]
    assert (views["idle_timeout"], views["max_delay"], buys["idle_timeout"], buys["idle"]) == (0.3, 0.1, 0.0, [])
    # the pause: buys' bound carried the watermark on past views' own (a stall of the loaded host may add others)
    paused_at = micros(eventtime.to_seconds(r_ts[:300].max())) - 100_000  # views' own bound when it paused
    gap = [p for p in views["idle"] if p["resumed"] and micros(p["watermark_ended_seconds"]) > t0 + 15_000_000]
    assert len(gap) == 1, views["idle"]
    p = gap[0]
    assert 0.2 < p["ended_seconds"] - p["began_seconds"] < 3.0  # 1.1 s of buys at 2000 tuples/s, less 300 ms
    assert micros(p["watermark_seconds"]) <= paused_at < micros(p["watermark_ended_seconds"])
    assert "idle: views" in run.stderr and "stream R (views): max_delay 0.1s" in run.stderr
