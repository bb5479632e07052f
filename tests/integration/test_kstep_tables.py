import json

import pytest
import torch
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType

from ctr_lightning.embedding import SparseAdam, TieredEmbeddingBagCollection

TABLES = [
    EmbeddingBagConfig(name="t0", embedding_dim=8, num_embeddings=400, feature_names=["f0"]),
    EmbeddingBagConfig(name="t1", embedding_dim=4, num_embeddings=300, feature_names=["f1"], pooling=PoolingType.MEAN),
]
COMMON = r"""
import numpy as np, torch
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
TABLES = [
    EmbeddingBagConfig(name="t0", embedding_dim=8, num_embeddings=400, feature_names=["f0"]),
    EmbeddingBagConfig(name="t1", embedding_dim=4, num_embeddings=300, feature_names=["f1"], pooling=PoolingType.MEAN),
]
def batch(seed, quiet=False):
    rng = np.random.default_rng(seed)
    lengths = np.stack([np.ones(32, dtype=np.int64), rng.integers(0, 4, 32)])
    if quiet:  # no id of t1 in this batch
        lengths[1] = 0
    ids = np.concatenate([rng.zipf(1.3, size=int(l.sum())) % 300 for l in lengths])
    return KeyedJaggedTensor(keys=["f0", "f1"], values=torch.from_numpy(ids), lengths=torch.from_numpy(lengths.reshape(-1)))
WEIGHTS = torch.randn(12, generator=torch.Generator().manual_seed(0))
QUIET = (2, 3)  # with different batches, rank 1 touches no row of t1 in these steps
EVALUATED = 999  # the seed of the batch evaluated between syncs
def step(ebc, kjt):
    (ebc(kjt).values() @ WEIGHTS).mean().backward()
"""
exec(COMMON)

# Runs one after another in the same 2 processes (each a fresh collection on SSD files of its
# own), one per entry of the JSON list it is given, each saved as ``<label>.pt``; then a run
# resumed between merges, whose merges each rank returns.
RANK_SCRIPT = COMMON + r"""
import os, sys, json
import torch.distributed as dist
from ctr_lightning.embedding import SparseAdam, StorageConfig, TieredEmbeddingBagCollection
rank, port, out_dir, runs = int(sys.argv[1]), sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)

# state_dtype: exact, unless a test asks otherwise; evaluate_after: an evaluation forward after this many steps.
def fit(label, same, k, steps, state_dtype="float32", evaluate_after=-1):
    ebc = TieredEmbeddingBagCollection(
        TABLES, optimizer=SparseAdam(lr=0.05), sparse_sync="k_step", sync_every=k,
        sharding={"t0": "row_wise", "t1": "table_wise"},
        storage=StorageConfig(device_rows=40, host_rows=0, ssd_dir=os.path.join(out_dir, f"ssd_{label}")),
        sync_state_dtype=state_dtype)
    for s in range(steps):
        step(ebc, batch(s) if same else batch(100 * rank + s, quiet=rank == 1 and s in QUIET))
        if s + 1 == evaluate_after:
            ebc.eval()
            with torch.inference_mode():  # as Lightning validates (but on gloo); the next steps still train
                torch.save(ebc(batch(EVALUATED)).values(), os.path.join(out_dir, f"{label}_eval{rank}.pt"))
            ebc.train()
    ebc.checkpoint_to_snapshots(None)  # whole rows in the state dict, asked for
    state = ebc.get_extra_state()  # collective: merges what is pending, gathers the shards
    if rank == 0:
        torch.save({"state": state, "bytes": ebc.comm_bytes(), "stats": ebc.tier_stats()},
                   os.path.join(out_dir, f"{label}.pt"))

def resumed_merges():
    # Merges every 4 steps after 4 synchronous ones, as a KStepAdamStrategy(k=4, warmup_steps=4) sets.
    def collection():
        ebc = TieredEmbeddingBagCollection(TABLES, optimizer=SparseAdam(lr=0.05), sparse_sync="k_step")
        ebc.follow_merge_schedule(4, warmup_steps=4)
        return ebc
    ebc = collection()
    for s in range(9):
        step(ebc, batch(100 * rank + s))
    resumed = collection()
    ebc.checkpoint_to_snapshots(None)
    resumed.set_extra_state(ebc.get_extra_state())  # a checkpoint after step 9, between merges
    for s in range(9, 11):  # steps 10 and 11: local steps 6 and 7 of the k-step phase, no merge due
        step(resumed, batch(100 * rank + s))
    return resumed._built().merges

for run in runs:
    fit(**run)
print("RESULT " + json.dumps({"resumed_merges": resumed_merges()}), flush=True)
import torch.distributed as _dist
if _dist.is_initialized():  # an orderly shutdown: gloo threads left to exit-time destructors can abort
    _dist.destroy_process_group()
"""

