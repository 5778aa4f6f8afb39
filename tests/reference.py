"""An independent reference for the join contract, computed over the whole input at once.

Deliberately written differently from the engine: lateness with a plain loop,
pairs with a per-key broadcast comparison (no sorting, no searchsorted, no windows
or expiry).  Pairs are encoded as r_id * 2**32 + s_id for set comparison.

Time is compared in integer microseconds, as the contract says (docs/time.md): ts given as integers are
microseconds already; ts given as floats and the window and max_delay (seconds) are converted here on
their own, through the shortest decimal of each float (Python's repr) and Decimal rounding, not through
the engine's conversion.  A window is a number w (r and s join iff |s.ts - r.ts| <= w) or a pair (lower,
upper) of seconds (iff lower <= s.ts - r.ts <= upper: join.lower / join.upper).
"""

from __future__ import annotations

from collections import defaultdict
from decimal import ROUND_HALF_EVEN, Decimal

import numpy as np


def micros(seconds) -> np.ndarray | int:
    """Seconds (a float, or an array of floats) as integer microseconds, from their decimals; integer
    arrays are taken as microseconds already."""
    if np.ndim(seconds) == 0:
        return int(Decimal(repr(float(seconds))).scaleb(6).to_integral_value(ROUND_HALF_EVEN))
    a = np.asarray(seconds)
    if a.dtype.kind in "iu":
        return a.astype(np.int64)
    return np.array([micros(x) for x in a.tolist()], dtype=np.int64)


def bounds(window) -> tuple[int, int]:
    """(lower, upper) in microseconds of a window w (-w, w) or a pair (lower, upper), in seconds."""
    lower, upper = (-window, window) if np.ndim(window) == 0 else window
    return micros(lower), micros(upper)


def late_flags(ts: np.ndarray, max_delay: float) -> np.ndarray:
    ts, max_delay = micros(ts), micros(max_delay)
    late = np.zeros(len(ts), dtype=bool)
    running = None
    for i, t in enumerate(ts.tolist()):
        late[i] = running is not None and t < running - max_delay
        running = t if running is None else max(running, t)
    return late


def reference_pairs(stream, ids, ts, keys, window: float | tuple, max_delay: float) -> tuple[np.ndarray, np.ndarray]:
    """(sorted encoded result pairs, ids of late tuples encoded as stream * 2**40 + id)."""
    stream, ids, ts, keys = map(np.asarray, (stream, ids, ts, keys))
    late = late_flags(ts, max_delay)
    ts, (lower, upper) = micros(ts), bounds(window)
    ok = ~late
    by_key: dict[int, list[list[int]]] = defaultdict(lambda: [[], []])
    for i in np.flatnonzero(ok).tolist():
        by_key[int(keys[i])][int(stream[i])].append(i)
    out = []
    for r_idx, s_idx in by_key.values():
        if r_idx and s_idx:
            r_idx, s_idx = np.array(r_idx), np.array(s_idx)
            dt = ts[s_idx][None, :] - ts[r_idx][:, None]
            close = (dt >= lower) & (dt <= upper)
            ri, si = np.nonzero(close)
            out.append(ids[r_idx][ri].astype(np.int64) * 2**32 + ids[s_idx][si].astype(np.int64))
    pairs = np.sort(np.concatenate(out)) if out else np.empty(0, dtype=np.int64)
    late_ids = np.sort(stream[late].astype(np.int64) * 2**40 + ids[late].astype(np.int64))
    return pairs, late_ids


def encode_pairs(r_id: np.ndarray, s_id: np.ndarray) -> np.ndarray:
    return np.sort(np.asarray(r_id, dtype=np.int64) * 2**32 + np.asarray(s_id, dtype=np.int64))


def reference_theta_pairs(
    stream, ids, ts, keys, window: float | tuple, max_delay: float, predicate: str, band: int = 0
) -> np.ndarray:
    """Sorted encoded pairs for `band` (|r.key - s.key| <= band) or `less` (r.key < s.key): every on-time R
    tuple is compared with all on-time S tuples by broadcasting, one R tuple at a time."""
    stream, ids, ts, keys = map(np.asarray, (stream, ids, ts, keys))
    ok = ~late_flags(ts, max_delay)
    ts, (lower, upper) = micros(ts), bounds(window)
    r = np.flatnonzero(ok & (stream == 0))
    s = np.flatnonzero(ok & (stream == 1))
    out = []
    for i in r.tolist():
        close = (ts[s] - ts[i] >= lower) & (ts[s] - ts[i] <= upper)
        match = np.abs(keys[s] - keys[i]) <= band if predicate == "band" else keys[s] > keys[i]
        out.append(ids[i] * 2**32 + ids[s[close & match]].astype(np.int64))
    return np.sort(np.concatenate(out)) if out else np.empty(0, dtype=np.int64)


