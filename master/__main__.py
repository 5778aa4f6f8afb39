"""`mpirun -n N python -m master [--config FILE] [--set section.key=value ...]`

Rank 0 is the master; every other rank runs the slave (`python -m slave`), as
`mpirun -n 1 python -m master : -n N-1 python -m slave` would.  The dispatch by
module name is the only link between the two roles.
"""

from __future__ import annotations

import errno
import importlib
import os
import runpy
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from protocol.startup import BTL, early_importers

os.environ.setdefault("OMPI_MCA_btl", BTL)  # before MPI_Init reads it: under a bare mpirun too

from mpi4py import MPI

from master.cli import parse_args
from protocol.lifetime import INPUT_LOST, SINK, USER_ERROR
from protocol.errors import SinkError
from protocol.mpi import receive_start, run_rank, wait_barrier

#: errors of a full disk: at the start as later, the environment's, which a restart mends once there is room
FULL = (errno.ENOSPC, errno.EDQUOT)

if TYPE_CHECKING:
    from protocol.plan import Plan

# Only light modules above: every rank imports them, then the others sleep in a barrier while rank 0 alone
# imports numpy, pyarrow and its desks, reads the config and the input's first batch on a core of its own
# (all ranks importing at once on 2 cores delayed the first tuple by seconds: docs/benchmark-history.md).


RESTART_WAIT = 30.0  #: seconds a --recover start waits for the lock of the run it follows


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def find_resume(plan: Plan, slaves: list[int]) -> tuple:
    """With --recover: the newest complete checkpoint that fits this run, with the output rolled back to it; on
    another slave count its partition-groups are placed anew (protocol.checkpoint.reassign)."""
    from protocol import checkpoint

    root = plan.checkpoint.root
    found = checkpoint.latest_complete(root, log=say)
    if found is None:
        say(f"recover: no complete checkpoint under {root}: starting from the beginning")
        return None
    directory, manifest = found
    checkpoint.check_binding(manifest, plan.document)
    out = plan.output.path
    removed = checkpoint.roll_back_output(out, manifest["commit"])
    checkpoint.publish_aggregates(out, manifest["commit"][checkpoint.PENDING_AGGREGATES])  # if the crash came between
    then = len(checkpoint.slaves_of(manifest))
    rescale = f", taken with {then} slaves, on {len(slaves)}: its partition-groups placed anew" * (then != len(slaves))
    say(
        f"recover: resuming from checkpoint {manifest['id']} ({directory}){rescale}; "
        f"{removed} output files written after it removed"
    )
    return found


def sink_run(out: Path) -> str | None:
    """The Kafka sink's run id of the output a recovery goes on with (before a fresh start removes it)."""
    from master.sink import run_id

    return run_id(out)


def start_sink(plan: Plan, previous_run: str | None, commit: dict | None, slaves: list[int]):
    """Rank 0's Kafka result sink, with what the checkpoint resumed from (`commit`) covers in Kafka, and the plan
    the slaves receive: with the run's id and whether its end is in Kafka already."""
    from master.sink import KafkaSink, keep_run_id

    plan = plan.with_sink(keep_run_id(plan.output.path, previous_run), False)
    sink = KafkaSink(plan)
    say(sink.start(commit, slaves))
    return sink, plan.with_sink(plan.output.kafka.run, sink.complete)


@contextmanager
def sink_errors_abort(comm):
    """The Kafka sink could not deliver (master.sink): say so and end the job with SINK (docs/operating.md)."""
    try:
        yield
    except SinkError as e:
        say(f"error: kafka sink: {e}")
        comm.Abort(SINK)


def other_rank(comm) -> int:
    """Ranks 1..k-1 are further dispatchers with their share of the input; the rest run the slave."""
    # the cores this rank may run on (every core where the system has no affinity call, as macOS)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if comm.rank >= comm.size - early_importers(comm.size, cores):
        importlib.import_module("slave.run")
    wait_barrier(comm)  # until rank 0 has read the config and opened the input
    plan, resume = receive_start(comm)
    if plan is None:  # rank 0 refused the configuration and said why
        return USER_ERROR
    if comm.rank >= plan.cluster.dispatchers:
        runpy.run_module("slave", run_name="__main__", init_globals={"RECEIVED": (plan, resume)})
        return 0
    from master.run import Master
    from master.sources import open_shard
    from protocol import checkpoint

    if resume is not None:
        resume = (Path(resume["dir"]), checkpoint.load_manifest(Path(resume["dir"])))
    with input_errors_abort(comm):
        Master(comm, plan, open_shard(plan, comm.rank), resume).run()
    return 0


