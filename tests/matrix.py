"""The randomized differential matrix: one draw is a configuration from the product of the join's features and
a random workload for it; the real cluster runs it under mpirun and its result set (and late set) is compared
with the independent reference join over the whole input (tests/reference.py).

`python -m tests.matrix --seed N` reruns one draw; `python -m tests.matrix --minutes M` (`make soak`) runs random
draws for M minutes and prints a table of draws, the feature pairs covered and the failures.  tests/test_matrix.py
runs a fixed set of seeds that covers every pair of feature values at small scale.

Event time in the workload is an integer count of milliseconds or microseconds, written as exact decimal seconds;
the reference compares those integers, so a pair exactly at a bound (one window apart, or exactly join.lower or
join.upper) joins.  `bounds` draws the time condition: the symmetric join.window, or join.lower / join.upper
asymmetric, one-sided (lower = 0) or both negative (issue 20).
"""
from __future__ import annotations

import argparse
import itertools
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import psutil
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from protocol.config import ConfigError, load_config, validate
from protocol.output import read_tables
from protocol.predicates import JOIN_TYPES
from tests.cluster import run_cluster, toml_value
from tests.reference import late_flags, reference_outer, reference_pairs, reference_theta_pairs

#: feature -> the values a draw takes
FEATURES: dict[str, tuple] = {
    "predicate": ("equal", "band", "less"),
    "dispatchers": (1, 2, 3),
    "slaves": (1, 2, 3, 4),
    "moves": (False, True),
    "hotkeys": (False, True),
    "crash": (False, True),
    "disorder": (False, True),
    "unit": ("ms", "us"),
    "wide_window": (False, True),
    "bounds": ("window", "asymmetric", "one_sided", "negative"),
    "format": ("csv", "parquet"),
    "join_type": JOIN_TYPES,
    "input": ("file", "streams"),
}
#: the features whose value pairs CI's covering seeds cover; join.type is drawn in every draw (so CI runs some
#: outer joins) and covered pairwise by `make soak` and `--where join_type=...`: its pairs would double CI's draws
PAIRED = tuple(f for f in FEATURES if f != "join_type")
UNITS = {"ms": 1_000, "us": 1_000_000}
EPOCH = 0.1  #: epochs.distribution of every draw (seconds); a wide window is larger than it, a narrow one smaller
SUPERVISE = [sys.executable, "-m", "control.supervise", "--backoff", "0.1", "--restarts", "4", "--"]


@dataclass(frozen=True)
class Draw:
    seed: int
    predicate: str
    dispatchers: int
    slaves: int
    moves: bool
    hotkeys: bool
    crash: bool
    disorder: bool
    unit: str
    wide_window: bool
    bounds: str
    format: str
    join_type: str
    input: str

    @property
    def ranks(self) -> int:
        return self.dispatchers + self.slaves

    def features(self) -> dict:
        d = asdict(self)
        del d["seed"]
        return d


def draw(seed: int) -> Draw:
    """The draw of `seed`: every feature uniformly at random (refused combinations are run too: `refusal`)."""
    rng = np.random.default_rng([seed, 19])
    return Draw(seed=seed, **{f: values[int(rng.integers(len(values)))] for f, values in FEATURES.items()})


def window_units(d: Draw) -> int:
    return UNITS[d.unit] * (3 if d.wide_window else 1) // 20  # 0.15 s or 0.05 s, in the draw's unit


#: `bounds` -> (lower, upper) in fifths of the window: s.ts - r.ts in [lower, upper]
BOUNDS = {"window": (-5, 5), "asymmetric": (-1, 5), "one_sided": (0, 5), "negative": (-5, -1)}


