"""The master's command line, without MPI: every rank parses it (an argument error ends all of them alike, not
rank 0 alone while the others wait for it), and deploy.launch checks it before mpirun starts any rank."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from protocol.plan import Plan

USAGE = "`mpirun -n N python -m master [--config FILE] [--sql FILE] [--set section.key=value ...]`"


class Parser(argparse.ArgumentParser):
    """argparse that, when `quiet`, exits with its code without printing: one rank explains, the others agree."""

    def __init__(self, quiet: bool, **kw):
        super().__init__(**kw)
        self.quiet = quiet

    def _print_message(self, message, file=None):
        if not self.quiet:
            super()._print_message(message, file)


def parse_args(argv: list[str], quiet: bool = False) -> argparse.Namespace:
    p = Parser(quiet, prog="python -m master", description=f"run the stream join cluster: {USAGE}")
    p.add_argument("--config", help="TOML config file (every key has a default: docs/configuration.md)")
    p.add_argument(
        "--sql",
        metavar="FILE",
        help="the join as a Spark SQL query over the config's [streams.NAME] (docs/query.md); as query.sql",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override one config key, e.g. --set join.window=2.0 (repeatable)",
    )
    p.add_argument(
        "--recover",
        action="store_true",
        help="resume from the newest complete checkpoint (a fresh start if there is none)",
    )
    return p.parse_args(argv)


def checked_plan(argv: list[str], slaves: int) -> Plan:
    """The plan `argv` gives, validated for `slaves` slaves (raises ConfigError, exits 2 on a bad argument)."""
    from protocol.plan import load_plan

    args = parse_args(argv)
    return load_plan(args.config, args.set, args.sql, slaves=slaves)
