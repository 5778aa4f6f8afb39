"""`python -m deploy.kernels`: build the engine's kernels ahead of time (protocol.compiled), and warm numba's
on-disk cache for what is compiled at run time (text keys' coding, and every kernel where no build was possible).

`make setup` and the launcher, after a kernel module changed (deploy.launch.warm_kernels), run it in a process
of its own: it compiles with numba's pycc and a C compiler, which the ranks never load.  Without a compiler
the kernels are not built, a line says so, and the ranks compile them with numba as before (about 0.3 s of CPU
more per rank at start)."""

from __future__ import annotations

import os
import sys
import tempfile
import warnings
from importlib import import_module
from pathlib import Path

from protocol.compiled import DECLARED, KERNELS_ENV, built_module

#: the modules whose kernels are built ahead of time (each ends with `protocol.compiled.kernels(...)`)
AHEAD = ("common.read_passes", "common.payload_passes", "master.state.lateness", "master.state.packing", "slave.kernel")


def _release_gil_in_wrappers() -> None:
    """pycc's wrappers hold the GIL while a kernel runs; numba's `nogil` ones release it (the slaves' result
    writer and the master's reader are threads beside the kernels).  pycc takes its compiler flags from one
    class, so a subclass that releases the GIL takes its place."""
    from numba.pycc import compiler

    class ReleasingGil(compiler.Flags):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.release_gil = True

    compiler.Flags = ReleasingGil


def build(module: str) -> Path:
    """Compile `module`'s declared kernels into the extension protocol.compiled loads for its current source;
    earlier builds of the module (for other sources) are removed: the engine wrote them."""
    from numba.pycc import CC

    space = vars(import_module(module))  # with KERNELS_ENV=jit: the kernels are numba's, as pycc takes them
    signatures, _ = DECLARED[module]
    name, path = built_module(space["__file__"])
    path.parent.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        cc = CC(name)
        cc.output_dir, cc.output_file = tmp, path.name
        for kernel, signature in signatures.items():
            cc.export(kernel, signature)(space[kernel].py_func)
        cc.compile()
        os.replace(Path(tmp) / path.name, path)
    stem = Path(space["__file__"]).stem
    for old in path.parent.glob(f"{stem}_aot_*"):
        if old != path:
            old.unlink()
    return path


def main() -> int:
    os.environ[KERNELS_ENV] = "jit"
    import pyarrow as pa

    from master.sources.keys import KeyDictionary

    KeyDictionary(pa.string()).codes(pa.array([str(i) for i in range(16)]))  # compiled at the first call: and a rehash
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # pycc's pending deprecation: the ranks do not depend on it (see above)
        _release_gil_in_wrappers()
        for module in AHEAD:
            try:
                build(module)
            except Exception as e:  # noqa: BLE001 - any failure to build leaves numba's compilation, which works
                why = (str(e).splitlines() or [""])[0]  # pycc's own advice runs on for lines (conda, ...)
                print(
                    f"deploy.kernels: {module}'s kernels not built ahead of time ({type(e).__name__}: {why}); "
                    "its ranks compile them with numba",
                    file=sys.stderr,
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
