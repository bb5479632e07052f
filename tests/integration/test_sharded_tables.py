import sys

import pytest
import torch
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType

from ctr_lightning.embedding import SparseAdam, TieredEmbeddingBagCollection

# Run by each rank, and by the single-process reference (world size 1): the same global
# batches, each rank taking its slice, with the SSD tier in use. Then the ranks train a
# small table in process groups of their own, and return what they found.
RANK_SCRIPT = r"""
import json, os, sys
import numpy as np, torch, torch.distributed as dist
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
from ctr_lightning.embedding import SparseAdam, StorageConfig, TieredEmbeddingBagCollection

rank, world, out_dir, port = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
if world > 1:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
TABLES = [
    EmbeddingBagConfig(name="t0", embedding_dim=8, num_embeddings=400, feature_names=["f0"]),
    EmbeddingBagConfig(name="t1", embedding_dim=8, num_embeddings=300, feature_names=["f1"],
                       pooling=PoolingType.MEAN),
    EmbeddingBagConfig(name="t2", embedding_dim=4, num_embeddings=200, feature_names=["f2", "f3"]),
]
GLOBAL_BATCH, STEPS = 64, 8

def global_batch(step):
    rng = np.random.default_rng(step)
    lengths = np.stack([np.ones(GLOBAL_BATCH, dtype=np.int64), rng.integers(0, 4, GLOBAL_BATCH),
                        np.ones(GLOBAL_BATCH, dtype=np.int64), rng.integers(0, 3, GLOBAL_BATCH)])
    ids = [rng.zipf(1.3, size=l.sum()) % n * 7919 for l, n in zip(lengths, (400, 300, 200, 200))]
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
    return KeyedJaggedTensor(keys=["f0", "f1", "f2", "f3"], values=torch.from_numpy(np.concatenate(values)),
                             lengths=torch.from_numpy(np.concatenate(lens)))

loss_weights = torch.randn(24, generator=torch.Generator().manual_seed(0))
KINDS = {"row_wise": "row_wise", "table_wise": "table_wise", "data_parallel": "data_parallel",
         "mixed": {"t0": "row_wise", "t1": "table_wise", "t2": "auto"},
         "replicas": {"t0": "row_wise", "t1": "data_parallel", "t2": "table_wise"}}
for label, kind in KINDS.items():
    ssd_dir = os.path.join(out_dir, f"ssd_{label}_{world}")
    ebc = TieredEmbeddingBagCollection(
        TABLES, optimizer=SparseAdam(lr=0.05), sharding=kind,
        storage={t: StorageConfig(device_rows=rows, host_rows=0, ssd_dir=ssd_dir)
                 for t, rows in (("t0", 60), ("t1", 100), ("t2", 160))})
    for step in range(STEPS):
        pooled = ebc(local_kjt(step)).values()
        (pooled @ loss_weights).mean().backward()  # a mean over the local batch, as DDP ranks take
    seen = {t.name: sorted({int(i) for s in range(STEPS) for f, v in zip(["f0", "f1", "f2", "f3"], global_batch(s)[1])
                            if f in t.feature_names for i in v}) for t in TABLES}
    rows = {name: ebc.rows(name, ids) for name, ids in seen.items()}  # collective when sharded
    ebc.checkpoint_to_snapshots(None)  # whole rows in the state dict, asked for
    state = ebc.get_extra_state()  # collective too: every rank gets all shards
    # What this rank's own tables hold, read without a collective (replicas: the whole table).
    own = {name: ebc.rows(name, torch.tensor(ids)) for name, ids in seen.items()
           if world > 1 and ebc.sharding_plan[name].kind == "data_parallel"}
    if own:
        torch.save(own, os.path.join(out_dir, f"{label}_{world}_rank{rank}.pt"))
    if rank == 0:
        torch.save({"rows": rows, "seen": seen, "state": state, "stats": ebc.tier_stats(),
                    "plan": {k: (v.kind, v.owner) for k, v in (ebc.sharding_plan or {}).items()},
                    "bytes": ebc.comm_bytes()}, os.path.join(out_dir, f"{label}_{world}.pt"))

def group_checks():
    # One table trained 3 steps in the default group, in an explicit group of both ranks,
    # and in a group of each rank alone (every rank creates every group, in one order).
    table = [EmbeddingBagConfig(name="t0", embedding_dim=4, num_embeddings=100, feature_names=["f0"])]
    both = dist.new_group([0, 1])
    alone = [dist.new_group([0]), dist.new_group([1])]
    result = {}
    for name, group in (("default", None), ("explicit", both), ("alone", alone[rank])):
        ebc = TieredEmbeddingBagCollection(table, optimizer=SparseAdam(lr=0.1), process_group=group)
        for step in range(3):
            ids = torch.tensor([step, 10 + rank, 20 + step * rank])
            kjt = KeyedJaggedTensor.from_lengths_sync(keys=["f0"], values=ids,
                                                      lengths=torch.ones(3, dtype=torch.int64))
            ebc(kjt).values().sum().backward()
        plan = ebc.sharding_plan
        # rows() is collective only when sharded; alone, each rank reads its own tables.
        rows = ebc.rows("t0", torch.arange(30)).tolist()
        result[name] = {"plan": None if plan is None else plan["t0"].kind, "bytes": ebc.comm_bytes(), "rows": rows}
    return result

print("RESULT " + json.dumps(group_checks() if world > 1 else {}), flush=True)
import torch.distributed as _dist
if _dist.is_initialized():  # an orderly shutdown: gloo threads left to exit-time destructors can abort
    _dist.destroy_process_group()
"""


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, run_ranks_in_fixture):
    """The directory the 2 ranks wrote their files to, and their results (of group_checks()).
    They join their own gloo group (no launcher variables)."""
    out = tmp_path_factory.mktemp("sharded_tables")
    return out, run_ranks_in_fixture(RANK_SCRIPT, ["2", str(out), "{port}"], world=2, ddp_env=False)