@contextmanager
def input_errors_abort(comm):
    """A file source finds a bad block or an unreadable file only when it reads that far, during the run: say
    so and end the whole job (the other ranks would wait for this one forever); input deleted before it was
    read (a Kafka stream's records) ends it with INPUT_LOST, which no restart mends."""
    from common.chunks import InputError, InputLost

    try:
        yield
    except InputError as e:
        say(f"error: {e}")
        comm.Abort(INPUT_LOST if isinstance(e, InputLost) else USER_ERROR)


def main() -> int:
    comm = MPI.COMM_WORLD
    args = parse_args(sys.argv[1:], quiet=comm.rank != 0)  # on every rank: a bad argument ends each alike
    if comm.rank != 0:
        return other_rank(comm)
    from master.lock import OutputBusy, OutputLock
    from master.run import Master
    from master.sources import open_shard
    from protocol import checkpoint
    from common.chunks import InputError, InputLost, InputRewound
    from protocol.config import ConfigError
    from protocol.plan import load_plan
    from protocol.output import OutputError, check_owned, reset_output

    resume = lock = sink = None
    try:
        if comm.size < 2:
            raise ConfigError(
                "the cluster needs a master and at least one slave: "
                "run it as `mpirun -n 5 python -m master` (or `make run`)"
            )
        plan = load_plan(args.config, args.set, args.sql, slaves=comm.size - 1)
        # a restart waits for the crashed cluster's ranks to be gone: two never write one folder
        lock = OutputLock(plan.output.path, wait=RESTART_WAIT if args.recover else 0.0, log=say)
        out = plan.output.path
        previous_run = None
        if any(spec.kafka and spec.kafka.pattern for spec in plan.streams):
            from master.sources.kafka_input import resolve_patterns

            found = checkpoint.latest_complete(plan.checkpoint.root, log=lambda _: None) if args.recover else None
            from protocol.plan import compile_plan

            plan, lines = resolve_patterns(plan, compile_plan(found[1]["config"]) if found else None)
            for line in lines:
                say(line)
        if args.recover:
            check_owned(out)
            previous_run = sink_run(out) if plan.output.kafka.topic else None
            resume = find_resume(plan, list(range(plan.cluster.dispatchers, comm.size)))
        if resume is None:
            reset_output(plan.output.path)
            checkpoint.clear(plan.checkpoint.root)
        if plan.output.kafka.topic:
            commit = None if resume is None else resume[1]["commit"]["results"]
            sink, plan = start_sink(plan, previous_run, commit, list(range(plan.cluster.dispatchers, comm.size)))
        source = open_shard(plan, 0)  # after the reset: declared streams write their payload log as they read
        master = Master(comm, plan, source, resume, sink)
        master.read_ahead()  # the first tuple, before the others start importing
    except SinkError as e:  # the broker: not a mistake in the configuration, a restart may find it back
        say(f"error: kafka sink: {e}")
        comm.Abort(SINK)
    except InputLost as e:  # a recovery's offsets below what the broker still holds
        say(f"error: {e}")
        comm.Abort(INPUT_LOST)
    except InputRewound:  # the broker lost records read since the start: a crash (run_rank), not a mistake
        raise
    except (ConfigError, InputError, checkpoint.CheckpointError, OutputError, OutputBusy, OSError) as e:
        if isinstance(e, OSError) and e.errno in FULL:  # no mistake: a crash (run_rank), restarted once there is room
            raise
        say(f"error: {e}")
        if lock is not None:
            lock.release()
        wait_barrier(comm)
        comm.bcast(None, root=0)
        return USER_ERROR
    wait_barrier(comm)
    comm.bcast(plan, root=0)
    comm.bcast(
        None
        if resume is None
        else {
            "dir": str(resume[0]),
            "result_files": resume[1]["result_files"],
            "seqs": [
                resume[1]["master"]["seq"],
                *(resume[1]["dispatchers"][str(d)]["seq"] for d in range(1, plan.cluster.dispatchers)),
            ],
            "aggregate_files": resume[1]["commit"][checkpoint.PENDING_AGGREGATES],
            "groups": checkpoint.slave_assignment(resume[1], list(range(plan.cluster.dispatchers, comm.size))),
        },
        root=0,
    )
    try:
        with input_errors_abort(comm), sink_errors_abort(comm):
            master.run()
    except KeyboardInterrupt:
        say("interrupted twice: aborting without a summary")
        comm.Abort(130)
    lock.release()
    return 0


if __name__ == "__main__":
    sys.exit(run_rank(main, "master" if MPI.COMM_WORLD.rank == 0 else "dispatcher"))
