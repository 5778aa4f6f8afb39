"""The shell's side of the desks' effects (master/state/channels.py): each carried out, in the order asked for.

Messages and orders go to the MPI edge (`edge.perform`: master/links.py, or a
test's recorder), late tuples and archived chunks to the intake's files
(`intake.perform`: master/intake_shell.py); lines go to standard error;
checkpoint files are written, published and pruned by protocol.checkpoint.
"""

from __future__ import annotations

import shutil
import sys

from master.state.channels import Prune, Publish, Say, Send, Tell, WriteManifest, WritePart
from master.state.intake import Archive, SetAside
from protocol import checkpoint


def carry_out(effects: list, edge, intake=None) -> None:
    for effect in effects:
        if isinstance(effect, (Send, Tell)):
            edge.perform(effect)
        elif isinstance(effect, (SetAside, Archive)):
            intake.perform(effect)
        elif isinstance(effect, Say):
            print(effect.line, file=sys.stderr, flush=True)
        elif isinstance(effect, WritePart):
            if effect.fresh and effect.directory.exists():  # an unfinished attempt of a run that crashed
                shutil.rmtree(effect.directory)
            checkpoint.write_atomic(effect.directory / effect.name, effect.data)
        elif isinstance(effect, WriteManifest):
            checkpoint.write_manifest(effect.directory, effect.manifest)
        elif isinstance(effect, Publish):
            checkpoint.publish_aggregates(effect.output, effect.counts)
        else:
            assert isinstance(effect, Prune), effect
            checkpoint.prune(effect.root, effect.keep)
