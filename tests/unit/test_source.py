"""Tests of master/sources.py: the synthetic generator and the CSV/Parquet file source."""

from __future__ import annotations

import math
from datetime import date, datetime, timedelta, timezone
from decimal import ROUND_HALF_EVEN, Decimal

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest

from master.sources import RejectedListing, open_source
from common.chunks import Chunk, InputError, no_terms
from protocol.output import read_tables
from common.workload import GeneratorSource, bmodel_tables, generate_all
from tests.reference import micros
from common import input_schema as schema
from protocol.config import load_config
from protocol.plan import compile_plan, load_plan
from protocol.tuples import STREAM_R, STREAM_S
from tests.runs import file_source, write_input


def gen_plan(**gen):
    cfg = load_config()
    cfg["generator"].update({"duration": 5.0, "rate": 20000.0, "keys": 4096, **gen})
    return compile_plan(cfg)


def drain(src, limit):
    parts = []
    while (c := src.next_chunk(limit)) is not None:
        assert 0 < len(c.id) <= limit
        parts.append(c)
    return Chunk(*(np.concatenate(cols) for cols in zip(*parts)))


def file_plan(path, **source):
    cfg = load_config()
    cfg["source"].update(kind="file", path=str(path), **source)
    cfg["output"]["path"] = str(path.parent / f"out-{path.name}")
    return compile_plan(cfg)


def open_file(path, window=1_000_000):
    """A file source listing its rejected rows beside the file."""
    return file_source(path, window, RejectedListing(path.parent / f"rejected-{path.name}", "parquet", 1000))


def rejected(src):
    """The rejected rows a drained source listed (None: none)."""
    src.finish()
    return read_tables(src.listing.directory)


def write_csv(tmp_path, text, name="in.csv"):
    p = tmp_path / name
    p.write_text(text)
    return p


# --------------------------------------------------------------------------- generator


def test_generator_same_seed_same_data_whatever_the_limits():
    cfg = gen_plan(disorder=0.3, duration=10.0)
    a = drain(open_source(cfg), 1000)
    b = drain(open_source(cfg), 77777)
    assert len(a.id) > 0
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)
    other = generate_all(gen_plan(disorder=0.3, duration=10.0, seed=2).generator)
    assert not np.array_equal(other.key[:1000], a.key[:1000])


def test_generator_total_and_dtypes():
    cfg = gen_plan()
    data = generate_all(cfg.generator)
    assert GeneratorSource(cfg.generator).total == len(data.id)
    assert [c.dtype for c in data] == [np.int8, np.int64, np.int64, np.int64, np.float64, np.int64]
    assert np.isfinite(data.ts).all()
    assert ((data.value >= 0) & (data.value < 1)).all()


def test_the_generator_is_two_declared_streams_drawn_in_one_order_and_resumed_at_its_position():
    from master.sources.streams import StreamsSource

    cfg = gen_plan(rate=40000.0, duration=5.0, disorder=0.2)
    whole, src = generate_all(cfg.generator), open_source(cfg)
    assert isinstance(src, StreamsSource) and src.in_rows and src.log is None and src.listing is None
    assert {n: (s.id, s.key, s.prefix) for n, s in src.specs.items()} == {
        "R": ("id", ("key",), "r_"),
        "S": ("id", ("key",), "s_"),
    }
    head = drain_some(src, 150_001, 7_000)  # past two generation slices and several read batches
    where = src.position()
    assert where["row"] == where["accepted"] == len(head.id)
    again = open_source(cfg)
    again.seek(where)  # a recovery: the slices before the position are not drawn again
    for x, y, z in zip(whole, head, drain(again, 50_000)):
        np.testing.assert_array_equal(x, np.concatenate([y, z]))
    past = open_source(cfg)
    past.seek({**where, "row": len(whole.id) + 1})
    with pytest.raises(InputError, match="fewer than the checkpoint's position"):
        past.next_chunk(10)
    src.finish(), again.finish(), past.finish()


def drain_some(src, n, limit):
    """The source's first `n` tuples (at least), taken `limit` at a time."""
    parts = []
    while sum(len(p.id) for p in parts) < n:
        parts.append(src.next_chunk(limit))
    return Chunk(*(np.concatenate(cols) for cols in zip(*parts)))


@pytest.mark.parametrize("rate,duration", [(20000.0, 5.0), (300.0, 2.5), (50000.0, 3.3)])
def test_generator_rates(rate, duration):
    data = generate_all(gen_plan(rate=rate, duration=duration).generator)
    expected = rate * duration
    for s in (STREAM_R, STREAM_S):
        n = int((data.stream == s).sum())
        assert abs(n - expected) <= 5 * math.sqrt(expected), (s, n, expected)
    assert data.ts.min() >= 0 and data.ts.max() < duration * 1e6


def test_generator_ids_per_stream_in_arrival_order():
    data = generate_all(gen_plan().generator)
    for s in (STREAM_R, STREAM_S):
        ids = data.id[data.stream == s]
        np.testing.assert_array_equal(ids, np.arange(len(ids)))


def test_generator_no_disorder_ts_sorted():
    data = generate_all(gen_plan(disorder=0.0).generator)
    assert (np.diff(data.ts) >= 0).all()


def test_generator_disorder_bounded():
    d = 0.25
    data = generate_all(gen_plan(disorder=d).generator)
    running_max = np.maximum.accumulate(data.ts)
    assert (np.diff(data.ts) < 0).any()  # really out of order
    assert (data.ts >= running_max - d * 1e6).all()
    # the disorder only shifts ts back: same streams, same keys as without disorder
    base = generate_all(gen_plan(disorder=0.0).generator)
    np.testing.assert_array_equal(base.key, data.key)
    shift = (base.ts - data.ts) / 1e6
    assert (shift >= 0).all() and (shift < d).all() and shift.max() > 0.9 * d


