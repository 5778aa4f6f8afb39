"""Durations in the config as text ("30s", "250ms", "2m", "1h") as well as numbers of seconds.

One parser for every duration key (`DURATION_KEYS`), used by protocol.config when it reads a value.  The
text becomes float seconds whose shortest decimal is the value as written, so protocol.eventtime.duration
turns it into exactly those microseconds ("250ms" is 250,000 us, "0.1s" is 100,000 us).
"""

from __future__ import annotations

import re
from decimal import Decimal

#: (section, key) of every config key that is a duration in seconds
DURATION_KEYS = {
    ("join", "window"),
    ("join", "lower"),
    ("join", "upper"),
    ("join", "max_delay"),
    ("epochs", "distribution"),
    ("epochs", "reorganization"),
    ("master", "stall_timeout"),
    ("source", "idle_timeout"),
    ("generator", "duration"),
    ("generator", "disorder"),
    ("generator", "shift"),
    ("output", "progress"),
    ("metrics", "log_interval"),
    ("aggregate", "window"),
    ("aggregate", "slide"),
    ("aggregate", "flush_interval"),
    ("cluster", "heartbeat_timeout"),
}
#: unit -> seconds, as exact decimals
UNITS = {
    "ns": "1e-9",
    "us": "1e-6",
    "µs": "1e-6",
    "ms": "1e-3",
    "s": "1",
    "m": "60",
    "min": "60",
    "h": "3600",
    "d": "86400",
}
_TEXT = re.compile(r"^\s*([+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?)\s*(" + "|".join(UNITS) + r")?\s*$")


def parse_duration(text: str) -> float:
    """`text` ("30s", "250ms", "2m", "1.5h"; a bare number is seconds) in float seconds; ValueError says what
    is accepted."""
    m = _TEXT.match(text)
    if m is None:
        raise ValueError(
            f'expected a number of seconds or a duration such as "30s", "250ms", "2m", "1h" '
            f"(units: {', '.join(UNITS)}), got {text!r}"
        )
    return float(Decimal(m.group(1)) * Decimal(UNITS[m.group(2) or "s"]))


def from_text(section: str, key: str, value, error: type[Exception]):
    """A duration key's text as seconds (`error`, naming the key, if it is none); any other value as it is."""
    if (section, key) not in DURATION_KEYS or not isinstance(value, str):
        return value
    try:
        return parse_duration(value)
    except ValueError as e:
        raise error(f"{section}.{key}: {e}") from None
