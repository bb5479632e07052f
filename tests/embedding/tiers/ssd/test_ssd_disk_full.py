"""A full disk under the SSD tier is reported as ENOSPC, naming the directory, its free
bytes and what the write needed: on a real, small file system (tmpfs in a mount namespace
of the test's own, gone with it)."""

import errno

import pytest

SCRIPT = r"""
import os, subprocess, sys
import torch
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
from ctr_lightning.embedding import StorageConfig, TieredEmbeddingBagCollection

root = sys.argv[1]
# Hashed ids (a log of segment files) and bounded ids (records at fixed offsets).
for id_space in ("hashed", "bounded"):
    small = os.path.join(root, id_space)
    os.makedirs(small)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", small], capture_output=True, text=True)
    if mounted.returncode:
        print("CANNOT MOUNT", mounted.stderr.strip())
        sys.exit()
    tables = [EmbeddingBagConfig(name="ads", embedding_dim=8, num_embeddings=10**6, feature_names=["f"])]
    ebc = TieredEmbeddingBagCollection(tables, id_space=id_space, storage=StorageConfig(
        device_rows=2048, host_rows=0, ssd_dir=small, ssd_segment_bytes=64 << 10))
    try:
        # 1024 new rows a step: the device tier spills them to SSD until 2 MiB are full.
        for step in range(200):
            ids = torch.arange(1024) + step * 1024
            kjt = KeyedJaggedTensor.from_lengths_sync(["f"], ids, torch.ones(1024, dtype=torch.int32))
            ebc(kjt).values().sum().backward()
        print("NO ERROR", id_space)
    except OSError as e:
        print("ERROR", id_space, e.errno, e)
"""


def test_a_full_disk_under_the_ssd_tier_is_enospc_naming_the_directory_and_the_bytes(tmp_path, in_mount_namespace):
    result = in_mount_namespace(SCRIPT, [str(tmp_path)], timeout=240)
    if "CANNOT MOUNT" in result.stdout:
        pytest.skip(f"cannot mount a tmpfs here: {result.stdout.strip()}")
    lines = [line.split(" ", 3) for line in result.stdout.splitlines() if line.startswith(("ERROR", "NO ERROR"))]
    assert len(lines) == 2, result.stdout + result.stderr[-3000:]
    for (kind, id_space, err, message), expected in zip(lines, ("hashed", "bounded")):
        assert (kind, id_space) == ("ERROR", expected), lines
        directory = tmp_path / id_space
        assert int(err) == errno.ENOSPC, message
        assert "No space left on device" in message and f"{directory} has " in message, message
        assert " bytes free and the write needed " in message and "choose another ssd_dir" in message, message
