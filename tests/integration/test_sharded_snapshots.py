"""Table snapshots of sharded collections: each of 2 gloo ranks writes its own rows, rank 0
the manifest; the snapshot loads into another sharding, other budgets, and one process,
and a snapshot of one process loads into 2 ranks."""

import os

import pytest
import torch
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from ctr_lightning.embedding import SparseAdam, StorageConfig, TieredEmbeddingBagCollection
from ctr_lightning.embedding.snapshots.table_snapshot import SnapshotManifest, read_snapshot_file

TABLES = [
    EmbeddingBagConfig(name="t0", embedding_dim=8, num_embeddings=400, feature_names=["f0"]),
    EmbeddingBagConfig(name="t1", embedding_dim=8, num_embeddings=300, feature_names=["f1"],
                       pooling=PoolingType.MEAN),
    EmbeddingBagConfig(name="t2", embedding_dim=4, num_embeddings=200, feature_names=["f2", "f3"]),
]

# Each rank trains with the SSD tier in use, saves (collective), then a collection of
# another sharding and other budgets loads the snapshot and must hold the same rows; both
# train on and must stay together (the optimizer state came along).
RANK_SCRIPT = r"""
import json, os, resource, signal, sys
import numpy as np, torch, torch.distributed as dist
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
from ctr_lightning.embedding import SparseAdam, StorageConfig, TieredEmbeddingBagCollection

rank, out_dir, port = int(sys.argv[1]), sys.argv[2], sys.argv[3]
world = 2
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
TABLES = [
    EmbeddingBagConfig(name="t0", embedding_dim=8, num_embeddings=400, feature_names=["f0"]),
    EmbeddingBagConfig(name="t1", embedding_dim=8, num_embeddings=300, feature_names=["f1"],
                       pooling=PoolingType.MEAN),
    EmbeddingBagConfig(name="t2", embedding_dim=4, num_embeddings=200, feature_names=["f2", "f3"]),
]
BATCH, STEPS, MORE = 32, 8, 3

def kjt(step):
    rng = np.random.default_rng(1000 * step + rank)
    lengths = np.stack([np.ones(BATCH, dtype=np.int64), rng.integers(0, 4, BATCH),
                        np.ones(BATCH, dtype=np.int64), rng.integers(0, 3, BATCH)])
    ids = [rng.zipf(1.3, size=l.sum()) % n * 7919 for l, n in zip(lengths, (400, 300, 200, 200))]
    return KeyedJaggedTensor(keys=["f0", "f1", "f2", "f3"], values=torch.from_numpy(np.concatenate(ids)),
                             lengths=torch.from_numpy(lengths.reshape(-1)))

loss_weights = torch.randn(24, generator=torch.Generator().manual_seed(0))

def make(sharding, sync, label, device_rows):
    return TieredEmbeddingBagCollection(
        TABLES, optimizer=SparseAdam(lr=0.05), sharding=sharding, sparse_sync=sync,
        sync_every=1 if sync == "k_step" else None,
        storage=StorageConfig(device_rows=device_rows, host_rows=0, ssd_dir=os.path.join(out_dir, "ssd_" + label)))

def train(ebc, steps):
    for step in steps:
        (ebc(kjt(step)).values() @ loss_weights).mean().backward()

ids = {t.name: torch.arange(0, t.num_embeddings * 7919, 7919) for t in TABLES}
result = {}
for label, sharding, sync, reshard in (("row_wise", "row_wise", "step", "table_wise"),
                                        ("table_wise", "table_wise", "step", "row_wise"),
                                        ("k_step", "row_wise", "k_step", "table_wise"),
                                        # t0 and t1 share a table group (dim 8): rank 1 leaves t1 out
                                        ("replicas", {"t0": "row_wise", "t1": "data_parallel", "t2": "data_parallel"},
                                         "step", "row_wise")):
    ebc = make(sharding, sync, label, 80)
    train(ebc, range(STEPS))
    snap = os.path.join(out_dir, "snap_" + label)
    manifest = ebc.save_tables(snap)
    saved = {n: ebc.rows(n, i) for n, i in ids.items()}  # collective
    other = make(reshard, sync, label + "_other", 150)
    other.load_tables(snap)
    loaded = {n: other.rows(n, i) for n, i in ids.items()}
    train(ebc, range(STEPS, STEPS + MORE))
    train(other, range(STEPS, STEPS + MORE))
    result[label] = {"files": [f.name for f in manifest.files], "world": manifest.world_size,
                     "sharding": manifest.sharding, "steps": manifest.steps,
                     "loaded_equal": all(torch.equal(saved[n], loaded[n]) for n in ids),
                     "trained_on_gap": max(float((ebc.rows(n, i) - other.rows(n, i)).abs().max())
                                           for n, i in ids.items())}
    if rank == 0:
        torch.save(saved, os.path.join(out_dir, f"rows_{label}.pt"))

# A snapshot one process saved loads into both ranks, each keeping the rows it owns.
for sharding in ("row_wise", "table_wise", "data_parallel"):
    two = make(sharding, "step", "from_one_" + sharding, 150)
    two.load_tables(os.path.join(out_dir, "snap_one"))
    expected = torch.load(os.path.join(out_dir, "rows_one.pt"))
    result["from_one_" + sharding] = all(torch.equal(two.rows(n, i), expected[n]) for n, i in ids.items())
    # The optimizer state (Adam's moments, in each row) and step counts came along too.
    two.checkpoint_to_snapshots(None)
    state = two.get_extra_state()["tables"]  # collective: every rank's rows
    want = torch.load(os.path.join(out_dir, "state_one.pt"))
    result["from_one_state_" + sharding] = all(
        torch.equal(state[n]["ids"].sort().values, want[n]["ids"].sort().values)
        and torch.equal(state[n]["rows"][state[n]["ids"].argsort()], want[n]["rows"][want[n]["ids"].argsort()])
        and state[n]["steps"] == want[n]["steps"] for n in want)

# A save that fails on one rank (a file size limit: a full disk to the writer) fails on
# both, names the file, and leaves no manifest.
if rank == 1:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))
try:
    ebc.save_tables(os.path.join(out_dir, "snap_full"))
    result["full"] = "saved"
except Exception as e:
    result["full"] = f"{type(e).__name__}: {e}"
print("RESULT " + json.dumps(result), flush=True)
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_two_ranks_save_their_own_rows_and_the_snapshot_loads_anywhere(tmp_path, run_ranks):
    # One process trains and saves first; the ranks load its snapshot too.
    one = TieredEmbeddingBagCollection(TABLES, optimizer=SparseAdam(lr=0.05),
                                       storage=StorageConfig(device_rows=50, host_rows=0, ssd_dir=str(tmp_path / "one")))
    gen = torch.Generator().manual_seed(7)
    for _ in range(5):
        values = torch.randint(0, 100, (96,), generator=gen) * 7919
        kjt = KeyedJaggedTensor.from_lengths_sync(keys=["f0", "f1", "f2", "f3"], values=values,
                                                  lengths=torch.ones(96, dtype=torch.int32))
        one(kjt).values().sum().backward()
    one.save_tables(tmp_path / "snap_one")
    torch.save({t.name: one.rows(t.name, torch.arange(0, t.num_embeddings * 7919, 7919)) for t in TABLES},
               tmp_path / "rows_one.pt")
    torch.save(one._built().export(), tmp_path / "state_one.pt")  # rows with their Adam moments, step counts
    results = run_ranks(RANK_SCRIPT, [str(tmp_path), "{port}"], world=2, ddp_env=False)
    assert all(r["from_one_row_wise"] and r["from_one_table_wise"] and r["from_one_data_parallel"] for r in results)
    assert all(r[f"from_one_state_{k}"] for r in results for k in ("row_wise", "table_wise", "data_parallel"))
    for label in ("row_wise", "table_wise", "k_step", "replicas"):
        for r in results:
            assert r[label]["loaded_equal"], label  # resharded on load, bit for bit
            assert r[label]["trained_on_gap"] < 1e-5, label  # with its Adam state
            assert r[label]["world"] == 2 and r[label]["steps"] == {"t0": 8, "t1": 8, "t2": 8}
        manifest = SnapshotManifest.read(tmp_path / f"snap_{label}")
        # Rank 0 alone writes the data-parallel replicas.
        assert {f.name.split("-")[0] for f in manifest.files} == (
            {"rank0", "rank1", "replicas"} if label == "replicas" else {"rank0", "rank1"})
        # Each rank wrote only its own rows: no row is in two files.
        keys = []
        for f in manifest.files:
            for names, tables, ids, _ in read_snapshot_file(tmp_path / f"snap_{label}", f):
                keys += [(names[t], i) for t, i in zip(tables.tolist(), ids.tolist())]
        assert len(keys) == len(set(keys)) > 100
        kinds = {v["kind"] for v in manifest.sharding.values()}
        assert kinds == ({"row_wise", "data_parallel"} if label == "replicas"
                         else {"table_wise" if label == "table_wise" else "row_wise"})
        # One process loads what two ranks saved.
        one = TieredEmbeddingBagCollection(TABLES, optimizer=SparseAdam(lr=0.05),
                                           storage=StorageConfig(device_rows=50, host_rows=0,
                                                                 ssd_dir=str(tmp_path / f"one_{label}")))
        one.load_tables(tmp_path / f"snap_{label}")
        saved = torch.load(tmp_path / f"rows_{label}.pt")
        for t in TABLES:
            ids = torch.arange(0, t.num_embeddings * 7919, 7919)
            assert torch.equal(one.rows(t.name, ids), saved[t.name]), (label, t.name)
        # Every row's optimizer state and the step counts, as the ranks wrote them.
        written = {}
        for f in manifest.files:
            for names, tables, file_ids, rows in read_snapshot_file(tmp_path / f"snap_{label}", f):
                for k, (t, i) in enumerate(zip(tables.tolist(), file_ids.tolist())):
                    written[(names[t], i)] = rows[k]
        state = one._built().export()
        held = {(n, i): row for n, table in state.items() for i, row in zip(table["ids"].tolist(), table["rows"])}
        assert held.keys() == written.keys(), label
        assert all(torch.equal(held[key], written[key]) for key in written), label
        assert {n: table["steps"] for n, table in state.items()} == manifest.steps, label
    full = {r["full"] for r in results}
    assert any("snap_full/rank1-group" in f and "File too large" in f for f in full), full
    assert any("another rank failed" in f and "rank 1" in f for f in full), full
    assert not (tmp_path / "snap_full" / "manifest.json").exists()
    assert not [p for p in os.listdir(tmp_path / "snap_full") if p.endswith(".partial")]
