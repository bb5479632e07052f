"""A write that fails under the SSD tier (a full disk) is a clear error, loses no row,
and stops training: the rows it held stay readable (ssd_writer.SsdWriter)."""

import subprocess
import sys


FULL_DISK_SCRIPT = """
import resource, signal, sys, numpy as np, torch
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
from ctr_lightning.embedding import SparseAdam, StorageConfig, TieredEmbeddingBagCollection
# The file-size limit stands in for a full disk: writes past it fail as on a full SSD.
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
resource.setrlimit(resource.RLIMIT_FSIZE, (96 << 20, hard))
tables = [EmbeddingBagConfig(name="big", embedding_dim=64, num_embeddings=10**9, feature_names=["f"])]
ebc = TieredEmbeddingBagCollection(tables, storage=StorageConfig(device_rows=4096, host_rows=4096,
                                   ssd_dir=sys.argv[1]), optimizer=SparseAdam(lr=0.1))
seen = []
try:
    for step in range(1000):
        ids = torch.arange(step * 4096, (step + 1) * 4096)
        kjt = KeyedJaggedTensor.from_lengths_sync(keys=["f"], values=ids, lengths=torch.ones(4096, dtype=torch.int32))
        ebc(kjt).values().sum().backward()
        seen.append(ids)
except OSError as e:
    print("ERROR", e)
    ids = torch.cat(seen)
    rows = ebc.rows("big", ids)
    initial = TieredEmbeddingBagCollection(tables).rows("big", ids)
    print("LOST", int((rows == initial).all(dim=1).sum()), "OF", len(ids))
    resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))
    try:  # no training after a failed write: its rows are only readable
        ebc(kjt).values().sum().backward()
    except RuntimeError as e:
        print("STOPPED", e)
"""


def test_full_disk_is_a_clear_error_and_loses_nothing(tmp_path):
    result = subprocess.run([sys.executable, "-c", FULL_DISK_SCRIPT, str(tmp_path / "ssd")],
                            capture_output=True, text=True, timeout=300)
    assert "ERROR" in result.stdout, result.stdout + result.stderr[-2000:]
    assert "SSD tier of tables ['big']" in result.stdout and "rows already written are intact" in result.stdout
    assert "LOST 0 OF" in result.stdout, result.stdout
    assert "STOPPED tables ['big']: an SSD write failed earlier" in result.stdout, result.stdout
