"""The engine's compiled kernels (the slaves' joins, the master's lateness and routing passes): loaded from the
extension module built ahead of time for their source (deploy.kernels, at `make setup` and at the first launch
after a change), else compiled by numba at import (or loaded from numba's on-disk cache).

Importing numba and loading its cached kernels cost every rank about 0.3 s of CPU at each start, as much as the
rest of a slave's start together; the built module costs nothing to load and runs the same machine code
(docs/benchmark-history.md, "Kernels built ahead of time").  Its name carries a hash of the kernel module's
source and of the project's modules it imports from (a build freezes the constants it reads there, as the
routing pass does protocol.tuples' hash multipliers), so a changed kernel never runs from an older build:
numba compiles it until the next build.  Built
kernels release the GIL as numba's `nogil` ones do.  STREAMJOIN_KERNELS=jit always compiles with numba (the
build itself does, and a test compares both).

Kernels are written as plain functions: `kernels(__name__, {name: signature}, inline=(helpers,))` at the end of
their module returns the compiled ones in the order of the signatures (numba's `njit(signature)`), the helpers
inlined into them."""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import os
import re
import sys
from pathlib import Path

#: STREAMJOIN_KERNELS=jit: compile with numba even when a built module is present
KERNELS_ENV = "STREAMJOIN_KERNELS"

#: each kernel module's kernels (name -> numba signature) and inlined helpers, as it declared them at import
DECLARED: dict[str, tuple[dict[str, str], tuple[str, ...]]] = {}


#: `from X import a, b` at the start of a line (a kernel module's imports, parenthesized or not)
_IMPORT_FROM = re.compile(r"^from ([\w.]+) import \(?([\w, ]*)", re.MULTILINE)


def kernel_sources(source: str | Path) -> list[Path]:
    """The kernel module at `source`, then the modules it imports from that live in its own tree (the folder
    above its top package): what its built kernels may have frozen."""
    source = Path(source).resolve()
    root = source.parent
    while (root / "__init__.py").exists():
        root = root.parent
    files = [source]
    for module, names in _IMPORT_FROM.findall(source.read_text()):
        top = module.split(".")[0]
        if not ((root / top).is_dir() or (root / f"{top}.py").exists()):
            continue  # the standard library, numba, numpy
        spec = importlib.util.find_spec(module)
        found = [spec]
        if spec is not None and spec.submodule_search_locations:  # `from protocol import delays`: a module
            found += [importlib.util.find_spec(f"{module}.{n.strip()}") for n in names.split(",") if n.strip()]
        for s in found:
            if s is not None and s.origin and Path(s.origin) not in files:
                files.append(Path(s.origin))
    return files


def built_module(source: str | Path) -> tuple[str, Path]:
    """The module name and path of the extension built ahead of time for the kernel module at `source`, as it
    and what it imports from are now: `__pycache__/<stem>_aot_<hash>.<this Python's extension suffix>` beside
    it."""
    source = Path(source)
    digest = hashlib.sha256(b"".join(f.read_bytes() for f in kernel_sources(source))).hexdigest()[:16]
    name = f"{source.stem}_aot_{digest}"
    return name, source.parent / "__pycache__" / f"{name}{importlib.machinery.EXTENSION_SUFFIXES[0]}"


def kernels(module: str, signatures: dict[str, str], inline: tuple[str, ...] = ()) -> tuple:
    """`module`'s kernels compiled, in the order of `signatures`: from its built extension if there is one for
    its source, else by numba (the helpers in `inline` are inlined into the kernels that call them)."""
    DECLARED[module] = (signatures, inline)
    space = vars(sys.modules[module])
    if os.environ.get(KERNELS_ENV) != "jit":
        name, path = built_module(space["__file__"])
        if path.exists():
            spec = importlib.util.spec_from_file_location(name, path)
            built = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(built)
            return tuple(getattr(built, k) for k in signatures)
    from numba import njit  # here: a rank with a built module never imports numba

    for h in inline:
        space[h] = njit(cache=True, nogil=True, inline="always")(space[h])
    for k, signature in signatures.items():
        space[k] = njit(signature, cache=True, nogil=True)(space[k])
    return tuple(space[k] for k in signatures)
