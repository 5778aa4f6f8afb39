"""A busy host on one machine, for the load-balancing benchmark (bench only; the engine never imports it).

Paper 003 section IV-C balances slaves whose hosts differ in spare capacity
("a slave's host is busy with other work").  On one machine whose ranks all
float over all cores no slave is ever backlogged while another idles, so
repartitioning has nothing to fix.  Here the cores are split into two "hosts":

* the quiet host (the first half of the CPUs, at least CPU 0) runs the master
  and the first half of the slaves;
* the busy host (the other CPUs) runs the other slaves **and** `hogs` processes
  that spin on the CPU, as other work on a shared host would.

Every rank is pinned to its host's CPUs with `os.sched_setaffinity` by the rank
wrapper `python -m bench.busy` (which then runs `python -m master` as usual),
and the hogs to the busy host's CPUs.  Nothing in the engine is slowed by a
knob: a busy-host slave is slow only because the kernel's scheduler gives it a
smaller share of its CPU.
"""

from __future__ import annotations

import contextlib
import os
import runpy
import subprocess
import sys

PLAN_ENV = "STREAMJOIN_CPU_PLAN"  # ';'-separated CPU sets per rank, each ','-separated: "0;0;0;1;1"
RANK_ENV = "OMPI_COMM_WORLD_RANK"  # set by Open MPI's mpirun for every rank


def hosts(cpus: list[int]) -> tuple[list[int], list[int]]:
    """(quiet host CPUs, busy host CPUs): the first half (at least one) and the rest; [0] -> ([0], [0])."""
    cpus = sorted(cpus)
    if not cpus:
        raise ValueError("no CPUs to split into hosts")
    half = max(1, len(cpus) // 2)
    return cpus[:half], cpus[half:] or cpus[:half]


def cpu_plan(ranks: int, cpus: list[int]) -> list[list[int]]:
    """CPUs per rank: the master (rank 0) and slaves 1..ceil((ranks-1)/2) on the quiet host, the rest busy."""
    if ranks < 2:
        raise ValueError(f"a cluster has a master and at least one slave, got {ranks} ranks")
    quiet, busy = hosts(cpus)
    return [quiet if r == 0 or r not in busy_slaves(ranks) else busy for r in range(ranks)]


def busy_slaves(ranks: int) -> list[int]:
    """Ranks of the slaves on the busy host: the last floor((ranks-1)/2) slaves (the quiet host, which also runs
    the master, gets the odd one)."""
    return list(range(ranks // 2 + 1, ranks))


def encode_plan(plan: list[list[int]]) -> str:
    return ";".join(",".join(map(str, cs)) for cs in plan)


def decode_plan(text: str) -> list[set[int]]:
    """'0;0;1' -> [{0}, {0}, {1}]; a clear error for anything else."""
    try:
        plan = [{int(c) for c in part.split(",")} for part in text.split(";")]
    except ValueError:
        raise ValueError(f"{PLAN_ENV} must look like '0;0;1,2' (CPU sets per rank), got {text!r}") from None
    return plan


@contextlib.contextmanager
def hogs(n: int, cpus: list[int]):
    """`n` processes that spin on `cpus` while the block runs: the other work of a busy host.  Ended (SIGKILL,
    by pid) when the block exits, however it exits."""
    procs = [
        subprocess.Popen([sys.executable, "-c", "while True:\n    pass\n"], stdin=subprocess.DEVNULL) for _ in range(n)
    ]
    try:
        for p in procs:
            os.sched_setaffinity(p.pid, cpus)
        yield [p.pid for p in procs]
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()


def main() -> int:
    """Rank wrapper: pin this rank to its CPUs from $STREAMJOIN_CPU_PLAN, then run `python -m master`."""
    try:
        plan, rank = decode_plan(os.environ[PLAN_ENV]), int(os.environ[RANK_ENV])
    except KeyError as e:
        print(
            f"error: python -m bench.busy runs as an mpirun rank with {PLAN_ENV} set; {e} is missing",
            file=sys.stderr,
            flush=True,
        )
        return 2
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    if rank >= len(plan):
        print(f"error: {PLAN_ENV} has CPU sets for {len(plan)} ranks, this is rank {rank}", file=sys.stderr)
        return 2
    try:
        os.sched_setaffinity(0, plan[rank])
    except OSError as e:
        print(
            f"error: rank {rank} cannot be pinned to CPU(s) {sorted(plan[rank])} ({PLAN_ENV}): {e}",
            file=sys.stderr,
            flush=True,
        )
        return 2
    sys.argv[0] = "master"
    runpy.run_module("master", run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
