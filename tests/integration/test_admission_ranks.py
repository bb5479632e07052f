"""Admission sharded over 2 gloo ranks admits exactly what one process does, also across a
resume; k-step tables keep the same rows across a resume."""

import sys

import pytest
import torch

# Run by each rank and by the one-process reference: the same global batches, each rank
# its slice; each sharding trained straight through, and cut after 5 steps and resumed in
# a new collection from the state dict. On 2 ranks also with k-step tables (merges every 2
# steps), whose owners admit at each merge on all ranks' sightings of the interval.
RANK_SCRIPT = r"""
import os, sys
import numpy as np, torch, torch.distributed as dist
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
from ctr_lightning.embedding import Admission, SparseAdam, StorageConfig, TieredEmbeddingBagCollection

rank, world, out_dir, port = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
if world > 1:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
TABLES = [
    EmbeddingBagConfig(name="t0", embedding_dim=8, num_embeddings=400, feature_names=["f0"]),
    EmbeddingBagConfig(name="t1", embedding_dim=8, num_embeddings=300, feature_names=["f1"],
                       pooling=PoolingType.MEAN),
]
GLOBAL_BATCH, STEPS, CUT = 64, 10, 5

def global_batch(step):
    rng = np.random.default_rng(step)
    lengths = np.stack([rng.integers(1, 3, GLOBAL_BATCH), rng.integers(0, 4, GLOBAL_BATCH)])
    ids = [(rng.zipf(1.3, size=l.sum()) * 7919) % (1 << 40) for l in lengths]
    return lengths, ids

def local_kjt(step):
    lengths, ids = global_batch(step)
    share = GLOBAL_BATCH // world
    values, lens = [], []
    for l, v in zip(lengths, ids):
        offsets = np.concatenate([[0], np.cumsum(l)])
        lo, hi = rank * share, (rank + 1) * share
        values.append(v[offsets[lo]:offsets[hi]])
        lens.append(l[lo:hi])
    return KeyedJaggedTensor(keys=["f0", "f1"], values=torch.from_numpy(np.concatenate(values)),
                             lengths=torch.from_numpy(np.concatenate(lens)))

loss_weights = torch.randn(16, generator=torch.Generator().manual_seed(0))

def make(label):
    ssd_dir = os.path.join(out_dir, f"ssd_{label}_{world}")
    sync = dict(sparse_sync="k_step", sync_every=2) if label.startswith("kstep") else {}
    return TieredEmbeddingBagCollection(
        TABLES, optimizer=SparseAdam(lr=0.05), sharding=label.split("+")[0].replace("kstep_", ""),
        admission=Admission(admit_after=2), storage=StorageConfig(device_rows=40, host_rows=0, ssd_dir=ssd_dir),
        **sync)

def train(ebc, steps):
    for step in steps:
        pooled = ebc(local_kjt(step)).values()
        (pooled @ loss_weights).mean().backward()

seen = {t.name: sorted({int(i) for s in range(STEPS) for i in global_batch(s)[1][k]}) for k, t in enumerate(TABLES)}
LABELS = ["row_wise", "table_wise", "row_wise+resumed"]
if world > 1:
    LABELS += ["kstep_row_wise", "kstep_row_wise+resumed", "kstep_table_wise", "kstep_table_wise+resumed"]
for label in LABELS:
    ebc = make(label)
    if label.endswith("resumed"):
        train(ebc, range(CUT))
        ebc.checkpoint_to_snapshots(None)
        state = ebc.state_dict()
        ebc = make(label + "_again")
        ebc.load_state_dict(state)
        train(ebc, range(CUT, STEPS))
    else:
        train(ebc, range(STEPS))
    rows = {name: ebc.rows(name, ids) for name, ids in seen.items()}  # collective when sharded
    ebc.checkpoint_to_snapshots(None)
    state = ebc.get_extra_state()  # collective: every rank gets all shards and all counters
    counters = [None] * world
    if world > 1:
        dist.all_gather_object(counters, ebc.tier_stats())
    else:
        counters = [ebc.tier_stats()]
    if rank == 0:
        torch.save({"rows": rows, "stored": {n: sorted(s["ids"].tolist()) for n, s in state["tables"].items()},
                    "sightings": state["sightings"], "counters": counters},
                   os.path.join(out_dir, f"{label}_{world}.pt"))
print("RESULT {}", flush=True)
if dist.is_initialized():
    dist.destroy_process_group()
"""


@pytest.mark.slow
def test_two_ranks_admit_what_one_process_admits(tmp_path, run_ranks, monkeypatch):
    # The one-process reference runs here; the 2 ranks in processes of their own.
    monkeypatch.setattr(sys, "argv", ["rank", "0", "1", str(tmp_path), "0"])
    exec(compile(RANK_SCRIPT, "rank_script", "exec"), {"__name__": "__main__"})
    run_ranks(RANK_SCRIPT, ["2", str(tmp_path), "{port}"], world=2, ddp_env=False)
    one = torch.load(tmp_path / "row_wise_1.pt", weights_only=False)
    admitted = sum(c["rows_admitted"] for c in one["counters"])
    assert admitted == sum(len(ids) for ids in one["stored"].values())  # every admitted row is stored
    assert 20 < admitted and sum(c["rows_rejected"] for c in one["counters"]) > admitted
    for label in ("row_wise", "table_wise", "row_wise+resumed"):
        for world in (1, 2):
            run = torch.load(tmp_path / f"{label}_{world}.pt", weights_only=False)
            assert run["stored"] == one["stored"], (label, world)  # the same ids admitted, exactly
            for name, counts in one["sightings"].items():
                assert torch.equal(run["sightings"][name], counts), (label, world, name)
            for name, rows in one["rows"].items():
                torch.testing.assert_close(run["rows"][name], rows, atol=1e-5, rtol=0)
    # Row-wise, each rank admitted its own share; the counts add up to one process's.
    two = torch.load(tmp_path / "row_wise_2.pt", weights_only=False)
    assert all(c["rows_admitted"] > 0 for c in two["counters"])
    assert sum(c["rows_admitted"] for c in two["counters"]) == admitted
    # k-step tables: straight and resumed keep the same set of rows and the same sketches.
    for kind in ("kstep_row_wise", "kstep_table_wise"):
        straight = torch.load(tmp_path / f"{kind}_2.pt", weights_only=False)
        resumed = torch.load(tmp_path / f"{kind}+resumed_2.pt", weights_only=False)
        admitted = sum(c["rows_admitted"] for c in straight["counters"])
        assert admitted == sum(len(ids) for ids in straight["stored"].values()) > 20
        assert sum(c["rows_rejected"] for c in straight["counters"]) > admitted
        assert resumed["stored"] == straight["stored"], kind
        for name, counts in straight["sightings"].items():
            assert torch.equal(resumed["sightings"][name], counts), (kind, name)
