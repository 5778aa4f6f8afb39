"""Settings of the same workload compared: unpaced runs alternated A, B, A, B, ... (so the machine's drift
falls on all), the in-run rate of each, the ratio of the medians to the first's against a target, and a report.
Used by bench.metrics_cost (metrics off / on), bench.join_types (inner / left join) and bench.payload (no
payload / payload / payload on the result stream)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench.cluster import run_cluster
from bench.machine import machine_info
from bench.search import median
from bench.tables import fmt, md_table


def parser(
    prog: str, doc: str, quick_seconds: float, seconds: float, repeats: int, quick: str = ""
) -> argparse.ArgumentParser:
    """The benches' common options; `quick` says what --quick does, if not fewer seconds of event time."""
    p = argparse.ArgumentParser(prog=prog, description=doc.split("\n")[0])
    p.add_argument(
        "--quick",
        action="store_true",
        help=quick or f"{quick_seconds:g} s of event time per run instead of {seconds:g} s",
    )
    p.add_argument("--repeats", type=int, default=repeats, help=f"pairs of runs (default {repeats})")
    p.add_argument("--slaves", type=int, default=2)
    p.add_argument("--out", type=Path, default=Path("bench-report"))
    p.add_argument("--timeout", type=float, default=600.0)
    return p


class Comparison:
    """`modes`: {name: settings}, the first the baseline, the second the one the target is for; `workload`:
    settings of all."""

    def __init__(
        self,
        command: str,
        a: argparse.Namespace,
        workload: list[str],
        modes: dict[str, list[str]],
        ranks: dict[str, int] | None = None,
    ):
        """`ranks`: a mode's ranks in all, where it is not the slaves + 1 (several dispatchers)."""
        self.a, self.workload, self.modes, self.ranks = a, workload, modes, ranks or {}
        self.data = {
            "command": command,
            "machine": machine_info(),
            "workload": workload,
            "slaves": a.slaves,
            "runs": {m: [] for m in modes},
            "whole_process": {m: [] for m in modes},  #: tuples / (mpirun's start to its exit)
            "results": {m: [] for m in modes},  #: result rows of each run
            "cpu_ns_per_tuple": {m: [] for m in modes},  #: every rank's and mpirun's CPU over the input
        }

    def run(self, tmp: Path) -> None:
        """The alternated unpaced runs; then the medians and their ratios to the first mode's (`ratio`: the
        second's)."""
        for i in range(self.a.repeats):
            for mode, settings in self.modes.items():
                ranks = self.ranks.get(mode, self.a.slaves + 1)
                s = run_cluster(ranks, [*self.workload, *settings], tmp / f"{mode}-{i}", self.a.timeout)
                self.data["runs"][mode].append(s["throughput_tuples_per_s"])
                self.data["whole_process"][mode].append(round(s["input_total"] / s["process_seconds"], 1))
                self.data["results"][mode].append(s["results"])
                self.data["cpu_ns_per_tuple"][mode].append(round(s["cpu_seconds"] / s["input_total"] * 1e9, 1))
                print(
                    f"[{mode:>5} #{i + 1}] {s['throughput_tuples_per_s']:,.0f} tuples/s in-run, "
                    f"{self.data['whole_process'][mode][-1]:,.0f} whole process, "
                    f"{self.data['cpu_ns_per_tuple'][mode][-1]:,.0f} CPU ns a tuple",
                    flush=True,
                )
        self.data["medians"] = {m: median(r) for m, r in self.data["runs"].items()}
        base, *others = self.data["medians"].items()
        self.data["ratios"] = {m: round(v / base[1], 4) for m, v in others}
        self.data["ratio"] = self.data["ratios"][others[0][0]]
        cpu = {m: median(r) for m, r in self.data["cpu_ns_per_tuple"].items()}
        self.data["cpu_ratios"] = {m: round(cpu[m] / cpu[base[0]], 4) for m, _ in others}

    def verdict(self, target: float) -> str:
        base, other = list(self.modes)[:2]
        ratio = self.data["ratio"]
        return (
            f"{other}/{base} = {ratio:.3f} (target >= {target}: {'met' if ratio >= target else 'NOT met'}; "
            "each side's runs show the machine's noise)"
        )

    def write(self, name: str, title: str, heading: str, lines: list[str]) -> str:
        """`name`.json and `name`.md (the table of runs, then `lines`); returns the table."""
        runs = self.data["runs"]
        table = md_table(
            [heading, *(f"run {i + 1}" for i in range(self.a.repeats)), "median"],
            [[m, *(fmt(x, ",.0f") for x in r), fmt(self.data["medians"][m], ",.0f")] for m, r in runs.items()],
        )
        m, out = self.data["machine"], self.a.out
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{name}.json").write_text(json.dumps(self.data, indent=2))
        (out / f"{name}.md").write_text(
            "\n".join(
                [
                    f"# {title}",
                    "",
                    f"`{self.data['command'].strip()}` — {m['date']}",
                    "",
                    f"Machine: {m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB; {self.a.slaves} slaves + master; "
                    f"workload `{' '.join(self.workload)}`, unpaced, {' and '.join(runs)} alternated; in-run tuples/s.",
                    "",
                    table,
                    "",
                    *lines,
                    "",
                ]
            )
        )
        print(table + "\n" + "\n".join(lines))
        print(f"wrote {out / (name + '.md')}, {out / (name + '.json')}")
        return table
