import os
import subprocess
import sys

import pytest

# Runs in a fresh process, so the RSS it reports belongs to this workload alone.
SCRIPT = """
import os, sys, numpy as np, torch
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
from ctr_lightning.embedding import SparseAdam, StorageConfig, TieredEmbeddingBagCollection

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

budget, batch, dim = int(sys.argv[2]), 4096, 64
row_bytes = 4 * 3 * dim  # weights and Adam's two moments

def make(rows, budget, directory):
    tables = [EmbeddingBagConfig(name="big", embedding_dim=dim, num_embeddings=rows, feature_names=["f"])]
    storage = StorageConfig(device_bytes=budget // 4, host_bytes=budget - budget // 4, ssd_dir=directory)
    return TieredEmbeddingBagCollection(tables, storage=storage, optimizer=SparseAdam(lr=0.01), id_space="bounded")

def step(ebc, i, rows):
    ids = torch.arange(i * batch, (i + 1) * batch) % rows
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=["f"], values=ids, lengths=torch.ones(batch, dtype=torch.int32))
    ebc(kjt).values().sum().backward()

# A small twin first runs every path once, so compiled kernels are not counted as growth.
small = make(8 * batch, 8 * batch * row_bytes, sys.argv[1] + "-warmup")
for i in range(8):
    step(small, i, 8 * batch)
del small
start = rss()
ssd_rows = 12 * budget // row_bytes  # the SSD ends up holding more than 10x the budget
ebc = make(ssd_rows + batch, budget, sys.argv[1])
peak = 0
for i in range(ssd_rows // batch + 1):
    step(ebc, i, ssd_rows + batch)
    peak = max(peak, rss())
(rows_file,) = [f for f in os.listdir(sys.argv[1]) if f.endswith(".rows")]  # beside it: the directory lock
ssd_bytes = os.path.getsize(os.path.join(sys.argv[1], rows_file))
stored = ebc._built().groups[0].tiers.ssd.__len__() * row_bytes
print(f"RESULT budget={budget} growth={peak - start} ssd_file={ssd_bytes} ssd_rows_bytes={stored}")
"""


@pytest.mark.slow
def test_rss_growth_stays_within_host_budget_while_ssd_holds_10x(tmp_path):
    budget = 48 << 20
    # glibc otherwise raises its mmap threshold after large frees and keeps a step's freed
    # temporaries in the heap: an allocator policy, not memory the tables hold.
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(128 << 10))
    result = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "ssd"), str(budget)],
                            capture_output=True, text=True, timeout=300, env=env)
    line = next((l for l in result.stdout.splitlines() if l.startswith("RESULT")), None)
    assert line, result.stdout + result.stderr[-3000:]
    values = dict(kv.split("=") for kv in line.split()[1:])
    growth, stored = int(values["growth"]), int(values["ssd_rows_bytes"])
    assert stored >= 10 * budget, line
    # The overhead is one batch's temporaries and the caches' bookkeeping, not the SSD's size.
    assert growth <= budget + (24 << 20), line
    print(line)
