"""`streamjoin COMMAND [ARGS...]`: the engine's tools under one command.

Each command runs the `main(argv)` of the module a checkout runs as `python -m <folder>.<module>`, with ARGS
as they are, and exits with its code; `streamjoin COMMAND --help` is that module's own help.
"""

from __future__ import annotations

import importlib
import sys

from streamjoin import ENGINE_ROOT, __version__

USAGE_ERROR = 2  #: the engine's exit code for a user mistake (protocol.lifetime.USER_ERROR)

#: command: the module whose main(argv) it runs, and what it does
COMMANDS = {
    "run": ("deploy.launch", "start a cluster with mpirun: -n RANKS [--hostfile H] -- [--config FILE] [--set K=V]"),
    "supervise": ("control.supervise", "rerun a crashed cluster from its newest checkpoint: -- COMMAND..."),
    "audit": ("control.audit", "recompute a time range of the join with Spark SQL and diff it with the results"),
    "aggregate": ("control.aggregate", "merge the slaves' partial aggregates into the global view (Spark)"),
    "replay": ("control.replay", "replay archived or given streams into a cluster, at a chosen speed"),
    "dashboard": ("control.dashboard", "serve the dashboard of a finished run from its output folder"),
    "produce": ("control.produce", "push a file's tuples to a running cluster's live (ZeroMQ) input"),
    "subscribe": ("control.subscribe", "receive and check a running cluster's result stream (ZeroMQ)"),
    "checkpoints": ("control.checkpoints", "list, verify or compact a run's checkpoints"),
    "explain": ("control.explain", "print the plan a config and its query mean (keys, bounds, filters, pairs)"),
}
ALIASES = {"launch": "run"}


def usage() -> str:
    names = {name: ", ".join([name, *(a for a, target in ALIASES.items() if target == name)]) for name in COMMANDS}
    width = max(map(len, names.values())) + 2
    lines = [f"  {names[name]:<{width}}{line}" for name, (_, line) in COMMANDS.items()]
    return "\n".join(
        [
            "usage: streamjoin COMMAND [ARGS...]      (streamjoin COMMAND --help: that command's options)",
            "",
            f"streamjoin {__version__}: a distributed sliding-window stream join on MPI.",
            "",
            "commands:",
            *lines,
            "",
            "options:",
            f"  {'-h, --help':<{width}}show this help",
            f"  {'--version':<{width}}print the version",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        print(usage(), file=sys.stderr)
        return USAGE_ERROR
    command, args = argv[0], argv[1:]
    if command in ("-h", "--help"):
        print(usage())
        return 0
    if command == "--version":
        print(f"streamjoin {__version__}")
        return 0
    command = ALIASES.get(command, command)
    if command not in COMMANDS:
        print(
            f"streamjoin: unknown command {argv[0]!r}; the commands are {', '.join([*COMMANDS, *ALIASES])} "
            "(streamjoin --help says what each does)",
            file=sys.stderr,
        )
        return USAGE_ERROR
    # the engine imports its packages by their short names (master, protocol, ...): ours first, before any
    if sys.path[:1] != [str(ENGINE_ROOT)]:
        sys.path.insert(0, str(ENGINE_ROOT))
    return importlib.import_module(COMMANDS[command][0]).main(args)
