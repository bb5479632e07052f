import numpy as np

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
