"""What the numbers depend on: the machine a bench ran on."""

from __future__ import annotations

import datetime as dt
import os
import platform
import subprocess
from pathlib import Path

from deploy.launch import find_mpirun


def machine_info() -> dict:
    """What the numbers depend on: CPU, cores, memory, software versions, load when the bench started."""
    import mpi4py
    import numpy

    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor() or "unknown",
    )
    mem_kib = next(
        (
            int(line.split()[1])
            for line in Path("/proc/meminfo").read_text().splitlines()
            if line.startswith("MemTotal:")
        ),
        0,
    )
    ompi = subprocess.run([find_mpirun(), "--version"], capture_output=True, text=True).stdout.splitlines()
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gib": round(mem_kib / 2**20, 1),
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
        "os": platform.platform(),
        "python": platform.python_version(),
        "numpy": numpy.__version__,
        "mpi4py": mpi4py.__version__,
        "open_mpi": ompi[0] if ompi else "unknown",
        "date": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
    }
