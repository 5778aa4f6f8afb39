"""`python -m bench.failover [--repeats 1] [--out bench-report]`: how fast a lost host or rank is found and
healed, on three hosts made as network namespaces (deploy.testbed; needs root).

A paced run (1 master + 4 slaves on hosts of 2, 2 and 1 slots, checkpoints every 4 distribution epochs)
under `control.supervise`; after the second complete checkpoint one fault:

- `cut`: the link of the host of slave 4 goes down and stays down (the restart leaves that host out);
- `kill`: slave 4 is SIGKILLed (the restart uses all three hosts).

Measured from the fault, by the time each line reaches the supervisor's stderr: the loss reported (the
engine's line naming the rank, or the launcher's), the restart (the supervisor's `restarting on` line: after
the abort, the backoff and probing the hosts), the first new result (the restarted run's first progress
line whose result count has grown, at a resolution of `output.progress`), and the replay (the restarted run
taking in again what the crashed one had taken at the fault).  The results are compared with DuckDB's
interval join of the same generated input: every pair exactly once.  Targets: the loss reported within
`cluster.heartbeat_timeout` + 2 s; the first new result within 10 s of the report.

Then the nemesis soak's figures (tests/nemesis.py, `--nemesis-minutes`, default 3; 0: none): one unbounded
Kafka job on four namespace hosts meeting a fault after another, as `make soak` runs it for an hour.  Reported:
faults met per hour, the seconds from each fault to the first new result after it (median and max per kind of
fault), results lost (pairs and views alone missing from the result files and the sink topic: must be 0) and
each rank's peak resident memory over the run.  `--nemesis-record FILE` reads the record of a soak run before
(`python -m tests.nemesis --record FILE`, e.g. an hour's) instead of running one.  Output: failover.md,
failover.json.
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import psutil

from bench.machine import machine_info
from bench.search import median
from bench.tables import fmt, md_table
from deploy.launch import mpi_env
from deploy.testbed import TestBed, TestBedError
from protocol.plan import load_plan
from protocol.output import read_tables
from common.workload import generate_all

HEARTBEAT = 3.0  #: cluster.heartbeat_timeout of the runs (seconds)
REPORT_TARGET = HEARTBEAT + 2.0  #: seconds from the fault to the loss reported
RESULT_TARGET = 10.0  #: seconds from the report to the first new result
SETTINGS = {
    "generator.duration": 16.0,
    "generator.rate": 2500.0,
    "generator.keys": 4096,
    "source.rate": 5000.0,
    "join.window": 0.5,
    "join.max_delay": 0.3,
    "epochs.distribution": 0.2,
    "checkpoint.interval": 4,
    "cluster.heartbeat_timeout": HEARTBEAT,
    "cluster.network": "10.77.0.0/24",
    "output.progress": 0.1,
    "metrics.endpoint": "",
}
_PROGRESS = re.compile(r"^\[\s*[\d.]+s\] in ([\d,]+) .*\| results ([\d,]+) ")


def write_config(path: Path, out: Path) -> Path:
    keys: dict[str, dict] = {"output": {"path": str(out)}}
    for name, value in SETTINGS.items():
        section, key = name.split(".")
        keys.setdefault(section, {})[key] = value
    path.write_text(
        "".join(f"[{s}]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in kv.items()) for s, kv in keys.items())
    )
    return path


def reference_pairs() -> np.ndarray:
    """Every pair of the generated input by DuckDB's interval join, as r_id * 2**32 + s_id, sorted."""
    import duckdb

    gen = load_plan(None, [f"{k}={v}" for k, v in SETTINGS.items() if k.startswith("generator.")]).generator
    data = generate_all(gen)
    r, s = data.stream == 0, data.stream == 1
    con = duckdb.connect()
    con.register("r", {"id": data.id[r], "ts": data.ts[r], "key": data.key[r]})
    con.register("s", {"id": data.id[s], "ts": data.ts[s], "key": data.key[s]})
    w = int(SETTINGS["join.window"] * 1_000_000)
    got = con.execute(
        f"SELECT r.id * 4294967296 + s.id FROM r JOIN s ON r.key = s.key AND s.ts BETWEEN r.ts - {w} AND r.ts + {w}"
    ).fetchnumpy()
    return np.sort(next(iter(got.values())).astype(np.int64))


def exact(out: Path, expected: np.ndarray) -> bool:
    t = read_tables(out / "results", ["r_id", "s_id"])
    got = np.sort(t["r_id"].to_numpy().astype(np.int64) * 2**32 + t["s_id"].to_numpy().astype(np.int64))
    return np.array_equal(got, expected)