def pairs_of(r: np.ndarray, s: np.ndarray):
    """slave.join.Pairs of rows r[i] joined with s[i] (tuple records), built field by field."""
    from protocol.tuples import FIELDS
    from slave.join import Pairs

    return Pairs(r.dtype, np.stack([side[f].view(np.int64) for side in (r, s) for f in FIELDS]))


def reference_outer(
    pairs: np.ndarray, r_ids: np.ndarray, s_ids: np.ndarray, join_type: str
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """What a join of `join_type` (protocol.predicates.JOIN_TYPES) emits, from the inner join's encoded `pairs`
    and the ids of the on-time R and S tuples: (encoded pairs, sorted ids of R rows emitted alone, sorted ids of
    S rows emitted alone).  Alone means in no pair (left, right, full, anti), or in one (semi, R only)."""
    r_ids, s_ids = np.asarray(r_ids, np.int64), np.asarray(s_ids, np.int64)
    r_in, s_in = np.unique(pairs // 2**32), np.unique(pairs % 2**32)
    none = np.empty(0, np.int64)
    lone_r = {
        "left": np.setdiff1d(r_ids, r_in),
        "full": np.setdiff1d(r_ids, r_in),
        "anti": np.setdiff1d(r_ids, r_in),
        "semi": np.intersect1d(r_ids, r_in),
    }.get(join_type, none)
    lone_s = np.setdiff1d(s_ids, s_in) if join_type in ("right", "full") else none
    kept = pairs if join_type in ("inner", "left", "right", "full") else none
    return kept, np.sort(lone_r), np.sort(lone_s)


def duckdb_outer(
    r_ids,
    r_ts,
    r_keys,
    s_ids,
    s_ts,
    s_keys,
    lower: int,
    upper: int,
    predicate: str,
    band: int = 0,
    join_type: str = "full",
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The same triple as `reference_outer`, from DuckDB's own outer join (`join_type` left, right or full) of the
    on-time tuples given (ts and the bounds in integer microseconds): r and s join iff lower <= s.ts - r.ts <=
    upper and the predicate holds for their keys (equal, |r.key - s.key| <= band, r.key < s.key).  Independent of
    the inner reference: SQL decides which rows are alone."""
    import duckdb
    import pyarrow as pa

    con = duckdb.connect()
    for name, ids, ts, keys in (("r", r_ids, r_ts, r_keys), ("s", s_ids, s_ts, s_keys)):
        con.register(
            name,
            pa.table(
                {"id": np.asarray(ids, np.int64), "ts": np.asarray(ts, np.int64), "key": np.asarray(keys, np.int64)}
            ),
        )
    on = {
        "equal": "s.key = r.key",
        "band": f"s.key BETWEEN r.key - {int(band)} AND r.key + {int(band)}",
        "less": "r.key < s.key",
    }[predicate]
    got = con.execute(
        f"SELECT coalesce(r.id, 0) AS r_id, coalesce(s.id, 0) AS s_id, r.id IS NULL AS r_null, "
        f"s.id IS NULL AS s_null FROM r {join_type.upper()} OUTER JOIN s ON {on} "
        f"AND s.ts - r.ts BETWEEN {int(lower)} AND {int(upper)}"
    ).fetchnumpy()
    r_id, s_id, r_null, s_null = (np.asarray(got[c]) for c in ("r_id", "s_id", "r_null", "s_null"))
    both = ~r_null & ~s_null
    return encode_pairs(r_id[both], s_id[both]), np.sort(r_id[s_null]), np.sort(s_id[r_null])


def duckdb_query(sql: str, tables: dict) -> list[tuple]:
    """The rows DuckDB gives for the Spark SQL query `sql` (transpiled by sqlglot, as protocol.query parses it) over
    `tables` ({name: a pyarrow Table of the stream's on-time rows, its time column a timestamp}), sorted, each row
    a tuple of Python values (None for NULL): what the engine's results must hold, row for row."""
    import duckdb
    import sqlglot

    con = duckdb.connect()
    con.execute("SET TimeZone = 'UTC'")
    for name, table in tables.items():
        con.register(name, table)
    rows = con.execute(sqlglot.transpile(sql, read="spark", write="duckdb")[0]).fetchall()
    return sorted(rows, key=_row_order)


def _row_order(row: tuple) -> tuple:
    return tuple((v is None, v if v is not None else 0) for v in row)