def top_share(keys, domain, frac=0.01):
    counts = np.sort(np.bincount(keys, minlength=domain))[::-1]
    return counts[: max(1, int(domain * frac))].sum() / counts.sum()


def test_generator_skew():
    keys = 4096
    hot = generate_all(gen_plan(skew=0.9, keys=keys).generator)
    flat = generate_all(gen_plan(skew=0.5, keys=keys).generator)
    for d in (hot, flat):
        assert d.key.min() >= 0 and d.key.max() < keys
    assert top_share(hot.key, keys) > 0.3
    assert top_share(flat.key, keys) < 0.02
    counts = np.bincount(flat.key, minlength=keys)
    assert (counts > 0).all() and counts.max() < 3 * counts.mean()
    # the hot keys are spread over the domain, not packed at one end
    top = np.argsort(np.bincount(hot.key, minlength=keys))[-40:]
    assert top.min() < keys // 4 and top.max() > 3 * keys // 4


@pytest.mark.parametrize("levels, p_upper", [(20, 0.3), (10, 0.1), (7, 0.45), (3, 0.3)])
def test_bmodel_tables_give_every_level_its_upper_half_with_the_skews_probability(levels, p_upper):
    tables = bmodel_tables(levels, p_upper)
    assert sum(bits for bits, _ in tables) == levels
    for bits, table in tables:  # the share of the 65536 draws that set each level's bit
        assert len(table) == 1 << 16 and table.max() < 1 << bits
        for level in range(bits):
            assert abs(((table >> level) & 1).mean() - p_upper) <= bits / (1 << 16)
    # and the generator's keys, mapped back to their ranks, have those bits
    cfg = gen_plan(keys=1 << levels, skew=1 - p_upper, duration=2.0)
    src, data = GeneratorSource(cfg.generator), generate_all(cfg.generator)
    rank = np.argsort(src._perm)[data.key]
    for level in range(levels):
        assert abs(((rank >> level) & 1).mean() - p_upper) < 0.01, level


def test_generator_uniform_keys_pass_a_chi_square_bound():
    keys = 512
    d = generate_all(gen_plan(distribution="uniform", keys=keys, duration=4.0).generator)
    counts = np.bincount(d.key, minlength=keys)
    assert len(counts) == keys
    expected = len(d.key) / keys
    chi2 = ((counts - expected) ** 2 / expected).sum()
    # chi-square with keys - 1 = 511 degrees of freedom: mean 511, sd 32; 700 is ~6 sd out
    assert chi2 < 700, chi2
    # and it is not the b-model: that concentrates a far larger share in the top 1% of keys
    assert (
        top_share(d.key, keys) < 0.02 < top_share(generate_all(gen_plan(keys=keys, duration=4.0).generator).key, keys)
    )


@pytest.mark.parametrize("s", [1.0, 1.3])
def test_generator_zipf_top_keys_near_the_theoretical_share(s):
    keys = 4096
    d = generate_all(gen_plan(distribution="zipf", zipf=s, keys=keys, duration=4.0).generator)
    assert d.key.min() >= 0 and d.key.max() < keys
    counts = np.sort(np.bincount(d.key, minlength=keys))[::-1] / len(d.key)
    harmonic = (np.arange(1, keys + 1, dtype=float) ** -s).sum()
    for k in (1, 2, 3):  # the k-th most frequent key carries about k^-s / H(keys, s) of the tuples
        theory = k**-s / harmonic
        assert abs(counts[k - 1] - theory) < 0.1 * theory, (k, counts[k - 1], theory)
    assert counts[:10].sum() == pytest.approx((np.arange(1, 11, dtype=float) ** -s).sum() / harmonic, rel=0.05)
    # the heavy hitters are spread over the domain by the permutation, like the b-model's
    heavy = np.argsort(np.bincount(d.key, minlength=keys))[-8:]
    assert heavy.max() - heavy.min() > keys // 4


def test_generator_high_duplication_uses_every_key_many_times():
    # few distinct keys, many tuples each (the Rovio-like workload): uniform over a small domain
    keys = 64
    d = generate_all(gen_plan(distribution="uniform", keys=keys, duration=2.0).generator)
    distinct, per_key = np.unique(d.key, return_counts=True)
    assert len(distinct) == keys
    assert per_key.min() > 0.8 * len(d.key) / keys and per_key.max() < 1.2 * len(d.key) / keys


def test_generator_distribution_is_reproducible_by_seed_and_leaves_the_b_model_alone():
    for dist in ("uniform", "zipf"):
        a, b = (generate_all(gen_plan(distribution=dist, seed=7, duration=1.0).generator) for _ in range(2))
        c = generate_all(gen_plan(distribution=dist, seed=8, duration=1.0).generator)
        assert np.array_equal(a.key, b.key) and np.array_equal(a.ts, b.ts)
        assert not np.array_equal(a.key[:1000], c.key[:1000])
    # choosing the key distribution changes the keys only: arrivals, ids and values stay those of the seed
    bm, zf = (
        generate_all(gen_plan(duration=1.0).generator),
        generate_all(gen_plan(distribution="zipf", duration=1.0).generator),
    )
    assert np.array_equal(bm.ts, zf.ts) and np.array_equal(bm.id, zf.id) and not np.array_equal(bm.key, zf.key)


