"""Exact event time (docs/time.md), differentially: CSV input with millisecond and microsecond decimals, many
pairs exactly one window apart and many tuples exactly max_delay behind, joined by the cluster under mpirun
and by the reference over the whole input in integer microseconds.

The reference's microseconds come from the integers the test wrote the decimals from, not from parsing
them, so neither the engine's conversion nor a float enters it.  With float seconds inside the engine these
runs lost pairs: the join test |r.ts - s.ts| <= window and expiry's block_max < W - window both went wrong
at the boundary (1,499 of 317,067 pairs at window 0.1 s, paced).
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pytest

from tests.runs import run_cluster, soak
from tests.reference import reference_pairs

EPOCH_SECONDS = 1_700_000_000  #: where a float64's ulp is 0.24 us: the decimals are not exact there
SPAN = 3_000_000  #: event time of a workload, us


def decimal_strings(micros: np.ndarray, decimals: int) -> np.ndarray:
    """EPOCH_SECONDS + micros as decimal text with `decimals` digits (micros a multiple of 10**(6 - decimals))."""
    unit = 10 ** (6 - decimals)
    assert (micros % unit == 0).all()
    whole, frac = np.divmod(micros // unit, 10**decimals)
    return np.char.add(np.char.add((EPOCH_SECONDS + whole).astype(str), "."), np.char.zfill(frac.astype(str), decimals))


def workload(seed: int, n: int, grid: int, window: int, max_delay: int, keys: int, offset: int = 0):
    """Arrival-ordered tuples on a time grid of `grid` us (shifted by `offset` us): a slowly rising clock,
    each tuple behind it by a whole number of grid steps up to 1.2 x max_delay (some late, many exactly
    max_delay behind)."""
    rng = np.random.default_rng(seed)
    clock = np.cumsum(rng.poisson(SPAN / n / grid, n)) * grid  # about SPAN us of event time
    behind = rng.integers(0, int(max_delay * 1.2) // grid + 1, n) * grid
    behind[rng.random(n) < 0.1] = max_delay  # exactly on the lateness boundary: on time
    ts = clock - behind + offset
    stream = rng.integers(0, 2, n)
    key = rng.integers(0, keys, n)
    return stream, np.arange(n), ts, key


@pytest.mark.parametrize(
    "decimals,grid,window,max_delay,rate",
    [
        soak(3, 1000, 100_000, 50_000, 8000.0),  # milliseconds, window 0.1 s, paced (as the 1.0 s window below)
        (3, 1000, 100_000, 50_000, 0.0),  # the same, as fast as the cluster takes it
        (3, 1000, 1_000_000, 300_000, 8000.0),  # window 1.0 s, paced
        (3, 1000, 1_000_000, 300_000, 0.0),
        (6, 250, 10_250, 2_750, 8000.0),  # microseconds: window 0.01025 s, ts like 1700000001.234623
    ],
)
def test_decimal_timestamps_join_exactly_at_the_window(tmp_path, decimals, grid, window, max_delay, rate):
    n = 16000
    stream, ids, ts, key = workload(
        decimals * 1000 + window // 1000 + int(rate), n, grid, window, max_delay, 60, offset=123 if decimals == 6 else 0
    )
    text = decimal_strings(ts, decimals)
    pacsv.write_csv(
        pa.table({"stream": np.where(stream == 0, "R", "S"), "id": ids, "ts": text, "key": key}), tmp_path / "in.csv"
    )
    window_s, max_delay_s = window / 1e6, max_delay / 1e6
    expected, expected_late = reference_pairs(stream, ids, ts, key, window_s, max_delay_s)
    # the input really probes the boundaries: pairs exactly one window apart among the results, and tuples
    # exactly max_delay behind the largest ts before them among the on-time ones
    r_ts, s_ts = ts[expected // 2**32], ts[expected % 2**32]
    assert (np.abs(r_ts - s_ts) == window).sum() > 100
    prev_max = np.maximum.accumulate(np.concatenate([[ts[0]], ts[:-1]]))
    assert (ts == prev_max - max_delay).sum() > 30 and len(expected_late) > 50
    run = run_cluster(
        tmp_path,
        3,
        {
            "source.kind": "file",
            "source.path": str(tmp_path / "in.csv"),
            "source.rate": rate,
            "source.batch": 2000,
            "join.window": window_s,
            "join.max_delay": max_delay_s,
            "epochs.distribution": 0.1,
            "tuning.block_size": 8,
            "partitioning.partitions": 8,
        },
    )
    assert run.returncode == 0, run.stderr
    got = run.pairs()
    missing, extra = np.setdiff1d(expected, got), np.setdiff1d(got, expected)
    assert len(missing) == 0 and len(extra) == 0, f"{len(missing)} missing, {len(extra)} extra of {len(expected)}"
    assert len(np.unique(got)) == len(got) == run.summary["results"]
    assert np.array_equal(run.late_ids(), expected_late)
    # results carry the user's time: the float64 of the decimals as written
    from protocol.output import read_tables

    t = read_tables(run.out / "results")
    assert np.array_equal(t["r_ts"].to_numpy(), text[t["r_id"].to_numpy()].astype(np.float64))
