"""Asymmetric time bounds (join.lower / join.upper) on the real cluster under mpirun, differentially:
r and s join iff lower <= s.ts - r.ts <= upper, both ends included, against the reference join over the whole
input (tests/reference.py) in integer microseconds.

The input is CSV with millisecond decimals on a 10 ms grid, so many pairs lie exactly at lower and at
upper and the rows alone of outer joins are decided by each stream's own threshold (R final below W - upper,
S below W + lower): one-sided, both-negative and both-positive bounds, with moves, two dispatchers and outer
joins.  The randomized matrix (tests/matrix.py) draws bounds with every other feature.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pytest

from tests.runs import run_cluster
from tests.reference import late_flags, reference_outer, reference_pairs
from tests.cluster.test_balance_cluster import FORCED_CHURN, straggler
from tests.cluster.test_exact_time import decimal_strings, workload

MAX_DELAY = 60_000  #: us


@pytest.mark.parametrize(
    "lower,upper,join_type,ranks,extra",
    [
        (-50_000, 200_000, "full", 4, {**FORCED_CHURN, "source.rate": 8000.0}),  # moves while rows wait alone
        (0, 150_000, "left", 4, {"cluster.dispatchers": 2}),  # s at or after r only
        (-300_000, -100_000, "right", 3, {}),  # s before r only
        (100_000, 250_000, "inner", 3, {}),  # s after r, never at once
    ],
)
def test_asymmetric_bounds_join_exactly_the_reference(tmp_path, lower, upper, join_type, ranks, extra):
    n = 12000
    stream, ids, ts, key = workload(abs(lower) + upper, n, 10_000, upper, MAX_DELAY, 600)
    ids = ids.copy()
    for s in (0, 1):  # ids per stream
        ids[stream == s] = np.arange((stream == s).sum())
    pacsv.write_csv(
        pa.table({"stream": np.where(stream == 0, "R", "S"), "id": ids, "ts": decimal_strings(ts, 3), "key": key}),
        tmp_path / "in.csv",
    )
    bounds = (lower / 1e6, upper / 1e6)
    k = extra.get("cluster.dispatchers", 1)
    late = np.zeros(n, bool)
    for i in range(k):  # dispatcher i judges every k-th tuple from the i-th on (master.sources.ShardedSource)
        late[i::k] = late_flags(ts[i::k], MAX_DELAY / 1e6)
    on = ~late
    pairs, _ = reference_pairs(stream[on], ids[on], ts[on], key[on], bounds, 1e9)
    want = reference_outer(pairs, ids[on & (stream == 0)], ids[on & (stream == 1)], join_type)
    r_ts = np.zeros(n, np.int64)
    r_ts[ids[stream == 0]] = ts[stream == 0]
    s_ts = np.zeros(n, np.int64)
    s_ts[ids[stream == 1]] = ts[stream == 1]
    dt = s_ts[pairs % 2**32] - r_ts[pairs // 2**32]
    assert (dt == lower).sum() > 20 and (dt == upper).sum() > 20, "the input must probe both bounds"
    assert dt.min() == lower and dt.max() == upper
    emits = {"full": (1, 1), "left": (1, 0), "right": (0, 1), "inner": (0, 0)}[join_type]
    assert [len(w) > 50 for w in want[1:]] == [bool(e) for e in emits], "rows alone of each kind it emits"
    run = run_cluster(
        tmp_path,
        ranks,
        {
            "source.kind": "file",
            "source.path": str(tmp_path / "in.csv"),
            "source.batch": 500,
            "source.rate": 6000.0,  # 2 s, 20 batches: expiry runs between partners
            "join.lower": bounds[0],
            "join.upper": bounds[1],
            "join.max_delay": MAX_DELAY / 1e6,
            "join.type": join_type,
            "epochs.distribution": 0.1,
            "tuning.block_size": 8,
            "partitioning.partitions": 8,
            **extra,
        },
        env=straggler(k) if "balance.initial_slaves" in extra else None,
    )
    assert run.returncode == 0, run.stderr
    for name, got, w in zip(
        ("pairs", "R rows alone", "S rows alone"), (run.pairs(), run.alone("r"), run.alone("s")), want
    ):
        missing, extra_rows = np.setdiff1d(w, got), np.setdiff1d(got, w)
        assert len(np.unique(got)) == len(got), f"{name}: some emitted twice"
        assert len(missing) == 0 and len(extra_rows) == 0, (
            f"{name}: {len(missing)} missing, {len(extra_rows)} extra of {len(w)}"
        )
    assert np.array_equal(run.late_ids(), np.sort(stream[late] * 2**40 + ids[late]))
    if "balance.initial_slaves" in extra:
        assert len(run.summary["balance"]["moves"]) >= 1 and run.summary["tuples_moved"] > 0