@pytest.mark.slow
def test_two_gloo_ranks_equal_one_process(two_ranks, monkeypatch):
    tmp_path = two_ranks[0]
    # The one-process reference runs here; the 2 ranks ran in processes of their own.
    monkeypatch.setattr(sys, "argv", ["rank", "0", "1", str(tmp_path), "0"])
    exec(compile(RANK_SCRIPT, "rank_script", "exec"), {"__name__": "__main__"})
    one_rows = {label: torch.load(tmp_path / f"{label}_1.pt", weights_only=False)["rows"]
                for label in ("data_parallel", "replicas")}
    for label in ("row_wise", "table_wise", "data_parallel", "mixed", "replicas"):
        one = torch.load(tmp_path / f"{label}_1.pt", weights_only=False)
        two = torch.load(tmp_path / f"{label}_2.pt", weights_only=False)
        assert one["plan"] == {}  # one process: nothing to shard
        for name, rows in one["rows"].items():
            assert len(one["seen"][name]) > 20
            torch.testing.assert_close(two["rows"][name], rows, atol=1e-5, rtol=0)
            # The gathered checkpoint holds every trained row, with its optimizer state.
            a, b = one["state"]["tables"][name], two["state"]["tables"][name]
            assert sorted(a["ids"].tolist()) == sorted(b["ids"].tolist())
            order_a, order_b = torch.argsort(a["ids"]), torch.argsort(b["ids"])
            torch.testing.assert_close(b["rows"][order_b], a["rows"][order_a], atol=1e-5, rtol=0)
            assert a["steps"] == b["steps"] == 8
        assert two["stats"]["ssd_hits"] > 0  # rows really went through the SSD tier
        assert two["bytes"] > 0
    plans = {label: torch.load(tmp_path / f"{label}_2.pt", weights_only=False)["plan"]
             for label in ("row_wise", "table_wise", "mixed", "replicas")}
    assert {k for k, _ in plans["row_wise"].values()} == {"row_wise"}
    assert {o for _, o in plans["table_wise"].values()} == {0, 1}  # tables spread over both ranks
    assert plans["mixed"]["t0"][0] == "row_wise" and plans["mixed"]["t1"][0] == "table_wise"
    assert [plans["replicas"][t][0] for t in ("t0", "t1", "t2")] == ["row_wise", "data_parallel", "table_wise"]
    # Every replica of a data-parallel table holds the rows of the global batch's training.
    for label in ("data_parallel", "replicas"):
        local = [torch.load(tmp_path / f"{label}_2_rank{r}.pt", weights_only=False) for r in (0, 1)]
        for name in ("t1",) if label == "replicas" else ("t0", "t1", "t2"):
            torch.testing.assert_close(local[0][name], local[1][name], atol=0, rtol=0)
            torch.testing.assert_close(local[0][name], one_rows[label][name], atol=1e-5, rtol=0)
    # A checkpoint of two shards loads into one process.
    two = torch.load(tmp_path / "row_wise_2.pt", weights_only=False)
    one = torch.load(tmp_path / "row_wise_1.pt", weights_only=False)
    tables = [EmbeddingBagConfig(name="t0", embedding_dim=8, num_embeddings=400, feature_names=["f0"]),
              EmbeddingBagConfig(name="t1", embedding_dim=8, num_embeddings=300, feature_names=["f1"],
                                 pooling=PoolingType.MEAN),
              EmbeddingBagConfig(name="t2", embedding_dim=4, num_embeddings=200, feature_names=["f2", "f3"])]
    restored = TieredEmbeddingBagCollection(tables, optimizer=SparseAdam(lr=0.05))
    restored.set_extra_state(two["state"])
    for name, ids in one["seen"].items():
        torch.testing.assert_close(restored.rows(name, ids), one["rows"][name], atol=1e-5, rtol=0)


@pytest.mark.slow
def test_an_explicit_process_group_decides_what_is_sharded(two_ranks):
    _, results = two_ranks
    for r in results:
        assert r["default"]["plan"] == r["explicit"]["plan"] == "row_wise"
        assert r["explicit"]["bytes"] > 0
        assert r["explicit"]["rows"] == r["default"]["rows"]  # the same sharded training
        assert r["alone"]["plan"] is None and r["alone"]["bytes"] == 0
    # Sharded, both ranks see one table; alone, each trained its own rows only.
    assert results[0]["explicit"]["rows"] == results[1]["explicit"]["rows"]
    assert results[0]["alone"]["rows"] != results[1]["alone"]["rows"]
    untouched = [i for i in range(30) if i not in (0, 1, 2, 10, 11, 20, 21, 22)]
    for i in untouched:  # rows nobody trained are the same initial values everywhere
        assert results[0]["alone"]["rows"][i] == results[1]["alone"]["rows"][i]
