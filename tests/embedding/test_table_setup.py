"""Set-up checks of TableSetup.build: storage that cannot work is refused before training."""

import pytest
from torchrec.modules.embedding_configs import EmbeddingBagConfig

from ctr_lightning.embedding import SparseAdam, StorageConfig, TieredEmbeddingBagCollection
from ctr_lightning.embedding.table_setup import available_memory_bytes

TABLES = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=16, num_embeddings=10**6, feature_names=[f"f{i}"])
          for i in range(3)]


def test_dram_budgets_larger_than_available_memory_name_the_tables_and_numbers(tmp_path):
    too_much = available_memory_bytes() // 2  # each of three tables: together 1.5x what is free
    with pytest.raises(MemoryError, match=r"DRAM tiers of 3 tables are budgeted .* GiB \(largest: 't0' .* GiB.*\) "
                                          r"but this machine has .* GiB of memory available"):
        TieredEmbeddingBagCollection(TABLES, optimizer=SparseAdam(), storage=StorageConfig(
            device_bytes=too_much, host_rows=0, ssd_dir=str(tmp_path)))
    # A budget that fits passes.
    TieredEmbeddingBagCollection(TABLES, storage=StorageConfig(device_bytes=1 << 20, host_rows=0, ssd_dir=str(tmp_path)))


MOUNTED = """
import os, subprocess, sys
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from ctr_lightning.embedding import StorageConfig, TieredEmbeddingBagCollection
root = sys.argv[1]
full, readonly = os.path.join(root, "full"), os.path.join(root, "readonly")
os.makedirs(full); os.makedirs(readonly)
subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", full], check=True)
subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", readonly], check=True)
tables = [EmbeddingBagConfig(name="ads", embedding_dim=8, num_embeddings=100, feature_names=["f"])]
for directory in (full, readonly):
    try:
        TieredEmbeddingBagCollection(tables, storage=StorageConfig(device_rows=10, host_rows=0, ssd_dir=directory))
        print("NO ERROR", directory)
    except OSError as e:
        print("ERROR", e)
"""


def test_a_full_or_read_only_ssd_file_system_is_refused_at_set_up(tmp_path, in_mount_namespace):
    # Real file systems, mounted in a private mount namespace that ends with the process.
    result = in_mount_namespace(MOUNTED, [str(tmp_path)], timeout=120)
    lines = [line for line in result.stdout.splitlines() if line.startswith(("ERROR", "NO ERROR"))]
    assert len(lines) == 2, result.stdout + result.stderr[-3000:]
    full, readonly = lines
    assert (f"SSD tier of tables ['ads']: {tmp_path}/full has " in full
            and "less than one segment file (268435456 bytes" in full), full
    assert f"SSD tier of tables ['ads']: cannot create files in {tmp_path}/readonly: read-only" in readonly, readonly