def test_generator_keys_not_power_of_two():
    keys = 1000
    d = generate_all(gen_plan(keys=keys, skew=0.7, duration=2.0).generator)
    assert d.key.min() >= 0 and d.key.max() < keys
    assert len(np.unique(d.key)) > 500


def test_generator_rejects_bad_limit():
    with pytest.raises(ValueError):
        open_source(gen_plan()).next_chunk(0)


# --------------------------------------------------------------------------- file

TABLE = {
    "stream": ["R", "S", "S", "R"],
    "id": [1, 1, 2, -7],
    "ts": [0.5, 0.25, 1e-3, 2.0],
    "key": [10, 10, 3, 9223372036854775807],
    "value": [1.5, -2.0, 0.0, 3.25],
}


def check_table(data):
    np.testing.assert_array_equal(data.stream, [STREAM_R, STREAM_S, STREAM_S, STREAM_R])
    assert data.stream.dtype == np.int8
    np.testing.assert_array_equal(data.id, TABLE["id"])
    np.testing.assert_array_equal(data.ts, micros(TABLE["ts"]))
    np.testing.assert_array_equal(data.key, TABLE["key"])
    np.testing.assert_array_equal(data.value, TABLE["value"])


def test_csv_round_trip(tmp_path):
    rows = "\n".join(",".join(str(TABLE[c][i]) for c in TABLE) for i in range(4))
    p = write_csv(tmp_path, "stream,id,ts,key,value\n" + rows + "\n")
    src = open_source(file_plan(p))
    check_table(drain(src, 3))
    assert src.accepted == 4 and rejected(src) is None


def test_parquet_round_trip(tmp_path):
    for name in ("in.parquet", "in.pq"):
        p = tmp_path / name
        pq.write_table(pa.table(TABLE), p)
        src = open_source(file_plan(p))
        check_table(drain(src, 100))
        assert src.accepted == 4 and rejected(src) is None


def test_the_single_file_is_two_declared_streams_of_one_file_read_in_its_row_order(tmp_path):
    from master.sources.streams import StreamsSource

    p = tmp_path / "in.parquet"
    pq.write_table(pa.table(TABLE), p)
    src = open_source(file_plan(p))
    assert isinstance(src, StreamsSource) and src.in_rows and src.log is None
    assert {n: (s.path, s.select["value"], s.prefix) for n, s in src.specs.items()} == {
        "R": (str(p), "R", "r_"),
        "S": (str(p), "S", "s_"),
    }
    check_table(drain(src, 1))  # the file's row order, both streams in one


def test_parquet_string_columns_use_the_csv_rules(tmp_path):
    p = tmp_path / "s.parquet"
    pq.write_table(
        pa.table(
            {
                "stream": ["R", "S", "S"],
                "id": ["1", "x", "3"],
                "ts": ["1.5", "2", "inf"],
                "key": [1, 2, 3],
                "value": [None, 2.0, 1.0],
            }
        ),
        p,
    )
    src = open_file(p)
    d = drain(src, 10)
    np.testing.assert_array_equal(d.id, [1])
    np.testing.assert_array_equal(d.value, [0.0])
    rej = rejected(src)
    assert rej.column("row").to_pylist() == [2, 3]
    assert rej.column("column").to_pylist() == ["id", "ts"]


def test_value_absent_or_null_is_zero(tmp_path):
    p = write_csv(tmp_path, "stream,id,ts,key\nR,1,0.5,3\nS,2,0.7,4\n")
    d = drain(open_file(p), 10)
    np.testing.assert_array_equal(d.value, [0.0, 0.0])
    p = write_csv(tmp_path, "stream,id,ts,key,value\nR,1,0.5,3,\nS,2,0.7,4,2.5\n", "b.csv")
    src = open_file(p)
    np.testing.assert_array_equal(drain(src, 10).value, [0.0, 2.5])
    assert rejected(src) is None


def test_csv_lenient_syntax(tmp_path):
    p = write_csv(tmp_path, "stream,id,ts,key,value,extra\n R , +5 , 1e-1 ,-0003, .5 ,whatever\nS,6,2.,4,-Inf,1\n")
    src = open_file(p)
    d = drain(src, 10)
    assert rejected(src) is None
    np.testing.assert_array_equal(d.stream, [STREAM_R, STREAM_S])
    np.testing.assert_array_equal(d.id, [5, 6])
    np.testing.assert_array_equal(d.ts, [100_000, 2_000_000])
    np.testing.assert_array_equal(d.key, [-3, 4])
    np.testing.assert_array_equal(d.value, [0.5, -np.inf])


def test_csv_int64_minimum_is_an_integer_for_id_and_key_and_one_below_is_not(tmp_path):
    # the minimum has one digit more in magnitude than the maximum: only a minus sign may carry it
    lo, hi = "-9223372036854775808", "9223372036854775807"
    p = write_csv(
        tmp_path,
        "stream,id,ts,key\n"
        f"R,{lo},1.0,{lo}\nS,{hi},1.0,{lo}\nS,-0{lo[1:]},1.5,{hi}\n"  # a leading zero: still it
        f"R,-9223372036854775809,1.0,1\nR,1,1.0,9223372036854775808\nS,5,1.0,+9223372036854775808\n",
    )
    src = open_file(p)
    d = drain(src, 10)
    np.testing.assert_array_equal(d.id, [np.iinfo(np.int64).min, np.iinfo(np.int64).max, np.iinfo(np.int64).min])
    np.testing.assert_array_equal(d.key, [np.iinfo(np.int64).min, np.iinfo(np.int64).min, np.iinfo(np.int64).max])
    rej = rejected(src).to_pydict()
    assert rej["row"] == [4, 5, 6] and rej["column"] == ["id", "key", "key"]
    assert set(rej["reason"]) == {"id is not an integer", "key is not an integer"}


