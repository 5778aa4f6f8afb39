"""Markdown tables and number formats of the bench's reports (pure; no runs)."""

from __future__ import annotations

import json
import math

from bench.search import median


def krate(rate: float) -> str:
    """237710 -> '238k': rates in the compact search trail."""
    return f"{rate / 1000:,.0f}k" if rate >= 1000 else f"{rate:.0f}"


def trail_text(trail: list[tuple[float, bool]]) -> str:
    """[(238000, False), (119000, True)] -> '238k✗ 119k✓' (in the order the runs were made)."""
    return " ".join(f"{krate(r)}{'✓' if ok else '✗'}" for r, ok in trail) or "-"


def fmt(v, spec: str = ",.0f", missing: str = "-") -> str:
    return missing if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def md_table(header: list[str], rows: list[list[str]]) -> str:
    """A GitHub markdown table with columns padded, so it also reads well on a terminal."""
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
    line = lambda cells: "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths)) + " |"
    return "\n".join([line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, rows)])


def count(runs: list[dict], key: str) -> str:
    """'2/3': how many of the runs have `key` true; '-' for no runs."""
    return f"{sum(bool(r[key]) for r in runs)}/{len(runs)}" if runs else "-"


SUMMARY_HEADER = [
    "slaves",
    "unpaced tuples/s",
    "sustained rate/s",
    "search (✓ pass, ✗ fail)",
    "achieved/s",
    "delay p50 s",
    "p95 s",
    "p99 s",
    "max s",
    "kept up",
    "passed",
    "half rate/s",
    "half p50 s",
    "half p99 s",
    "half kept up",
    "peak RSS MB",
    "first tuple s",
    "process s",
    "confirmation run",
]
QUICK_RATE = "search rate/s (not a capacity)"  #: the sustained column's name in quick mode


def confirm_text(c: dict | None) -> str:
    """The confirmation run in a cell: its input seconds, the delay p99 of its first and last quarter, verdict."""
    if not c:
        return "-"
    f = c["flatness"]
    why = "" if c["confirmed"] else f": {c['verdict']}" if not c["passed"] else ": delay climbed"
    return (
        f"{c['input_seconds']:.0f} s, p99 {fmt(f['first_p99'], '.3f')} → {fmt(f['last_p99'], '.3f')} s "
        f"{'✓ confirmed' if c['confirmed'] else '✗ not confirmed' + why}"
    )


def summary_table(points: list[dict], quick: bool = False) -> str:
    """One row per slave count: unpaced throughput, sustained rate (quick: the search's rate, not a capacity) and
    its search trail, the medians of the runs at the sustained rate (achieved throughput, delays) with kept-up
    and passed counts, the delay medians at half the sustained rate, the peak RSS of any run, the medians at the
    sustained rate of the time to the first tuple and of the whole process, and the confirmation run."""
    rows = []
    for p in points:
        st, h = p["sustained"], p["half"]
        every = [p["probe"], *p["search"]["runs"], *st["runs"], *h["runs"]]
        rows.append(
            [
                str(p["slaves"]),
                fmt(p["unpaced"]),
                fmt(st["rate"]),
                trail_text(p["search"]["trail"]),
                fmt(st["throughput"]),
                *(fmt(st[f"delay_{q}"], ".3f") for q in ("p50", "p95", "p99", "max")),
                count(st["runs"], "kept_up"),
                count(st["runs"], "passed"),
                fmt(h["rate"] or None),
                fmt(h["delay_p50"], ".3f"),
                fmt(h["delay_p99"], ".3f"),
                count(h["runs"], "kept_up"),
                fmt(max((r["peak_rss_mb"] or 0 for r in every), default=None), ".0f"),
                fmt(median(r.get("first_tuple_seconds") for r in st["runs"]), ".2f"),
                fmt(median(r.get("process_seconds") for r in st["runs"]), ".1f"),
                confirm_text(p.get("confirm")),
            ]
        )
    header = [QUICK_RATE if quick and h == "sustained rate/s" else h for h in SUMMARY_HEADER]
    return md_table(header, rows)


def to_toml(cfg: dict) -> str:
    val = lambda v: json.dumps(v) if isinstance(v, str) else str(v).lower() if isinstance(v, bool) else repr(v)
    return "\n\n".join(f"[{s}]\n" + "\n".join(f"{k} = {val(v)}" for k, v in keys.items()) for s, keys in cfg.items())


def detail_table(p: dict) -> str:
    """Every run of one slave count in the order made: probe, search #i, sustained #i, half #i."""
    rows = []
    for r in [
        p["probe"],
        *p["search"]["runs"],
        *p["sustained"]["runs"],
        *p["half"]["runs"],
        *([p["confirm"]] if p.get("confirm") else []),
    ]:
        paced = "rate" in r
        rows.append(
            [
                r["label"],
                fmt(r["rate"]) if paced else "unpaced",
                fmt(r["throughput"]),
                fmt(r["wall_seconds"], ".1f"),
                *(fmt(r[f"delay_{q}"], ".3f") for q in ("p50", "p95", "p99", "max")),
                f"{r['ratio']:.0%}, lag {r['lag_seconds']:.1f}s{'' if r['kept_up'] else ' FELL BEHIND'}"
                if paced
                else "-",
                fmt(r.get("input_seconds"), ".1f"),
                (r["verdict"] if r["passed"] else f"FAIL: {r['verdict']}") if paced else "-",
                fmt(r["window_bytes_per_tuple"], ".0f"),
                fmt(r["peak_rss_mb"], ".0f"),
                fmt(r.get("first_tuple_seconds"), ".2f"),
                fmt(r.get("process_seconds"), ".1f"),
                fmt(r.get("pss_mb"), ".0f"),
            ]
        )
    return md_table(
        [
            "run",
            "pacing/s",
            "throughput/s",
            "wall s",
            "delay p50 s",
            "p95 s",
            "p99 s",
            "max s",
            "kept up (achieved/pacing)",
            "input s at the rate",
            "passes",
            "window B/tuple",
            "peak RSS MB",
            "first tuple s",
            "process s",
            "PSS MB (all ranks)",
        ],
        rows,
    )


def search_line(p: dict) -> str:
    """Where the search left the sustained rate of one slave count, in words."""
    lo, hi = p["search"]["bracket"]
    trail = " → ".join(f"{r:,.0f} {'pass' if ok else 'fail'}" for r, ok in p["search"]["trail"])
    where = (
        "no rate passed"
        if not lo
        else f"between {lo:,.0f} and {hi:,.0f}/s (+{hi / lo - 1:.0%})"
        if hi
        else f"at least {lo:,.0f}/s (no rate above it failed)"
    )
    return f"- {p['slaves']} slave(s): unpaced {p['unpaced']:,.0f}/s; {trail}; sustained rate {where}."