def progress(line: str) -> tuple[int, int] | None:
    """(tuples in, results) of a progress line."""
    m = _PROGRESS.match(line)
    return None if m is None else (int(m.group(1).replace(",", "")), int(m.group(2).replace(",", "")))


def run_once(fault: str, work: Path, expected: np.ndarray) -> dict:
    out = work / "out"
    cfg = write_config(work / "run.toml", out)
    with TestBed(3) as bed:
        cmd = [
            sys.executable,
            "-m",
            "control.supervise",
            "--backoff",
            "0.1",
            "--restarts",
            "3",
            "--",
            sys.executable,
            "-m",
            "deploy.launch",
            "-n",
            "5",
            "--hostfile",
            str(bed.hostfile([2, 2, 1])),
            "--",
            "--config",
            str(cfg),
        ]
        job = bed.start(0, cmd, mpi_env())
        job.wait_for("checkpoint 2 complete")
        taken = max((p[0] for _, line in job.lines if (p := progress(line))), default=0)
        if fault == "cut":
            bed.cut(2)
        else:
            victim = [p for p in map(psutil.Process, bed.pids(2)) if p.name().startswith("python")]
            victim[0].send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        reported, _ = job.wait_for(lambda line: " is lost" in line or "launcher: " in line or "prterun noticed" in line)
        restarted, _ = job.wait_for("supervise: restarting on")
        started, _ = job.wait_for("started:")
        first = job.wait_for(progress)[1]
        base = progress(first)[1]
        new_result, _ = job.wait_for(lambda line: (p := progress(line)) is not None and p[1] > base)
        replayed, _ = job.wait_for(lambda line: (p := progress(line)) is not None and p[0] >= taken)
        code = job.wait(timeout=300)
    return {
        "fault": fault,
        "exit": code,
        "report_s": round(reported - t0, 2),
        "restart_s": round(restarted - t0, 2),
        "start_s": round(started - t0, 2),
        "first_result_s": round(new_result - t0, 2),
        "report_to_result_s": round(new_result - reported, 2),
        "replay_s": round(replayed - started, 2),
        "exact": code == 0 and exact(out, expected),
    }


def nemesis_record(minutes: float, seed: int, work: Path) -> dict:
    """A soak of `minutes` under the nemesis (tests.nemesis, run from the checkout as `make soak` does): its
    record."""
    record = work / "nemesis.json"
    cmd = [sys.executable, "-m", "tests.nemesis", "--minutes", f"{minutes:g}", "--seed", str(seed)]
    subprocess.run([*cmd, "--record", str(record)], cwd=Path(__file__).resolve().parent.parent, check=False)
    if not record.is_file():
        raise RuntimeError(f"{' '.join(cmd)} left no record (see its output above)")
    return json.loads(record.read_text())


def nemesis_figures(record: dict) -> dict:
    """A soak's record as the bench's figures: faults per hour, seconds to the first new result per kind of
    fault, results lost, each rank's peak resident memory (MiB)."""
    by_kind: dict[str, list] = {}
    for f in record["faults"]:
        by_kind.setdefault(f["fault"], []).append(f["first_result_s"])
    hours = record["sampled_seconds"] / 3600 or record["minutes"] / 60
    rss = {
        name.removeprefix("rss "): v["peak"] / 2**20
        for name, v in record["resources"].items()
        if name.startswith("rss ")
    }
    return {
        "seed": record["seed"],
        "minutes": record["minutes"],
        "faults": len(record["faults"]),
        "faults_per_hour": round(len(record["faults"]) / hours, 1) if hours else None,
        "restarts": record["restarts"],
        "first_result_s": {
            kind: {
                "n": len(times),
                "median": median(times),
                "max": max((t for t in times if t is not None), default=None),
                "none": sum(t is None for t in times),  # no new result before the run's end
            }
            for kind, times in sorted(by_kind.items())
        },
        "lost": record["lost"],
        "results_lost": sum(n for output in record["lost"].values() for n in output.values()),
        "peak_rss_mib": {who: round(v, 1) for who, v in sorted(rss.items())},
        "resources_flat": not any(v["failure"] for v in record["resources"].values()),
        "verdict": "PASS" if record["ok"] else "FAIL: " + "; ".join(record["failures"]),
    }