def test_ts_out_of_range_is_set_aside_with_its_reason(tmp_path):
    # the limit is 2**61 us = 2305843009213.693952 s, either side of zero
    p = write_csv(
        tmp_path,
        "stream,id,ts,key\nR,1,2305843009213.693951,1\nR,2,2305843009213.694,1\n"
        "S,3,-2305843009213.694,1\nS,4,1e300,1\nS,5,99999999999999999999999.5,1\n"
        "S,6,-2305843009213.693951,1\n",
    )
    src = open_file(p)
    np.testing.assert_array_equal(drain(src, 10).ts, [2**61 - 1, -(2**61 - 1)])
    rej = rejected(src).to_pydict()
    assert rej["row"] == [2, 3, 4, 5] and set(rej["column"]) == {"ts"}
    assert all(r.startswith("ts is out of range") for r in rej["reason"])


def test_rejections_row_column_reason(tmp_path):
    text = """stream,id,ts,key,value
R,1,0.1,1,1.0
X,2,0.2,1,1.0
R,abc,0.3,1,1.0
R,4,soon,1,1.0
R,5,nan,1,1.0
R,6,inf,1,1.0
R,7,0.7,1.5,1.0
R,8,0.8,1,lots
S,1,0.9,1,1.0
R,1,1.0,1,1.0
R,,1.1,1,1.0
R,12,1.2,99999999999999999999,1.0
R,1,1.3,1,1.0
Q,zz,bad,bad,bad
"""
    p = write_csv(tmp_path, text)
    src = open_file(p)
    d = drain(src, 100)
    np.testing.assert_array_equal(d.id, [1, 1])
    np.testing.assert_array_equal(d.stream, [STREAM_R, STREAM_S])
    assert src.accepted == 2
    table = rejected(src)
    rej = table.to_pydict()
    assert rej["row"] == [2, 3, 4, 5, 6, 7, 8, 10, 11, 12, 13, 14]
    assert rej["column"] == ["stream", "id", "ts", "ts", "ts", "key", "value", "id", "id", "key", "id", "stream"]
    assert rej["reason"][:7] == [
        "stream is not R or S",
        "id is not an integer",
        "ts is not a number or an ISO-8601 time",
        "ts is NaN or infinite",
        "ts is NaN or infinite",
        "key is not an integer",
        "value is not a number",
    ]
    assert rej["reason"][7] == "duplicate id 1 in stream R (first seen at row 1)"
    assert rej["reason"][8] == "id is not an integer"
    assert rej["reason"][10] == "duplicate id 1 in stream R (first seen at row 1)"
    assert rej["file"] == [str(p)] * 12
    assert rej["stream"][0] == "X" and rej["id"][1] == "abc" and rej["ts"][3] == "nan" and rej["value"][6] == "lots"
    assert rej["id"][8] is None  # the empty cell
    assert table.schema.field("row").type == pa.int64()
    assert all(table.schema.field(c).type == pa.string() for c in ("file", "column", "reason", "stream", "value"))


def test_duplicate_first_seen_is_first_good_row(tmp_path):
    # a row rejected for another reason does not count as the first occurrence
    p = write_csv(tmp_path, "stream,id,ts,key\nS,7,x,1\nS,7,1,1\nS,7,2,1\nR,7,3,1\n")
    src = open_file(p)
    np.testing.assert_array_equal(drain(src, 10).ts, [1_000_000, 3_000_000])
    assert rejected(src).column("reason").to_pylist() == [
        "ts is not a number or an ISO-8601 time",
        "duplicate id 7 in stream S (first seen at row 2)",
    ]


@pytest.mark.parametrize("order", ["rising", "shuffled", "with_duplicates"])
def test_duplicates_match_a_first_seen_reference(tmp_path, order):
    # ids rising per stream take the one-pass check, the others the sort: both must mark the same rows
    rng = np.random.default_rng(5)
    stream = rng.choice(["R", "S"], 400)
    ids = np.empty(400, np.int64)
    for s in ("R", "S"):
        mine = stream == s
        ids[mine] = np.cumsum(rng.integers(1, 4, mine.sum()))
    if order != "rising":
        perm = rng.permutation(400)
        stream, ids = stream[perm], ids[perm]
    if order == "with_duplicates":
        ids[rng.choice(400, 60)] = ids[rng.choice(400, 60)]
    p = tmp_path / "in.parquet"
    pq.write_table(pa.table({"stream": stream, "id": ids, "ts": np.arange(400.0), "key": np.zeros(400, np.int64)}), p)
    seen, expected = {}, []
    for row, (s, i) in enumerate(zip(stream, ids)):
        if (s, i) in seen:
            expected.append(f"duplicate id {i} in stream {s} (first seen at row {seen[s, i] + 1})")
        seen.setdefault((s, i), row)
    src = open_file(p)
    drain(src, 1000)
    rej = rejected(src)
    got = [] if rej is None else rej.column("reason").to_pylist()
    assert got == expected
    assert src.accepted == 400 - len(expected)
    assert (len(expected) > 0) == (order == "with_duplicates")


def test_rejected_value_column_absent_is_null(tmp_path):
    p = write_csv(tmp_path, "stream,id,ts,key\nR,1,x,1\nS,2,1.0,1\n")
    src = open_file(p)
    assert src.next_chunk(5) is not None and src.accepted == 1
    assert rejected(src).column("value").to_pylist() == [None]


