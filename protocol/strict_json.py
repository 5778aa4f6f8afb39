"""JSON that any parser reads, for everything the engine writes (summary, checkpoint manifests).

json.dumps writes NaN and Infinity by default, which most JSON parsers refuse; a number that does not exist
is null here.  Only numpy and the standard library: Spark's Python workers read manifests and have no pyarrow.
"""

from __future__ import annotations

import json
import math

import numpy as np


def finite(value):
    """`value` with every NaN or infinite float (numpy's too) replaced by None, at any depth."""
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    if isinstance(value, (float, np.floating)):
        return float(value) if math.isfinite(value) else None
    if isinstance(value, np.integer):
        return int(value)
    return value


def json_text(value, **kw) -> str:
    """JSON that any parser reads: NaN and Infinity (which json.dumps writes by default, and most parsers
    refuse) become null."""
    return json.dumps(finite(value), allow_nan=False, **kw)
