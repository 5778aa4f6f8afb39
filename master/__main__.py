"""`mpirun -n N python -m master [--config FILE] [--set section.key=value ...]`

Rank 0 is the master; every other rank runs the slave (`python -m slave`), as
`mpirun -n 1 python -m master : -n N-1 python -m slave` would.  The dispatch by
module name is the only link between the two roles.
"""
from __future__ import annotations

import argparse
import runpy
import sys

from mpi4py import MPI

from protocol.config import ConfigError, load_config, validate
from protocol.output import reset_output


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m master", description=__doc__.split("\n")[0])
    p.add_argument("--config", help="TOML config file (every key has a default; see README)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override one config key, e.g. --set join.window=2.0 (repeatable)")
    return p.parse_args(argv)


def main() -> int:
    comm = MPI.COMM_WORLD
    if comm.rank != 0:
        runpy.run_module("slave", run_name="__main__")
        return 0
    args = parse_args(sys.argv[1:])
    from master.source import InputError, open_source
    from master.run import Master
    try:
        if comm.size < 2:
            raise ConfigError("the cluster needs a master and at least one slave: "
                              "run it as `mpirun -n 5 python -m master` (or `make run`)")
        cfg = load_config(args.config, args.set)
        validate(cfg, slaves=comm.size - 1)
        source = open_source(cfg)
        reset_output(cfg["output"]["path"])
    except (ConfigError, InputError, OSError) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        comm.bcast(None, root=0)
        return 2
    comm.bcast(cfg, root=0)
    try:
        master = Master(comm, cfg, source)
    except OSError as e:  # e.g. output.zmq_endpoint already in use; the slaves are running, so abort them
        print(f"error: {e}", file=sys.stderr, flush=True)
        comm.Abort(2)
    try:
        master.run()
    except KeyboardInterrupt:
        print("interrupted twice: aborting without a summary", file=sys.stderr, flush=True)
        comm.Abort(130)
    return 0


if __name__ == "__main__":
    sys.exit(main())