def test_missing_file(tmp_path):
    with pytest.raises(InputError, match=r"nope\.csv.*does not exist"):
        open_source(file_plan(tmp_path / "nope.csv"))


def test_missing_column(tmp_path):
    p = write_csv(tmp_path, "stream,id,when,key\nR,1,0.5,3\n", "cols.csv")
    with pytest.raises(InputError, match=r"cols\.csv.*\bts\b.*found: stream, id, when, key") as e:
        open_file(p)
    assert "\n" not in str(e.value)
    p = tmp_path / "cols.parquet"
    pq.write_table(pa.table({"stream": ["R"], "ts": [1.0]}), p)
    with pytest.raises(InputError, match=r"cols\.parquet.*id, key"):
        open_file(p)


def test_bad_extension(tmp_path):
    p = write_csv(tmp_path, "stream,id,ts,key\n", "in.txt")
    with pytest.raises(InputError, match=r"in\.txt.*\.csv.*\.parquet.*\.pq"):
        open_file(p)


def test_unreadable_files(tmp_path):
    p = tmp_path / "junk.parquet"
    p.write_bytes(b"not parquet at all")
    with pytest.raises(InputError, match=r"junk\.parquet.*Parquet"):
        open_file(p)
    p = write_csv(tmp_path, "", "empty.csv")
    with pytest.raises(InputError, match=r"empty\.csv"):
        open_file(p)
    p = write_csv(tmp_path, "stream,id,ts,key\nR,1,2\n", "ragged.csv")
    with pytest.raises(InputError, match=r"ragged\.csv"):
        open_file(p)


def test_header_only_csv_gives_zero_tuples(tmp_path):
    p = write_csv(tmp_path, "stream,id,ts,key,value\n")
    src = open_file(p)
    assert src.next_chunk(10) is None
    assert src.accepted == 0 and rejected(src) is None


def test_file_chunks_follow_file_order(tmp_path):
    n = 1000
    ids = np.arange(n)[::-1]
    streams = np.where(ids % 3 == 0, "S", "R")
    p = tmp_path / "big.parquet"
    pq.write_table(pa.table({"stream": streams, "id": ids, "ts": ids * 0.5, "key": ids % 7}), p)
    src = open_file(p)
    sizes, parts = [], []
    while (c := src.next_chunk(300)) is not None:
        sizes.append(len(c.id))
        parts.append(c.id)
    assert sizes == [300, 300, 300, 100]
    np.testing.assert_array_equal(np.concatenate(parts), ids)


def test_shift_moves_the_hot_keys_but_keeps_the_skew():
    from common.workload import generate_all

    base = ["generator.duration=4", "generator.rate=20000", "generator.keys=4096", "generator.skew=0.8"]
    still = generate_all(load_plan(None, base).generator)
    moving = generate_all(load_plan(None, base + ["generator.shift=2.0"]).generator)

    def top(c, lo, hi):
        sel = (c.ts >= lo * 1e6) & (c.ts < hi * 1e6)
        keys, counts = np.unique(c.key[sel], return_counts=True)
        return {int(keys[np.argmax(counts)])}, counts.max() / sel.sum()  # the hottest key stands well clear

    a1, share1 = top(still, 0, 2)
    a2, _ = top(still, 2, 4)
    b1, _ = top(moving, 0, 2)
    b2, share2 = top(moving, 2, 4)
    assert a1 == a2 and b1 == a1  # without shift, and before the first shift, the same hot keys
    assert not (b2 & b1)  # after the shift, other keys are hot
    assert abs(share1 - share2) < 0.05  # with the same skew


# --------------------------------------------------------------------------- streamed file input


def generated_file(tmp_path, fmt, bad_every=997, row_group=5000, **gen):
    """The generated workload as a file with bad rows inserted: (path, the generated tuples, the bad rows)."""
    data = generate_all(gen_plan(**gen).generator)
    p = tmp_path / f"in.{fmt}"
    return p, data, write_input(p, data, row_group, bad_every)


def chunks_of(src, limits):
    """Drain with chunk sizes taken in turn from `limits`."""
    parts, i = [], 0
    while (c := src.next_chunk(limits[i % len(limits)])) is not None:
        assert 0 < len(c.id) <= limits[i % len(limits)]
        parts.append(c)
        i += 1
    return parts


@pytest.mark.parametrize("fmt", ["csv", "parquet"])
def test_streamed_reading_gives_the_whole_files_tuples_in_order_and_lists_every_bad_row(tmp_path, fmt):
    p, data, bad = generated_file(tmp_path, fmt, duration=10.0)
    if fmt == "parquet":
        assert pq.ParquetFile(p).num_row_groups > 30
    else:
        assert p.stat().st_size > 4 << 20  # several of the CSV reader's 1 MiB blocks
    src = open_file(p)
    parts = chunks_of(src, [65536, 7, 30001, 1])
    got = Chunk(*(np.concatenate(c) for c in zip(*parts)))
    for a, b in zip(got, data):
        np.testing.assert_array_equal(a, b)
    assert all(len(c.id) == lim for c, lim in zip(parts[:-1], [65536, 7, 30001, 1] * len(parts)))  # full chunks
    rej = rejected(src)
    assert rej.column("row").to_pylist() == bad.tolist()
    assert set(rej.column("reason").to_pylist()) == {"ts is not a number or an ISO-8601 time"}
    assert src.finish()["rejected"] == len(bad)


