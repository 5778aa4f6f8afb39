"""`control.audit --view DIR`: the merger's view of a range diffed with the view recomputed by the audit.

control.audit recomputes the rows of the range from the input (pairs, rows alone) and aggregates them with
control.aggregate's own `--batch` functions; this module compares that with the view's snapshot, window by
window, on the driver (a view is one row per group and window, not per result): groups missing, groups
extra, measures different.  Only final windows count (declared streams: the `final` flag; a window is final
once every slave's watermark is past its end, so final windows are those up to the largest final end), and
only windows wholly inside [from, to).  Decimals, integers and texts must be equal; floats (sums of floats
are added in another order) within RELATIVE of each other.  Pure: pyarrow only.
"""

from __future__ import annotations

import math

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from protocol.aggregation import FINAL, WINDOW_END, WINDOW_START
from protocol.eventtime import NEG_INF, PER_SECOND, POS_INF

#: float measures agree when within this of each other, relative to the larger (or absolute, near zero)
RELATIVE = 1e-9
#: the diff file's columns (all text but the first)
DIFF_COLUMNS = ("problem", "group", "measure", "view", "recomputed")


def window_starts(t: pa.Table) -> np.ndarray | None:
    """Each row's window start in microseconds (declared streams: a timestamp; single file: float seconds;
    NEG_INF for a row whose time was null); None without windows."""
    if WINDOW_START not in t.column_names:
        return None
    c = t[WINDOW_START]
    if pa.types.is_timestamp(c.type):
        us = c.cast(pa.timestamp("us", "UTC")).cast(pa.int64())
    else:
        us = pc.round(pc.multiply(c, float(PER_SECOND))).cast(pa.int64())
    return pc.fill_null(us, NEG_INF).to_numpy()


def comparable(t: pa.Table, width: int, start: int, end: int, bound: int) -> pa.Table:
    """The rows of windows wholly inside [start, end) whose end is at most `bound` (a window of a null time
    only when the range is the whole run); without windows (width 0) all rows if `bound` is POS_INF."""
    starts = window_starts(t)
    if starts is None or not width:
        return t if bound >= POS_INF else t.slice(0, 0)
    whole = start <= NEG_INF and end >= POS_INF and bound >= POS_INF
    keep = (starts >= start) & (starts + width <= min(end, bound))
    return t.filter(pa.array(keep | ((starts == NEG_INF) & whole)))


def final_bound(view: pa.Table) -> int:
    """The end (microseconds) up to which every window of the view is final: POS_INF if every row is (or the
    view carries no `final` flag: the single file's partials have no stamps), else the largest end of a final
    window (NEG_INF: none)."""
    if FINAL not in view.column_names or pc.all(view[FINAL]).as_py() in (True, None):
        return POS_INF
    ends = view.filter(view[FINAL])[WINDOW_END] if WINDOW_END in view.column_names else None
    if ends is None or not len(ends) or ends.null_count == len(ends):
        return NEG_INF
    return pc.max(ends.cast(pa.timestamp("us", "UTC")).cast(pa.int64())).as_py()


def _cell(v) -> object:
    """A group's value as a dict key (NaN equals NaN here, as a group of its own)."""
    return "NaN" if isinstance(v, float) and math.isnan(v) else v


def _by_group(t: pa.Table, keys: list[str]) -> dict:
    d = t.to_pydict()
    return {
        tuple(_cell(d[k][i]) for k in keys): {c: d[c][i] for c in d if c not in keys and c not in (FINAL, WINDOW_END)}
        for i in range(t.num_rows)
    }


def same(a, b) -> bool:
    """Two measures agree: equal, both null, both NaN, or floats within RELATIVE."""
    if a is None or b is None:
        return a is None and b is None
    if isinstance(a, float) or isinstance(b, float):
        a, b = float(a), float(b)
        return (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=RELATIVE, abs_tol=RELATIVE)
    return a == b


def diff(view: pa.Table, want: pa.Table, keys: list[str], width: int, start: int, end: int) -> tuple[dict, pa.Table]:
    """(counts, evidence) of the view against the recomputed view `want` over the final windows in [start,
    end): `groups` compared, `missing` and `extra` groups, `different` measures, `not_final` view rows left
    out; one evidence row per problem (DIFF_COLUMNS)."""
    bound = final_bound(view)
    compared = comparable(view.filter(view[FINAL]) if FINAL in view.column_names else view, width, start, end, bound)
    got, exp = _by_group(compared, keys), _by_group(comparable(want, width, start, end, bound), keys)
    rows = []
    name = lambda k: ", ".join(f"{c}={v}" for c, v in zip(keys, k))  # noqa: E731
    for k in exp.keys() - got.keys():
        rows.append(("missing", name(k), "", "", f"count {exp[k]['count']}"))
    for k in got.keys() - exp.keys():
        rows.append(("extra", name(k), "", f"count {got[k]['count']}", ""))
    for k in exp.keys() & got.keys():
        rows += [
            ("different", name(k), c, str(got[k].get(c)), str(v))
            for c, v in exp[k].items()
            if not same(got[k].get(c), v)
        ]
    rows.sort()
    counts = {p: sum(r[0] == p for r in rows) for p in ("missing", "extra", "different")}
    not_final = pc.sum(pc.invert(view[FINAL])).as_py() or 0 if FINAL in view.column_names else 0
    counts |= {"groups": len(exp), "found": len(got), "not_final": not_final}
    counts["final_until"] = None if bound >= POS_INF else (None if bound <= NEG_INF else bound / PER_SECOND)
    evidence = pa.table({c: pa.array([r[i] for r in rows], pa.string()) for i, c in enumerate(DIFF_COLUMNS)})
    return counts, evidence


def describe(problem: dict) -> str:
    """One evidence row (DIFF_COLUMNS) in words."""
    group, view, recomputed = problem["group"], problem["view"], problem["recomputed"]
    if problem["problem"] == "different":
        return f"{group}: {problem['measure']} {view} in the view, {recomputed} recomputed"
    return f"{group}: {problem['problem']} ({view or recomputed})"


def verdict(report: dict) -> str:
    """One line: EXACT or DIFFERENT with the counts and the first problems named."""
    what = f"view {report['view']}, range {report['range']}"
    if report["verdict"] == "exact":
        return f"EXACT: {what}: {report['groups']:,} groups of final windows equal the recomputed view"
    wrong = [
        f"{report[k]:,} {label}"
        for k, label in (("missing", "groups missing"), ("extra", "groups extra"), ("different", "measures different"))
        if report[k]
    ]
    first = "; ".join(report["first"])
    return f"DIFFERENT: {what}: {', '.join(wrong)} ({first}); the evidence is in {report['diff']}"
