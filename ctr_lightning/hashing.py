"""Vectorised integer hashes shared by the log readers and the synthetic generator.

Feature ids must be stable across files, workers and runs, so they come from fixed
bit-mixing functions rather than Python's salted ``hash``.
"""

from __future__ import annotations

import numba
import numpy as np

_U64 = np.uint64
_MASK63 = _U64((1 << 63) - 1)
_MASK32 = _U64(0xFFFFFFFF)


def splitmix64(x: np.ndarray) -> np.ndarray:
    """The SplitMix64 finaliser: a bijection on uint64 with full avalanche."""
    with np.errstate(over="ignore"):  # uint64 wrap-around is the point
        z = np.asarray(x, dtype=_U64) + _U64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> _U64(30))) * _U64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> _U64(27))) * _U64(0x94D049BB133111EB)
        return z ^ (z >> _U64(31))


@numba.njit(cache=True, inline="always")
def splitmix64_one(x: np.uint64) -> np.uint64:
    """:func:`splitmix64` of one uint64, for compiled loops."""
    z = x + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def feature_salt(feature_index: int) -> np.uint64:
    """The per-feature salt that :func:`feature_ids` mixes into values."""
    return _U64((feature_index + 1) * 0xD6E8FEB86659FD93 & 0xFFFFFFFFFFFFFFFF)


def mix32(x: np.ndarray) -> np.ndarray:
    """A bijection on 32-bit values (Wellons' lowbias32); keeps distinct inputs distinct."""
    z = np.asarray(x, dtype=_U64) & _MASK32
    z = ((z ^ (z >> _U64(16))) * _U64(0x7FEB352D)) & _MASK32
    z = ((z ^ (z >> _U64(15))) * _U64(0x846CA68B)) & _MASK32
    return z ^ (z >> _U64(16))


def feature_ids(values: np.ndarray, feature_index: int) -> np.ndarray:
    """Map raw per-feature values (uint64) to non-negative int64 ids, salted by feature.

    Ids are 63-bit so they stay non-negative as int64, the dtype KJTs carry.
    """
    return (splitmix64(np.asarray(values, dtype=_U64) ^ feature_salt(feature_index)) & _MASK63).astype(np.int64)


def uniform01(x: np.ndarray) -> np.ndarray:
    """Hash to a float64 in (0, 1), for deterministic per-key random effects."""
    return ((splitmix64(x) >> _U64(11)).astype(np.float64) + 0.5) / float(1 << 53)


def unit_variance(x: np.ndarray) -> np.ndarray:
    """Hash to a zero-mean, unit-variance value (uniform on [-sqrt 3, sqrt 3]).

    Cheaper than a hashed Gaussian; the generator only needs its first two moments.
    """
    return (2.0 * uniform01(x) - 1.0) * np.sqrt(3.0)