def nemesis_text(n: dict) -> str:
    """The nemesis part of failover.md."""
    kinds = md_table(
        ["fault", "met", "first new result median s", "max s", "none before the end"],
        [
            [k, str(v["n"]), fmt(v["median"], ".1f"), fmt(v["max"], ".1f"), str(v["none"])]
            for k, v in n["first_result_s"].items()
        ],
    )
    rss = md_table(["rank", "peak RSS MiB"], [[who, fmt(v, ".0f")] for who, v in n["peak_rss_mib"].items()])
    return (
        f"## Under the nemesis\n\n{n['minutes']:g} minutes, seed {n['seed']}: {n['faults']} faults "
        f"({fmt(n['faults_per_hour'], '.0f')} an hour), {n['restarts']} restarts; results lost "
        f"{n['results_lost']} (target 0: {'met' if n['results_lost'] == 0 else 'MISSED'}); resources "
        f"{'flat' if n['resources_flat'] else 'NOT FLAT'}; soak verdict {n['verdict']}\n\n{kinds}\n\n{rss}\n"
    )


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.failover", description=__doc__.split("\n")[0])
    p.add_argument(
        "--repeats", type=int, default=1, help="runs per fault (default 1; 0: the nemesis alone); medians are reported"
    )
    p.add_argument("--out", type=Path, default=Path("bench-report"))
    p.add_argument("--nemesis-minutes", type=float, default=3.0, help="the nemesis soak's length (default 3; 0: none)")
    p.add_argument("--nemesis-seed", type=int, default=7, help="its schedule's seed (default 7)")
    p.add_argument(
        "--nemesis-record", type=Path, default=None, help="a soak's record (tests.nemesis --record) to read instead"
    )
    a = p.parse_args(argv)
    expected = reference_pairs() if a.repeats else None
    runs = []
    record = json.loads(a.nemesis_record.read_text()) if a.nemesis_record else None
    try:
        with tempfile.TemporaryDirectory(prefix="streamjoin-failover-") as tmp:
            for i in range(a.repeats):
                for fault in ("cut", "kill"):
                    work = Path(tmp) / f"{fault}-{i}"
                    work.mkdir()
                    runs.append(run_once(fault, work, expected))
                    print(
                        f"[{fault} #{i + 1}] " + ", ".join(f"{k} {v}" for k, v in runs[-1].items() if k != "fault"),
                        flush=True,
                    )
            if record is None and a.nemesis_minutes > 0:
                record = nemesis_record(a.nemesis_minutes, a.nemesis_seed, Path(tmp))
    except TestBedError as e:
        print(f"bench.failover: no test bed here: {e}", file=sys.stderr)
        return 1
    nemesis = None if record is None else nemesis_figures(record)
    keys = ("report_s", "restart_s", "start_s", "first_result_s", "report_to_result_s", "replay_s")
    medians = {
        f: {k: median(r[k] for r in runs if r["fault"] == f) for k in keys} for f in ("cut", "kill") if a.repeats
    }
    met = {
        f: {
            "report": m["report_s"] <= REPORT_TARGET,
            "first_result": m["report_to_result_s"] <= RESULT_TARGET,
            "exact": all(r["exact"] for r in runs if r["fault"] == f),
        }
        for f, m in medians.items()
    }
    data = {
        "command": "python -m bench.failover " + " ".join(argv),
        "machine": machine_info(),
        "heartbeat_timeout": HEARTBEAT,
        "runs": runs,
        "medians": medians,
        "met": met,
        "nemesis": nemesis,
    }
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "failover.json").write_text(json.dumps(data, indent=2))
    table = md_table(
        [
            "fault",
            "loss reported s",
            "restart s",
            "ranks started s",
            "first new result s",
            "report to result s",
            "replay s",
            "exact",
        ],
        [[r["fault"], *(fmt(r[k], ".2f") for k in keys), str(r["exact"])] for r in runs],
    )
    verdict = "; ".join(
        f"{f}: reported {medians[f]['report_s']:.2f} s (target {REPORT_TARGET:g}) "
        f"{'met' if met[f]['report'] else 'MISSED'}, first result "
        f"{medians[f]['report_to_result_s']:.2f} s "
        f"after it (target {RESULT_TARGET:g}) {'met' if met[f]['first_result'] else 'MISSED'}, "
        f"{'exact' if met[f]['exact'] else 'NOT EXACT'}"
        for f in medians
    )
    faults = f"{table}\n\n{verdict}\n" if runs else ""
    text = faults + ("" if nemesis is None else "\n" * bool(runs) + nemesis_text(nemesis))
    (a.out / "failover.md").write_text(
        f"# Failover on three namespace hosts\n\n{data['command']}, heartbeat_timeout "
        f"{HEARTBEAT:g} s; seconds from the fault\n\n{text}"
    )
    print(text, end="", flush=True)
    held = nemesis is None or nemesis["results_lost"] == 0
    return 0 if held and all(all(m.values()) for m in met.values()) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
