"""The wheel's package layout, which pyproject.toml cannot say (the rest is there).

The engine's packages are found in the checkout, not listed, and installed under the private import root
`streamjoin/_engine/` instead of the top of site-packages (streamjoin/__init__.py says why); each ships the
files its folder holds beside its Python modules (the dashboard page, common/dashboard.html).
"""

from pathlib import Path

from setuptools import find_packages, setup

ENGINE_ROOT = "streamjoin._engine"
#: everything but the front package, the tests, the examples and the benchmarks (a tool of this checkout: it
#: needs the bench extra, compares with docs/ and writes into the working folder; the engine never imports it)
ENGINE = find_packages(
    exclude=["streamjoin", "streamjoin.*", "tests", "tests.*", "examples", "examples.*", "bench", "bench.*"]
)


def beside_modules(package: str) -> list[str]:
    """The files in a package's folder that are neither Python modules nor hidden."""
    return [
        f.name
        for f in Path(*package.split(".")).iterdir()
        if f.is_file() and f.suffix not in (".py", ".pyc") and not f.name.startswith(".")
    ]


setup(
    packages=[*find_packages(include=["streamjoin", "streamjoin.*"]), *(f"{ENGINE_ROOT}.{p}" for p in ENGINE)],
    package_dir={ENGINE_ROOT: "."},
    package_data={f"{ENGINE_ROOT}.{p}": beside_modules(p) for p in ENGINE},
)
