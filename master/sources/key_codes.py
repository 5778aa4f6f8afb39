"""The compiled passes of master.sources.keys' dictionaries: hashing, coding and rehashing byte strings, whole
batches at a time.  Compiled by numba at their first call (and cached on disk); imported only where keys are
text or composite."""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True, nogil=True)
def _hash(data, start, end):
    """FNV-1a over the bytes, 64 bits (where to look first; equality is decided by the bytes)."""
    h = np.uint64(14695981039346656037)
    for i in range(start, end):
        h = (h ^ np.uint64(data[i])) * np.uint64(1099511628211)
    return h ^ (h >> np.uint64(29))


@njit(cache=True, nogil=True)
def _same(a, a0, a1, b, b0, b1):
    if a1 - a0 != b1 - b0:
        return False
    for i in range(a1 - a0):
        if a[a0 + i] != b[b0 + i]:
            return False
    return True


@njit(cache=True, nogil=True)
def _place(slots, hashes, code):
    mask = len(slots) - 1
    at = hashes[code] & np.uint64(mask)
    while slots[at] >= 0:
        at = (at + np.uint64(1)) & np.uint64(mask)
    slots[at] = code


@njit(cache=True, nogil=True)
def _code(data, offsets, slots, hashes, arena, ends, count, used, codes):
    """Each value's code: found by its hash's slot, then the exact bytes; an unseen value is appended to the
    arena (bytes `arena`, value ends `ends`, hashes) and the slots.  Returns (count, used, the first value
    whose hash another value has: -1 if none) after."""
    mask = np.uint64(len(slots) - 1)
    collided = -1
    for i in range(len(offsets) - 1):
        v0, v1 = offsets[i], offsets[i + 1]
        h = _hash(data, v0, v1)
        at = h & mask
        while True:
            c = slots[at]
            if c < 0:
                arena[used : used + v1 - v0] = data[v0:v1]
                used += v1 - v0
                ends[count + 1] = used
                hashes[count] = h
                slots[at] = count
                codes[i] = count
                count += 1
                break
            if hashes[c] == h:
                if _same(arena, ends[c], ends[c + 1], data, v0, v1):
                    codes[i] = c
                    break
                if collided < 0:
                    collided = i
            at = (at + np.uint64(1)) & mask
    return count, used, collided


@njit(cache=True, nogil=True)
def _rehash(slots, hashes, count):
    for c in range(count):
        _place(slots, hashes, c)
