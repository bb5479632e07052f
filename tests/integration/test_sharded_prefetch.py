import pytest
import torch



SHARDED_SCRIPT = r"""
import os, sys
import numpy as np, torch, torch.distributed as dist
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
from ctr_lightning.embedding import SparseAdam, StorageConfig, TieredEmbeddingBagCollection, WorkingSetPrefetcher

rank, out_dir, port = int(sys.argv[1]), sys.argv[2], sys.argv[3]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
tables = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=8, num_embeddings=5000, feature_names=[f"f{i}"])
          for i in range(3)]
rng = np.random.default_rng(rank)
batches = [KeyedJaggedTensor.from_lengths_sync(
    keys=["f0", "f1", "f2"], values=torch.from_numpy(rng.zipf(1.2, size=3 * 64) % 5000),
    lengths=torch.ones(3 * 64, dtype=torch.int32)) for _ in range(30)]
weights = torch.randn(24, generator=torch.Generator().manual_seed(0))
results = {}
for sharding in ("row_wise", "table_wise"):
    for lookahead in (None, 5):
        ebc = TieredEmbeddingBagCollection(
            tables, optimizer=SparseAdam(lr=0.05), sharding=sharding,
            storage=StorageConfig(device_rows=200, host_rows=0, ssd_dir=os.path.join(out_dir, f"{sharding}{lookahead}")))
        loop = batches if lookahead is None else WorkingSetPrefetcher(batches, ebc, lookahead, release_on_next=True)
        for kjt in loop:
            (ebc(kjt).values() @ weights).mean().backward()
        stats = [None, None]
        dist.all_gather_object(stats, ebc.tier_stats())
        rows = {t.name: ebc.rows(t.name, np.arange(5000)) for t in tables}  # collective
        results[(sharding, lookahead)] = {"rows": rows, "stats": stats, "bytes": ebc.comm_bytes()}
if rank == 0:
    torch.save(results, os.path.join(out_dir, "results.pt"))
print("RESULT {}", flush=True)
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_prefetch_of_sharded_tables_reads_ahead_at_the_owners(tmp_path, run_ranks):
    run_ranks(SHARDED_SCRIPT, [str(tmp_path), "{port}"], world=2, ddp_env=False)
    results = torch.load(tmp_path / "results.pt", weights_only=False)
    for sharding in ("row_wise", "table_wise"):
        plain, ahead = results[(sharding, None)], results[(sharding, 5)]
        for t, rows in plain["rows"].items():
            assert torch.equal(ahead["rows"][t], rows)  # bit for bit
        assert all(s["prefetch_hits"] == 0 and s["ssd_hits"] > 0 for s in plain["stats"])
        # Every owner read its rows ahead for the batches of both ranks: none on demand.
        for s in ahead["stats"]:
            assert s["prefetch_hits"] > 100 and s["ssd_hits"] == 0, ahead["stats"]
        # Reading ahead sends each batch's ids to their owners once more, nothing else.
        assert ahead["bytes"] > plain["bytes"]