# The runs the tests below check, by label: in one launch of 2 processes, which they share.
RUNS = [
    dict(label="same", same=True, k=3, steps=9),
    # Intervals of 2 steps; in the second, rank 1 touches no row of t1; an evaluation after step 7.
    dict(label="different", same=False, k=2, steps=9, evaluate_after=7),
    # Optimizer state on the wire exact, and in bfloat16.
    dict(label="exact", same=False, k=2, steps=7),
    dict(label="rounded", same=False, k=2, steps=7, state_dtype="bfloat16"),
]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, run_ranks_in_fixture):
    """The directory of every run's files (:data:`RUNS`), and the ranks' results."""
    out = tmp_path_factory.mktemp("kstep_tables")
    return out, run_ranks_in_fixture(RANK_SCRIPT, ["{port}", str(out), json.dumps(RUNS)], world=2, ddp_env=False)


def by_id(table_state):
    order = torch.argsort(table_state["ids"])
    return table_state["ids"][order], table_state["rows"][order]


@pytest.mark.slow
def test_same_batches_on_both_ranks_equal_one_process(two_ranks):
    got = torch.load(two_ranks[0] / "same.pt", weights_only=False)
    ref = TieredEmbeddingBagCollection(TABLES, optimizer=SparseAdam(lr=0.05))
    for s in range(9):
        step(ref, batch(s))
    want = ref.get_extra_state()["tables"]
    for name in ("t0", "t1"):
        (wi, wr), (gi, gr) = by_id(want[name]), by_id(got["state"]["tables"][name])
        assert torch.equal(wi, gi)
        torch.testing.assert_close(gr, wr, atol=1e-5, rtol=0)  # weights and Adam state
        assert got["state"]["tables"][name]["steps"] == 9
    assert got["stats"]["ssd_hits"] > 0 and got["bytes"] > 0


