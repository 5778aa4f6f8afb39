"""streamjoin: a distributed sliding-window stream join on MPI; `streamjoin --help` lists its commands (cli.py).

The engine's packages (master, slave, protocol, common, control, deploy) import each other by those short
names.  At the top of site-packages such generic names would collide with other distributions' and a user's
own modules, so a wheel installs them in this package's private folder `_engine/`; in the checkout (and an
editable install) they are the checkout's own folders.  ENGINE_ROOT is the folder that holds them:
streamjoin.cli puts it first on sys.path before it imports any of them, and deploy.launch gives the MPI ranks
the same folder as PYTHONPATH.  Importing this package alone leaves sys.path as it is.
"""

from __future__ import annotations

from pathlib import Path

_HERE = Path(__file__).resolve().parent
_INSTALLED = (_HERE / "_engine").is_dir()
#: where `master`, `protocol`, ... are imported from: `_engine/` in a wheel, the checkout's root otherwise
ENGINE_ROOT = _HERE / "_engine" if _INSTALLED else _HERE.parent


def _version() -> str:
    """A checkout's own pyproject.toml (an editable install's metadata is as old as the install), else the
    installed distribution's metadata."""
    if not _INSTALLED:
        import tomllib

        return tomllib.loads((_HERE.parent / "pyproject.toml").read_text())["project"]["version"]
    from importlib.metadata import version

    return version("streamjoin")


__version__ = _version()
