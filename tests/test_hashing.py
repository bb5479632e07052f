"""Known answers for the id hashes: every reader and the generator build on them, and the
reference decoders in the DataModule tests call these same functions."""

import numpy as np

from ctr_lightning.hashing import feature_ids, feature_salt, mix32, splitmix64, splitmix64_one

M64 = (1 << 64) - 1


def splitmix64_python(x: int) -> int:
    """SplitMix64 (Steele, Lea, Flood 2014; Vigna's splitmix64.c), in Python integers."""
    z = (x + 0x9E3779B97F4A7C15) & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def test_splitmix64_first_output_for_seed_zero():
    # The published first output of a SplitMix64 generator seeded with 0.
    assert int(splitmix64(np.array([0], dtype=np.uint64))[0]) == 0xE220A8397B1DCDAF
    assert int(splitmix64_one(np.uint64(0))) == 0xE220A8397B1DCDAF
    assert splitmix64_python(0) == 0xE220A8397B1DCDAF


def test_splitmix64_matches_python_integers_everywhere():
    rng = np.random.default_rng(0)
    xs = np.concatenate([rng.integers(0, 2**63, 500, dtype=np.uint64) * np.uint64(2) + np.uint64(1),
                         np.array([0, 1, 2**63, M64], dtype=np.uint64)])
    got = splitmix64(xs)
    assert [int(v) for v in got] == [splitmix64_python(int(x)) for x in xs]
    assert [int(splitmix64_one(x)) for x in xs[:20]] == [int(v) for v in got[:20]]


def test_mix32_is_wellons_lowbias32_and_a_bijection():
    def lowbias32(x: int) -> int:
        x ^= x >> 16
        x = (x * 0x7FEB352D) & 0xFFFFFFFF
        x ^= x >> 15
        x = (x * 0x846CA68B) & 0xFFFFFFFF
        return x ^ (x >> 16)

    xs = np.array([0, 1, 2, 12345, 0xFFFFFFFF, 0xDEADBEEF], dtype=np.uint64)
    assert [int(v) for v in mix32(xs)] == [lowbias32(int(x)) for x in xs]
    assert lowbias32(0) == 0  # lowbias32 fixes 0, as published
    block = mix32(np.arange(1 << 16, dtype=np.uint64))
    assert len(np.unique(block)) == 1 << 16


def test_feature_ids_are_salted_63_bit_splitmix():
    values = np.array([0, 7, 0xFFFFFFFF, 2**63 + 5], dtype=np.uint64)
    for feature in (0, 1, 25):
        salt = (feature + 1) * 0xD6E8FEB86659FD93 & M64
        assert int(feature_salt(feature)) == salt
        want = [splitmix64_python(int(v) ^ salt) & (2**63 - 1) for v in values]
        got = feature_ids(values, feature)
        assert got.dtype == np.int64 and got.tolist() == want and (got >= 0).all()
    # The same value in two features is two ids.
    assert feature_ids(values, 0).tolist() != feature_ids(values, 1).tolist()