@pytest.mark.parametrize("fmt", ["csv", "parquet"])
def test_seeking_to_a_position_lands_on_the_same_next_tuple_and_lists_each_bad_row_once(tmp_path, fmt):
    p, data, bad = generated_file(tmp_path, fmt, bad_every=331, row_group=3000, duration=3.0)
    # duplicates whose first rows lie before the position but within the window: found after a seek too
    table = pq.read_table(p) if fmt == "parquet" else pacsv.read_csv(p)
    ids = table["id"].to_numpy().copy()
    streams = table["stream"].to_numpy(zero_copy_only=False)
    dup_at = [40_000, 40_002]
    for row in dup_at:
        earlier = np.flatnonzero(streams[: row - 100] == streams[row])[-1]
        ids[row] = ids[earlier]
    table = table.set_column(1, "id", pa.array(ids))
    if fmt == "csv":
        pacsv.write_csv(table, p)
    else:
        pq.write_table(table, p, row_group_size=3000)
    whole = open_file(p, window=2000)
    ref_parts = chunks_of(whole, [65536])
    reference = Chunk(*(np.concatenate(c) for c in zip(*ref_parts)))
    ref_rejected = rejected(whole)
    assert len(ref_rejected) == len(bad) + len(dup_at)

    first = file_source(p, 2000, RejectedListing(tmp_path / "listing", "parquet", 50))
    taken = sum(len(c.id) for c in chunks_of_until(first, 38_500))
    where = first.position()
    first.next_chunk(5000)  # read on past the position, as a run does before it crashes: listed again after
    first.listing.flush()
    again = file_source(p, 2000, RejectedListing(tmp_path / "listing", "parquet", 50))
    again.seek(where)
    rest = chunks_of(again, [4096, 999])
    for a, b in zip(Chunk(*(np.concatenate(c) for c in zip(*rest))), reference):
        np.testing.assert_array_equal(a, b[taken:])
    again.finish()
    listed = read_tables(tmp_path / "listing")
    assert listed.column("row").to_pylist() == ref_rejected.column("row").to_pylist()
    assert listed.column("reason").to_pylist() == ref_rejected.column("reason").to_pylist()
    assert again.finish()["rejected"] == len(ref_rejected)


def chunks_of_until(src, n):
    parts = []
    while n > 0:
        parts.append(src.next_chunk(min(n, 3333)))
        n -= len(parts[-1].id)
    return parts


def test_a_larger_files_source_holds_a_bounded_amount_of_memory(tmp_path):
    import tracemalloc

    n, p = 4_000_000, tmp_path / "big.parquet"
    ids = np.arange(n, dtype=np.int64)
    pq.write_table(
        pa.table(
            {
                "stream": pa.array(np.where(ids % 2, "S", "R")).dictionary_encode(),
                "id": ids // 2,
                "ts": ids * 1e-4,
                "key": ids % 1000,
                "value": np.ones(n),
            }
        ),
        p,
        row_group_size=100_000,
    )
    column_bytes = n * (1 + 4 * 8)  # what the tuples take as arrays
    tracemalloc.start()
    base_arrow = pa.total_allocated_bytes()
    src = open_file(p)
    seen, peak_arrow = 0, 0
    while (c := src.next_chunk(65536)) is not None:
        seen += len(c.id)
        peak_arrow = max(peak_arrow, pa.total_allocated_bytes() - base_arrow)
    _, peak_py = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    src.finish()
    assert seen == n
    bound = 48 << 20  # read-ahead batches, the row group being decoded, the chunk handed out
    assert column_bytes > 2 * bound and peak_arrow + peak_py < bound, (peak_arrow, peak_py)


def test_damage_far_into_a_csv_stops_reading_there_with_the_file_and_row(tmp_path):
    good = "".join(f"R,{i},{i * 0.001},{i % 7}\n" for i in range(200_000))  # several 1 MiB blocks
    p = write_csv(tmp_path, "stream,id,ts,key\n" + good + "R,1\n" + "S,1,1.0,1\n")
    src = open_file(p)  # the first blocks are fine: the file opens
    taken = 0
    with pytest.raises(InputError, match=r"in\.csv.*cannot be read as CSV at row [0-9,]+ or after"):
        while (c := src.next_chunk(50_000)) is not None:
            taken += len(c.id)
    assert 0 < taken <= 200_000


# --------------------------------------------------------------------------- the user's time types


def ms_table(n=500, seed=3):
    """Random rows whose ts are whole milliseconds, as integer ms, plus the same in seconds as written."""
    rng = np.random.default_rng(seed)
    ms = 1_700_000_000_000 + np.sort(rng.integers(-(10**6), 10**9, n))
    ms[:3] = [-1, 0, -1_500]  # before the epoch, too
    seconds = [f"{'-' * (m < 0)}{abs(m) // 1000}.{abs(m) % 1000:03d}" for m in ms.tolist()]
    cols = {"stream": rng.choice(["R", "S"], n).astype(object), "id": np.arange(n), "key": rng.integers(0, 9, n)}
    return cols, ms, seconds


def tuples_of(path, ts_unit="s"):
    src = file_source(path, 1_000_000, RejectedListing(path.parent / f"rejected-{path.name}", "parquet", 1000), ts_unit)
    out = drain(src, 10_000)
    assert rejected(src) is None
    return out


def assert_same(a, b):
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)