@pytest.mark.slow
def test_owners_average_the_deltas_of_the_ranks_that_touched_a_row(two_ranks):
    # Intervals of 2 steps; in the second, rank 1 touches no row of t1 (and still takes part
    # in its sync). The 7th step is merged by an evaluation forward after it, between syncs,
    # which does not move the schedule (the 8th step still ends an interval); the 9th is
    # merged by the checkpoint taken after it.
    (run,) = [r for r in RUNS if r["label"] == "different"]
    assert (run["k"], run["steps"], run["evaluate_after"]) == (2, 9, 7)  # as the reference below is built
    evaluated = run["evaluate_after"]
    got = torch.load(two_ranks[0] / "different.pt", weights_only=False)["state"]["tables"]
    scores = [torch.load(two_ranks[0] / f"different_eval{rank}.pt") for rank in range(2)]
    # Reference: each interval, two single processes start from the merged state and train
    # k steps on their rank's batches; a row becomes base + mean delta of those that touched it.
    fresh = TieredEmbeddingBagCollection(TABLES, optimizer=SparseAdam(lr=0.05))
    width = {"t0": 24, "t1": 12}
    state = {t.name: {"ids": torch.empty(0, dtype=torch.int64), "rows": torch.empty(0, width[t.name]), "steps": 0}
             for t in TABLES}
    bounds = [0, 2, 4, 6, 7, 8, 9]
    for first, last in zip(bounds[:-1], bounds[1:]):
        results, touched = [], []
        for rank in range(2):
            ebc = TieredEmbeddingBagCollection(TABLES, optimizer=SparseAdam(lr=0.05))
            ebc.set_extra_state({"tables": state})
            seen = {"t0": set(), "t1": set()}
            for s in range(first, last):
                kjt = batch(100 * rank + s, quiet=rank == 1 and s in QUIET)
                for f, t in (("f0", "t0"), ("f1", "t1")):
                    seen[t] |= set(kjt[f].values().tolist())
                step(ebc, kjt)
            ebc.checkpoint_to_snapshots(None)
            results.append(ebc.get_extra_state()["tables"])
            touched.append(seen)
        new_state = {}
        for t in TABLES:
            name, dim = t.name, t.embedding_dim
            ids = sorted(touched[0][name] | touched[1][name] | set(state[name]["ids"].tolist()))
            ids_t = torch.tensor(ids, dtype=torch.int64)
            base = torch.zeros(len(ids), width[name])
            base[:, :dim] = fresh.rows(name, ids_t)
            pos = {int(i): n for n, i in enumerate(state[name]["ids"])}
            for n, i in enumerate(ids):
                if i in pos:
                    base[n] = state[name]["rows"][pos[i]]
            total, count = torch.zeros_like(base), torch.zeros(len(ids), 1)
            for rank in range(2):
                where = {int(i): n for n, i in enumerate(results[rank][name]["ids"])}
                for n, i in enumerate(ids):
                    if i in touched[rank][name]:
                        total[n] += results[rank][name]["rows"][where[i]] - base[n]
                        count[n] += 1
            new_state[name] = {"ids": ids_t, "rows": base + total / count.clamp(min=1),
                               "steps": last}
        state = new_state
        if last == evaluated:  # both ranks evaluated the merged rows, as one process holding them does
            ebc = TieredEmbeddingBagCollection(TABLES, optimizer=SparseAdam(lr=0.05))
            ebc.set_extra_state({"tables": state})
            ebc.eval()
            with torch.no_grad():
                want = ebc(batch(EVALUATED)).values()
            torch.testing.assert_close(scores[0], want, atol=1e-5, rtol=0)
            torch.testing.assert_close(scores[1], want, atol=1e-5, rtol=0)
    for t in TABLES:
        (wi, wr), (gi, gr) = by_id(state[t.name]), by_id(got[t.name])
        assert torch.equal(wi, gi) and len(gi) > 50  # stored rows are exactly the trained ones
        torch.testing.assert_close(gr, wr, atol=1e-5, rtol=0)


@pytest.mark.slow
def test_a_resumed_run_keeps_the_tables_merge_schedule(two_ranks):
    # Restarting the schedule at step 0 would run the warm-up again: step 10 synchronous,
    # so merged at step 11.
    assert [r["resumed_merges"] for r in two_ranks[1]] == [0, 0]


def test_bad_sparse_sync_arguments():
    with pytest.raises(ValueError, match="sparse_sync must be 'step' or 'k_step'"):
        TieredEmbeddingBagCollection(TABLES, sparse_sync="async")
    with pytest.raises(ValueError, match="sync_every must be >= 1"):
        TieredEmbeddingBagCollection(TABLES, sparse_sync="k_step", sync_every=0)


@pytest.mark.slow
def test_optimizer_state_in_bfloat16_on_the_wire_stays_near_the_exact_rule_for_fewer_bytes(two_ranks):
    exact = torch.load(two_ranks[0] / "exact.pt", weights_only=False)
    rounded = torch.load(two_ranks[0] / "rounded.pt", weights_only=False)
    for name, dim in (("t0", 8), ("t1", 4)):
        (ei, er), (ri, rr) = by_id(exact["state"]["tables"][name]), by_id(rounded["state"]["tables"][name])
        assert torch.equal(ei, ri)
        torch.testing.assert_close(rr[:, :dim], er[:, :dim], atol=2e-3, rtol=0)  # weights
        torch.testing.assert_close(rr[:, dim:], er[:, dim:], atol=1e-4, rtol=2e-2)  # Adam's moments, bf16-rounded
        assert not torch.equal(rr, er)
    # Adam rows are dim + 2 dim floats; on the wire dim + dim: pulls and pushes take 2/3 of the bytes, keys aside.
    assert rounded["bytes"] < 0.8 * exact["bytes"], (rounded["bytes"], exact["bytes"])