def bounds_units(d: Draw) -> tuple[int, int]:
    """(lower, upper) in the draw's unit (the window's fifths are whole: it is 50 or 150 ms)."""
    return tuple(window_units(d) * f // 5 for f in BOUNDS[d.bounds])


def max_delay_units(d: Draw) -> int:
    return UNITS[d.unit] // 10  # 0.1 s


def workload(d: Draw) -> dict[str, np.ndarray]:
    """Two interleaved streams in arrival order: stream (0 R, 1 S), id, ts (integer, the draw's unit), key.

    About 3 s of event time; keys from a small domain (equal), or near each other (band, less: few keys per
    window so `less` stays small); with hot keys two keys take turns at 30% of the input and then cool; some S
    tuples are exactly lower or upper after an R tuple of the same key (the boundary), or one unit outside;
    with disorder tuples arrive up to 0.25 s late in event time, past max_delay for some (the late set)."""
    rng = np.random.default_rng([d.seed, 7])
    unit = UNITS[d.unit]
    n = {"equal": 9000, "band": 6000, "less": 2400}[d.predicate]
    ts = np.sort(rng.integers(0, 3 * unit, n))
    keys = rng.integers(0, 400 if d.predicate == "equal" else 3000, n)
    if d.hotkeys:
        phase = ts * 3 // (3 * unit)  # first second: key 7 hot; second: key 11; last: none
        for p, key in ((0, 7), (1, 11)):
            keys[(phase == p) & (rng.random(n) < 0.3)] = key
    stream = rng.integers(0, 2, n)
    # the boundary: for one R tuple in twenty an S tuple of the same key exactly at lower or upper after it, or
    # one unit outside
    r = np.flatnonzero(stream == 0)
    twins = r[rng.random(len(r)) < 0.05]
    lower, upper = bounds_units(d)
    twin_ts = ts[twins] + rng.choice([lower, upper, lower, upper, lower - 1, upper + 1], len(twins))
    ok = twin_ts >= 0
    ts = np.concatenate([ts, twin_ts[ok]])
    keys = np.concatenate([keys, keys[twins][ok]])
    stream = np.concatenate([stream, np.ones(ok.sum(), np.int64)])
    arrival = ts.astype(np.float64)
    if d.disorder:
        shifted = rng.random(len(ts)) < 0.1
        arrival[shifted] += rng.random(shifted.sum()) * 0.25 * unit
    order = np.argsort(arrival, kind="stable")
    stream, ts, keys = stream[order], ts[order], keys[order]
    ids = np.zeros(len(ts), np.int64)
    for s in (0, 1):  # per stream, numbered in arrival order
        mine = stream == s
        ids[mine] = np.arange(mine.sum())
    return {"stream": stream, "id": ids, "ts": ts, "key": keys}


def seconds_text(ts: np.ndarray, unit: str) -> np.ndarray:
    """Integer times as exact decimal seconds ("12.345" for 12345 ms)."""
    digits = {"ms": 3, "us": 6}[unit]
    whole, frac = np.divmod(ts, UNITS[unit])
    return np.char.add(np.char.add(whole.astype(str), "."), np.char.zfill(frac.astype(str), digits))


#: declared streams (input = "streams"): their names, so results and late rows name their columns trades_*, quotes_*
STREAMS = ("trades", "quotes")


def write_input(d: Draw, data: dict[str, np.ndarray], directory: Path) -> Path:
    """The draw's input: one file of both streams, or (input = "streams") a file per stream with the user's
    own column names, text keys for an equi-join, times as decimal text (CSV) or integers in the draw's unit,
    and a text payload column; returns the file, or the folder holding the two."""
    if d.input == "streams":
        for side, name in enumerate(STREAMS):
            mine = data["stream"] == side
            ids = data["id"][mine]
            key = np.char.add("k", data["key"][mine].astype(str)) if d.predicate == "equal" else data["key"][mine]
            when = seconds_text(data["ts"][mine], d.unit) if d.format == "csv" else data["ts"][mine]
            table = pa.table({"event_id": ids, "sym": key, "at": when, "note": np.char.add("n", ids.astype(str))})
            if d.format == "csv":
                pacsv.write_csv(table, directory / f"{name}.csv")
            else:
                pq.write_table(table, directory / f"{name}.parquet", row_group_size=1000)
        return directory
    text = seconds_text(data["ts"], d.unit)
    table = pa.table({"stream": np.where(data["stream"] == 0, "R", "S"), "id": data["id"],
                      "ts": text if d.format == "csv" else text.astype(np.float64),
                      "key": data["key"], "value": data["key"].astype(np.float64)})
    path = directory / f"input.{d.format}"
    if d.format == "csv":  # the times as the text the user wrote, not a float's shortest repr
        pacsv.write_csv(table, path)
    else:
        pq.write_table(table, path, row_group_size=2000)
    return path


def settings(d: Draw, path: Path, n: int = 9000) -> dict:
    """The draw's configuration ('section.key': value) for `n` tuples in `path`, paced over 3 s."""
    unit = UNITS[d.unit]
    if d.input == "streams":
        source = {f"streams.{name}.{k}": v for name in STREAMS for k, v in
                  (("path", str(path / f"{name}.{d.format}")), ("key", "sym"), ("time", "at"), ("id", "event_id"),
                   ("time_unit", "s" if d.format == "csv" else d.unit))}
    else:
        source = {"source.kind": "file", "source.path": str(path)}
    lower, upper = bounds_units(d)
    time_bounds = {"join.window": upper / unit} if d.bounds == "window" else \
        {"join.lower": lower / unit, "join.upper": upper / unit}
    s = {**source, "source.rate": n / 3.0, **time_bounds,
         "join.max_delay": max_delay_units(d) / unit,
         "join.predicate": d.predicate, "join.type": d.join_type, "cluster.dispatchers": d.dispatchers,
         "epochs.distribution": EPOCH, "epochs.reorganization": 0.3, "partitioning.partitions": 16,
         "tuning.block_size": 8, "tuning.theta_min": 2, "tuning.theta_max": 8,
         "output.result_chunk_rows": 64}  # small bounds, so that every draw splits and chunks
    if d.predicate == "band":
        s["join.band"] = 2
    if d.moves:  # every slave a supplier or a consumer at every reorganization: groups keep moving
        s.update({"balance.buffer_capacity": 50, "balance.supplier_threshold": 1e-9,
                  "balance.consumer_threshold": 1e-9, "balance.choice": "random", "balance.declustering": True,
                  "balance.seed": d.seed})
    else:
        s["balance.enabled"] = False
    if d.hotkeys:
        s.update({"hotkeys.enabled": True, "hotkeys.threshold": 0.15})
    if d.crash:
        s["checkpoint.interval"] = 3
    return s


def refusal(d: Draw) -> str | None:
    """The configuration's refusal (protocol.config), or None when the engine takes the draw."""
    try:
        validate(load_config(None, [f"{k}={toml_value(v)}" for k, v in settings(d, Path("input")).items()]),
                 slaves=d.ranks - 1)
    except ConfigError as e:
        return str(e)
    return None


def reference(d: Draw, data: dict[str, np.ndarray]) -> tuple[tuple[np.ndarray, np.ndarray, np.ndarray], np.ndarray]:
    """((encoded pairs, ids of R rows alone, ids of S rows alone) as the draw's join type emits them
    (tests.reference.reference_outer), encoded late ids) of the whole input, in integer microseconds
    (tests/reference.py).  With k dispatchers dispatcher i takes every k-th tuple from the i-th on
    (master.source.ShardedSource) and judges lateness on its own share."""
    unit, k = UNITS[d.unit], d.dispatchers
    ts = data["ts"] * (1_000_000 // unit)  # microseconds, exactly
    w, md = tuple(b / unit for b in bounds_units(d)), max_delay_units(d) / unit  # seconds, as the config gives them
    late = np.zeros(len(ts), bool)
    if d.input == "streams":  # the streams merged by their running max ts (R first), lateness within each stream
        running = np.zeros(len(ts), np.int64)
        for side in (0, 1):
            mine = np.flatnonzero(data["stream"] == side)
            running[mine] = np.maximum.accumulate(ts[mine])
        merged = np.lexsort((np.arange(len(ts)), data["stream"], running))
        for i in range(k):
            share = merged[i::k]
            for side in (0, 1):
                mine = share[data["stream"][share] == side]
                late[mine] = late_flags(ts[mine], md)
    else:
        for i in range(k):
            late[i::k] = late_flags(ts[i::k], md)
    on = {c: v[~late] for c, v in {**data, "ts": ts}.items()}
    never = 1e9  # seconds: lateness is decided above
    if d.predicate == "equal":
        pairs, _ = reference_pairs(on["stream"], on["id"], on["ts"], on["key"], w, never)
    else:
        pairs = reference_theta_pairs(on["stream"], on["id"], on["ts"], on["key"], w, never, d.predicate, 2)
    kept = reference_outer(pairs, on["id"][on["stream"] == 0], on["id"][on["stream"] == 1], d.join_type)
    return kept, np.sort(data["stream"][late] * 2**40 + data["id"][late])


@dataclass
class Outcome:
    draw: Draw
    refused: str | None = None
    expected: int = 0
    missing: int = 0
    extra: int = 0
    twice: int = 0
    late_wrong: int = 0
    error: str = ""
    killed: str = ""
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not (self.missing or self.extra or self.twice or self.late_wrong or self.error)

    def line(self) -> str:
        f = self.draw.features()
        head = f"seed {self.draw.seed:5d} " + " ".join(f"{k}={v}" for k, v in f.items())
        if self.refused:
            return f"{head} | refused: {self.refused}"
        verdict = "ok" if self.ok else (f"FAIL missing {self.missing} extra {self.extra} twice {self.twice} "
                                        f"late-wrong {self.late_wrong} {self.error}")
        return f"{head} | {self.expected} rows, killed {self.killed or '-'}, {self.seconds:.1f}s: {verdict}"


def kill_a_rank(tag: str, ranks: int, rng: np.random.Generator, victims: list[str]) -> threading.Thread:
    """SIGKILL one random rank (the master too) of the run whose command line holds `tag`, 0.5-2 s after that
    rank started, like a failed host."""
    victim, delay = str(int(rng.integers(ranks))), float(rng.uniform(0.5, 2.0))

    def find() -> psutil.Process | None:
        for p in psutil.process_iter(["cmdline", "environ"]):
            try:
                if tag in " ".join(p.info["cmdline"] or []) and \
                        (p.info["environ"] or {}).get("OMPI_COMM_WORLD_RANK") == victim:
                    return p
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        return None

    def kill():
        give_up = time.time() + 120
        while (target := find()) is None and time.time() < give_up:
            time.sleep(0.05)
        if target is not None:
            time.sleep(delay)
            try:
                target.kill()
                victims.append(f"rank {victim} at {delay:.1f}s")
            except psutil.NoSuchProcess:  # the run ended first
                pass

    t = threading.Thread(target=kill, daemon=True)
    t.start()
    return t


def run_draw(d: Draw, tmp: Path, timeout: float = 240) -> Outcome:
    """Run draw `d` in folder `tmp` and compare with the reference."""
    out = Outcome(d, refused=refusal(d))
    if out.refused:
        return out
    started = time.time()
    tmp.mkdir(parents=True, exist_ok=True)
    data = workload(d)
    path = write_input(d, data, tmp)
    expected, expected_late = reference(d, data)
    out.expected = sum(map(len, expected))
    env = {"STREAMJOIN_STRAGGLER": f"{d.dispatchers}:0.05"} if d.moves else None  # the first slave lags
    victims: list[str] = []
    killer = kill_a_rank(str(tmp), d.ranks, np.random.default_rng([d.seed, 3]), victims) if d.crash else None
    try:
        run = run_cluster(tmp, d.ranks, settings(d, path, len(data["ts"])), timeout=timeout, env=env,
                          wrapper=SUPERVISE if d.crash else ())
    except Exception as e:  # a hang (timeout) is a failure of the draw, with its seed
        out.error, out.seconds = f"{type(e).__name__}: {e}", time.time() - started
        return out
    (tmp / "stderr.log").write_text(run.stderr)  # the evidence of a failed draw, kept with its folder
    if killer is not None:
        killer.join()
        out.killed = ", ".join(victims)
    out.seconds = time.time() - started
    if run.returncode != 0:
        out.error = f"exit {run.returncode}: {run.stderr[-2000:]}"
        return out
    ids = tuple(f"{name}_event_id" for name in STREAMS) if d.input == "streams" else ("r_id", "s_id")
    for got, want in zip((run.pairs(ids), run.alone("r", ids), run.alone("s", ids)), expected):  # pairs, rows alone
        out.twice += len(got) - len(np.unique(got))
        out.missing += len(np.setdiff1d(want, got))
        out.extra += len(np.setdiff1d(got, want))
    if d.input == "streams":
        out.error += payload_mismatch(run.out)
    late = run.late_ids(ids, STREAMS) if d.input == "streams" else run.late_ids()
    out.late_wrong = len(np.setxor1d(late, expected_late))
    return out


def payload_mismatch(out: Path) -> str:
    """With declared streams, every result row's payload is its own row's ("n<id>" beside id <id>); else a
    message."""
    t = read_tables(out / "results")
    if t is None:
        return ""
    for name in STREAMS:
        present = pc.is_valid(t[f"{name}_event_id"])
        want = pc.binary_join_element_wise("n", pc.cast(t[f"{name}_event_id"], pa.string()), "")
        wrong = pc.sum(pc.and_(present, pc.invert(pc.fill_null(pc.equal(t[f"{name}_note"], want), False)))).as_py()
        if wrong:
            return f"payload of {wrong} {name} rows is not their own"
    return ""


def covering_seeds(count_limit: int = 40, search: int = 2000) -> list[int]:
    """A small set of seeds whose accepted draws cover every pair of feature values the engine accepts
    (greedy: the seed that covers most uncovered pairs next)."""
    def pairs_of(d: Draw) -> set:
        f = d.features()
        return {((a, f[a]), (b, f[b])) for a, b in itertools.combinations(PAIRED, 2)}

    accepted = {s: pairs_of(draw(s)) for s in range(search) if refusal(draw(s)) is None}
    wanted = set().union(*accepted.values())
    chosen: list[int] = []
    while wanted and len(chosen) < count_limit:
        best = max(accepted, key=lambda s: len(accepted[s] & wanted))
        chosen.append(best)
        wanted -= accepted.pop(best)
    return chosen


def coverage(outcomes: list[Outcome]) -> tuple[int, int]:
    """(feature-value pairs the accepted draws covered, pairs in the product)."""
    seen = set()
    for o in outcomes:
        if not o.refused:
            f = o.draw.features()
            seen |= {((a, f[a]), (b, f[b])) for a, b in itertools.combinations(FEATURES, 2)}
    total = sum(len(FEATURES[a]) * len(FEATURES[b]) for a, b in itertools.combinations(FEATURES, 2))
    return len(seen), total


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.matrix", description=__doc__.split("\n")[0])
    p.add_argument("--seed", type=int, action="append", help="run this draw (repeatable)")
    p.add_argument("--minutes", type=float, default=0.0, help="run random draws for this long (make soak)")
    p.add_argument("--covering", action="store_true", help="run the covering seeds CI runs")
    p.add_argument("--keep", action="store_true", help="keep each draw's folder (input, config, output)")
    p.add_argument("--where", action="append", default=[], metavar="FEATURE=VALUE",
                   help="random draws only with this feature value, e.g. --where hotkeys=True or --where join.type=left "
                        "(repeatable)")
    p.add_argument("--draws", type=int, default=0, help="stop after this many draws were run (0: by time)")
    a = p.parse_args(argv)
    wanted = {k.replace(".", "_"): v for k, v in (w.split("=", 1) for w in a.where)}  # join.type = join_type
    unknown = set(wanted) - set(FEATURES)
    if unknown:
        p.error(f"unknown feature(s) {sorted(unknown)}; known: {', '.join(FEATURES)}")
    seeds = iter(a.seed or (covering_seeds() if a.covering else []))
    rng = np.random.default_rng()
    deadline = time.time() + a.minutes * 60
    outcomes: list[Outcome] = []
    root = Path(tempfile.mkdtemp(prefix="matrix-"))
    while True:
        seed = next(seeds, None)
        if seed is None:
            ran = sum(not o.refused for o in outcomes)
            if a.seed or a.covering or (ran >= a.draws if a.draws else time.time() >= deadline):
                break
            seed = int(rng.integers(1_000_000))
            f = draw(seed).features()
            if any(str(f[k]) != v for k, v in wanted.items()) or refusal(draw(seed)):
                continue
        o = run_draw(draw(seed), root / f"seed-{seed}")
        outcomes.append(o)
        print(o.line(), flush=True)
        if not o.ok:
            print(f"  reproduce: python -m tests.matrix --seed {seed} --keep   (folder {root / f'seed-{seed}'})",
                  flush=True)
    ran = [o for o in outcomes if not o.refused]
    failed = [o for o in ran if not o.ok]
    covered, total = coverage(outcomes)
    print(f"\n{len(outcomes)} draws: {len(ran)} run, {len(outcomes) - len(ran)} refused by the config, "
          f"{len(failed)} failed; feature-value pairs covered {covered} of {total}")
    for feature, values in FEATURES.items():  # draws run per feature value, and failures among them
        cells = [f"{v}: {sum(o.draw.features()[feature] == v for o in ran)}"
                 f"{'/' + str(sum(o.draw.features()[feature] == v for o in failed)) + ' failed' if failed else ''}"
                 for v in values]
        print(f"  {feature:12s} " + "   ".join(cells))
    for o in failed:
        print(f"  failed: seed {o.draw.seed}  (python -m tests.matrix --seed {o.draw.seed})")
    if not a.keep and not failed:
        import shutil
        shutil.rmtree(root, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