def test_timestamp_columns_of_any_unit_and_zone_give_the_seconds_files_tuples(tmp_path):
    cols, ms, seconds = ms_table()
    write_csv(
        tmp_path,
        "stream,id,ts,key\n"
        + "".join(f"{s},{i},{t},{k}\n" for s, i, t, k in zip(cols["stream"], cols["id"], seconds, cols["key"])),
        "sec.csv",
    )
    want = tuples_of(tmp_path / "sec.csv")
    np.testing.assert_array_equal(want.ts, micros(np.array([float(s) for s in seconds])))
    for name, arr in [
        ("ms_utc", pa.array(ms, pa.timestamp("ms", tz="UTC"))),
        ("ns", pa.array(ms * 10**6, pa.timestamp("ns"))),
        ("us_tokyo", pa.array(ms * 1000, pa.timestamp("us", tz="Asia/Tokyo"))),
        ("ms_as_s", pa.array(ms, pa.timestamp("ms")).cast(pa.timestamp("ns"))),
    ]:
        p = tmp_path / f"{name}.parquet"
        pq.write_table(pa.table({**cols, "ts": arr}), p, row_group_size=128)
        assert_same(tuples_of(p), want)


def test_nanoseconds_round_half_to_even_to_the_microsecond(tmp_path):
    ns = np.array(
        [
            1_700_000_000_123_456_500,
            1_700_000_000_123_457_500,
            1_700_000_000_123_457_501,
            -1_500,
            -2_500,
            499,
            999_999_999,
        ]
    )
    p = tmp_path / "ns.parquet"
    pq.write_table(
        pa.table(
            {
                "stream": ["R"] * len(ns),
                "id": np.arange(len(ns)),
                "key": np.ones(len(ns), np.int64),
                "ts": pa.array(ns, pa.timestamp("ns", tz="UTC")),
            }
        ),
        p,
    )
    want = [int(Decimal(int(x)).scaleb(-3).to_integral_value(ROUND_HALF_EVEN)) for x in ns.tolist()]
    np.testing.assert_array_equal(tuples_of(p).ts, want)
    text = tmp_path / "ns.csv"  # the same integers as text, in source.ts_unit = "ns"
    text.write_text("stream,id,ts,key\n" + "".join(f"R,{i},{x},1\n" for i, x in enumerate(ns.tolist())))
    np.testing.assert_array_equal(tuples_of(text, "ns").ts, want)


def test_ts_unit_ms_reads_integer_float_and_text_milliseconds(tmp_path):
    cols, ms, seconds = ms_table()
    write_csv(
        tmp_path,
        "stream,id,ts,key\n"
        + "".join(f"{s},{i},{t},{k}\n" for s, i, t, k in zip(cols["stream"], cols["id"], seconds, cols["key"])),
        "sec.csv",
    )
    want = tuples_of(tmp_path / "sec.csv")
    write_csv(
        tmp_path,
        "stream,id,ts,key\n"
        + "".join(f"{s},{i},{t},{k}\n" for s, i, t, k in zip(cols["stream"], cols["id"], ms, cols["key"])),
        "ms.csv",
    )
    assert_same(tuples_of(tmp_path / "ms.csv", "ms"), want)
    decimals = pa.array(ms).cast(pa.decimal128(20, 0))
    for name, ts in [("int", ms), ("float", ms.astype(np.float64)), ("decimal", decimals)]:
        p = tmp_path / f"ms-{name}.parquet"
        pq.write_table(pa.table({**cols, "ts": ts}), p)
        assert_same(tuples_of(p, "ms"), want)
    cfg = file_plan(tmp_path / "ms.csv", ts_unit="ms")
    np.testing.assert_array_equal(drain(open_source(cfg), 10_000).ts, want.ts)
    # the default stays seconds: the same numbers are seconds, a thousand times later
    np.testing.assert_array_equal(tuples_of(tmp_path / "ms.csv").ts, ms * 10**6)


ISO = [  # (text, the same instant as a Python datetime)
    ("2026-11-25T03:10:31.123Z", datetime(2026, 11, 25, 3, 10, 31, 123000, timezone.utc)),
    ("2026-11-25 03:10:31.123456+01:00", datetime(2026, 11, 25, 3, 10, 31, 123456, timezone(timedelta(hours=1)))),
    ("2026-11-25T03:10:31", datetime(2026, 11, 25, 3, 10, 31, tzinfo=timezone.utc)),  # no zone: UTC
    ("2026-11-25T03:10-0530", datetime(2026, 11, 25, 3, 10, tzinfo=timezone(-timedelta(hours=5, minutes=30)))),
    ("2026-11-25", datetime(2026, 11, 25, tzinfo=timezone.utc)),
    ("1969-12-31T23:59:59.5Z", datetime(1969, 12, 31, 23, 59, 59, 500000, timezone.utc)),
    ("2024-02-29T12:00:00,25+0200", datetime(2024, 2, 29, 12, 0, 0, 250000, timezone(timedelta(hours=2)))),
]


def epoch_micros(d: datetime) -> int:
    delta = d - datetime(1970, 1, 1, tzinfo=timezone.utc)
    return (delta.days * 86400 + delta.seconds) * 10**6 + delta.microseconds


@pytest.mark.parametrize("fmt", ["csv", "parquet"])
def test_iso_text_with_and_without_zone_and_bad_dates_set_aside(tmp_path, fmt):
    texts = [t for t, _ in ISO] + ["2026-02-30T00:00:00Z", "2026-11-25T25:00:00", "yesterday", "1.5"]
    table = pa.table(
        {"stream": ["R"] * len(texts), "id": list(range(1, len(texts) + 1)), "ts": texts, "key": [1] * len(texts)}
    )
    p = tmp_path / f"iso.{fmt}"
    pacsv.write_csv(table, p) if fmt == "csv" else pq.write_table(table, p)
    src = open_file(p)
    d = drain(src, 100)
    np.testing.assert_array_equal(d.ts, [epoch_micros(x) for _, x in ISO] + [1_500_000])
    rej = rejected(src).to_pydict()
    assert rej["row"] == [len(ISO) + 1, len(ISO) + 2, len(ISO) + 3]
    assert set(rej["reason"]) == {"ts is not a number or an ISO-8601 time"}
    assert rej["ts"] == texts[len(ISO) : len(ISO) + 3]


