"""Loss scaling on sharded tables: when one rank's gradient overflows, every owner and every
data-parallel replica skips the step, so 2 gloo ranks equal one process that never took it."""

import sys

import pytest
import torch

RANK_SCRIPT = r"""
import os, sys
import numpy as np, torch, torch.distributed as dist
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
from ctr_lightning.embedding import SparseAdam, StorageConfig, TieredEmbeddingBagCollection

rank, world, out_dir, port = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
if world > 1:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
TABLES = [EmbeddingBagConfig(name="t0", embedding_dim=8, num_embeddings=400, feature_names=["f0"]),
          EmbeddingBagConfig(name="t1", embedding_dim=8, num_embeddings=300, feature_names=["f1"]),
          EmbeddingBagConfig(name="t2", embedding_dim=4, num_embeddings=200, feature_names=["f2"])]
GLOBAL_BATCH, STEPS, OVERFLOW = 32, 6, 3

def local_kjt(step):
    rng = np.random.default_rng(step)
    lengths = rng.integers(1, 3, (3, GLOBAL_BATCH))
    ids = [rng.integers(0, n, l.sum()) * 7919 for l, n in zip(lengths, (400, 300, 200))]
    share = GLOBAL_BATCH // world
    values, lens = [], []
    for l, v in zip(lengths, ids):
        offsets = np.concatenate([[0], np.cumsum(l)])
        values.append(v[offsets[rank * share]:offsets[(rank + 1) * share]])
        lens.append(l[rank * share:(rank + 1) * share])
    return KeyedJaggedTensor(keys=["f0", "f1", "f2"], values=torch.from_numpy(np.concatenate(values)),
                             lengths=torch.from_numpy(np.concatenate(lens)))

loss_weights = torch.randn(20, generator=torch.Generator().manual_seed(0))
ebc = TieredEmbeddingBagCollection(
    TABLES, optimizer=SparseAdam(lr=0.05), sharding={"t0": "row_wise", "t1": "data_parallel", "t2": "table_wise"},
    storage=StorageConfig(device_rows=60, host_rows=0, ssd_dir=os.path.join(out_dir, f"ssd{world}")))
scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
ebc.set_grad_scaler(scaler)
for step in range(STEPS):
    if world == 1 and step == OVERFLOW:
        continue  # the reference never takes the step rank 1 overflows in
    loss = (ebc(local_kjt(step)).values() @ loss_weights).mean()
    if step == OVERFLOW and rank == 1:
        loss = loss * float("inf")  # this rank alone overflows
    scaler.scale(loss).backward()
ebc.checkpoint_to_snapshots(None)  # whole rows in the state dict, asked for
state = ebc.get_extra_state()  # collective: every rank gets all shards
replica = ebc.rows("t1", torch.arange(300) * 7919)  # a data-parallel table reads this rank's replica
torch.save({"state": state, "replica": replica}, os.path.join(out_dir, f"{world}_rank{rank}.pt"))
print("RESULT {}", flush=True)
if dist.is_initialized():
    dist.destroy_process_group()
"""


@pytest.mark.slow
def test_one_rank_overflowing_skips_the_step_on_every_owner_and_replica(tmp_path, run_ranks, monkeypatch):
    # The one-process reference runs here; the 2 ranks in processes of their own.
    monkeypatch.setattr(sys, "argv", ["rank", "0", "1", str(tmp_path), "0"])
    exec(compile(RANK_SCRIPT, "rank_script", "exec"), {"__name__": "__main__"})
    run_ranks(RANK_SCRIPT, ["2", str(tmp_path), "{port}"], world=2, ddp_env=False)
    one = torch.load(tmp_path / "1_rank0.pt", weights_only=False)
    two = [torch.load(tmp_path / f"2_rank{r}.pt", weights_only=False) for r in (0, 1)]
    for name, want in one["state"]["tables"].items():
        got = two[0]["state"]["tables"][name]
        assert got["steps"] == want["steps"] == 5, name
        assert sorted(got["ids"].tolist()) == sorted(want["ids"].tolist()), name
        order_got, order_want = torch.argsort(got["ids"]), torch.argsort(want["ids"])
        assert torch.isfinite(got["rows"]).all(), name
        torch.testing.assert_close(got["rows"][order_got], want["rows"][order_want], atol=1e-5, rtol=0)
    assert torch.equal(two[0]["replica"], two[1]["replica"])  # the replicas stayed equal
    torch.testing.assert_close(two[0]["replica"], one["replica"], atol=1e-5, rtol=0)
