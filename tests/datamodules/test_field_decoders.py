import numpy as np
import pyarrow as pa

from ctr_lightning.datamodules.field_decoders import hash_bytes_ids, hash_values

from ..test_hashing import splitmix64_python

# Published FNV-1a 64-bit test vectors (Fowler, Noll, Vo; IETF draft-eastlake-fnv).
FNV1A_64 = {b"": 0xCBF29CE484222325, b"a": 0xAF63DC4C8601EC8C, b"foobar": 0x85944171F73967E8}


def test_byte_strings_hash_by_fnv1a_then_salted_splitmix64():
    strings = list(FNV1A_64)
    data = np.frombuffer(b"".join(strings), dtype=np.uint8)
    offsets = np.concatenate([[0], np.cumsum([len(s) for s in strings])]).astype(np.int64)
    for salt in (0, 0xD6E8FEB86659FD93):
        out = np.empty(len(strings), dtype=np.int64)
        hash_bytes_ids(offsets, data, np.uint64(salt), out)
        want = [splitmix64_python(FNV1A_64[s] ^ salt) & (2**63 - 1) for s in strings]
        assert out.tolist() == want


def test_small_values_hash_by_salted_splitmix64():
    values = np.array([0, 1, 23, 6], dtype=np.int64)
    salt = 0x1234_5678_9ABC_DEF0
    want = [splitmix64_python(v ^ salt) & (2**63 - 1) for v in values.tolist()]
    assert hash_values(values, np.uint64(salt)).tolist() == want


def test_compiled_decimals_equal_pyarrows_conversion_bit_for_bit():
    """The delimited reader's dense values: plain decimals in one compiled pass, the rest
    through pyarrow; every value and every bad mark as pyarrow alone gives them."""
    from ctr_lightning.datamodules.delimited import _arrow_dense_values, _dense_values

    rng = np.random.default_rng(0)
    texts = ["", "nan", "NaN", "-nan", "N/A", "NULL", "abc", "1e", "3.", ".5", "+3", " 4", "4 ", "1e400", "-0", "0",
             "00012.500", "1E5", "1e+05", "1e-05", "-1.5e-22", "9" * 15, "9" * 16, "1" + "0" * 22, "0.1", "1e22",
             "1e23", "123456789012345e-22", "1.7976931348623157e308", "--1", "1.2.3", "1e5e5", "١٢"]
    for _ in range(20000):
        digits = "".join(rng.choice(list("0123456789"), size=int(rng.integers(1, 19))))
        point = int(rng.integers(0, len(digits) + 1))
        number = digits[:point] + ("." + digits[point:] if point < len(digits) else "")
        if rng.random() < 0.3:
            number += f"e{int(rng.integers(-30, 31))}"
        texts.append(("-" if rng.random() < 0.3 else "") + number)
    column = pa.array(texts, pa.string()).cast(pa.binary())
    got, got_bad = _dense_values(column)
    want, want_bad = _arrow_dense_values(column)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    assert np.array_equal(got_bad, want_bad) and want_bad.sum() >= 8