@pytest.mark.parametrize(
    "column,cells,found",
    [
        ("key", ["u_1", "u_2"], "string"),  # string ids where integers are needed
        ("ts", ["true", "false"], "bool"),  # a boolean ts
        ("id", ["", ""], "null"),  # empty in every row
        ("stream", ["left", "right"], "string"),
    ],
)
def test_a_csv_column_none_of_whose_first_cells_converts_is_one_error(tmp_path, column, cells, found):
    rows = {"stream": ["R", "S"], "id": ["1", "2"], "ts": ["0.5", "0.7"], "key": ["3", "4"], column: cells}
    p = write_csv(
        tmp_path,
        "stream,id,ts,key\n"
        + "".join(",".join(rows[c][i] for c in ("stream", "id", "ts", "key")) + "\n" for i in range(2)),
        "typed.csv",
    )
    with pytest.raises(InputError) as e:
        open_file(p)
    msg = str(e.value)
    assert "typed.csv" in msg and f"column {column} of type {found}" in msg and "expected" in msg
    assert "\n" not in msg and msg.count("has column") == 1


@pytest.mark.parametrize(
    "column,values,found",
    [
        ("ts", pa.array([True, False]), "bool"),
        ("key", pa.array([[1], [2]]), "list<element: int64>"),
        ("id", pa.array([b"1", b"2"]), "binary"),
        ("stream", pa.array([0, 1]), "int64"),
        ("key", pa.array(["u_1", "u_2"]), "string"),  # text: checked on the first batch
    ],
)
def test_a_parquet_column_of_a_wrong_type_is_one_error_before_any_row(tmp_path, column, values, found):
    cols = {"stream": pa.array(["R", "S"]), "id": pa.array([1, 2]), "ts": pa.array([0.5, 0.7]), "key": pa.array([3, 4])}
    cols[column] = values
    p = tmp_path / "typed.parquet"
    pq.write_table(pa.table(cols), p)
    with pytest.raises(InputError) as e:
        open_file(p)
    msg = str(e.value)
    assert "typed.parquet" in msg and f"column {column} of type {found}" in msg
    assert schema.EXPECTED[column] in msg and "\n" not in msg


def test_a_few_bad_cells_in_the_first_batch_are_still_rows_set_aside(tmp_path):
    p = write_csv(tmp_path, "stream,id,ts,key\nR,1,0.5,u_1\nS,2,true,4\nR,3,0.9,5\n")
    src = open_file(p)
    np.testing.assert_array_equal(drain(src, 10).id, [3])
    assert rejected(src).column("column").to_pylist() == ["key", "ts"]


def test_date_columns_are_midnight_utc(tmp_path):
    days = [date(2026, 11, 25), date(1969, 12, 31)]
    for unit, arr in [("date32", pa.array(days, pa.date32())), ("date64", pa.array(days, pa.date64()))]:
        p = tmp_path / f"{unit}.parquet"
        pq.write_table(pa.table({"stream": ["R", "S"], "id": [1, 2], "ts": arr, "key": [1, 1]}), p)
        midnights = [datetime(d.year, d.month, d.day, tzinfo=timezone.utc) for d in days]
        np.testing.assert_array_equal(tuples_of(p).ts, [epoch_micros(m) for m in midnights])


def test_event_time_pacing_hands_tuples_on_as_their_times_say_with_bursts_gaps_and_disorder_kept():
    """source.speed: at speed 2 a tuple is due (T - T0) / 2 s after the first, T the largest time up to it in
    arrival order: a tuple out of order goes with the one before it, a gap in event time is a gap in handing on,
    a burst goes at once; what is not due yet waits (an empty chunk), and each side's rows handed on are known."""
    from master.sources.paced import EventTimePaced

    us = 1_000_000
    ts = np.array([0, 0.5, 0.4, 3.0, 3.0, 3.0, 3.2]) * us
    chunk = Chunk(
        stream=np.array([0, 1, 0, 1, 0, 1, 0]),
        id=np.array([0, 0, 1, 1, 2, 2, 3]),
        ts=ts.astype(np.int64),
        key=np.zeros(7, np.int64),
        value=np.zeros(7),
        terms=no_terms(7),
    )

    class Once:
        given = False

        def next_chunk(self, limit):
            if self.given:
                return None
            self.given = True
            return chunk

        def ended(self):
            return [self.given, self.given]

        rows_taken = [4, 3]

    now = [100.0]
    paced = EventTimePaced(Once(), 2.0, clock=lambda: now[0])
    got = []
    for t in (100.0, 100.2, 100.25, 101.0, 101.5, 101.59, 101.61, 102.0):
        now[0] = t
        c = paced.next_chunk(10)
        got.append((t, c.ts.tolist() if c is not None else None))
    assert got == [
        (100.0, [0]),
        (100.2, []),
        (100.25, [500_000, 400_000]),  # 0.5 s of event time at speed 2; the late one with it
        (101.0, []),  # the gap: nothing until 3.0 s / 2
        (101.5, [3_000_000] * 3),  # the burst at once
        (101.59, []),
        (101.61, [3_200_000]),
        (102.0, None),
    ]
    assert paced.rows_taken == [4, 3] and paced.handed == [4, 3] and paced.ended() == [True, True]
