"""The row lifecycle sharded over 2 gloo ranks: admission admits exactly what one process
does, and expiry with admission keeps exactly the rows one process keeps, straight through
and across a resume in the middle of the stream, and writes the same delta exports for
serving; k-step tables keep the same rows across a resume, with expiry too, and with a
row cap by LFU or show/click score, whose merged scores count every rank's lookups once.
One launch of the ranks runs every case; each test checks its own."""

import json
import sys

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from ctr_lightning.serving import read_export

# Run by each rank and by the one-process reference: the same global batches, each rank its
# slice; each case trained straight through, and cut in the middle and resumed in a new
# collection from the state dict.
# Admission (64-example batches, cut after 5 of 10 steps, counters halved every 3 steps):
# row-wise, table-wise, and on 2 ranks k-step tables (merges every 2 steps), whose owners
# admit at each merge on all ranks' sightings of the interval.
# Expiry with admission (32-example batches, cut after 7 of 14 steps): tables expire by ttl,
# t1's in data time (the newest event time over the ranks counts; t0's admission counters
# are halved every ttl by default, t1's never), and t0 has a row cap
# (row-wise: counted over every rank's shard). A table kept by an LFU score, and one by
# PaddleBox's show/click score, whose clicks (each example's label) travel with the ids.
RANK_SCRIPT = r"""
import dataclasses, os, sys
import numpy as np, torch, torch.distributed as dist
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
from ctr_lightning.embedding import Admission, Expiry, SparseAdam, StorageConfig, TieredEmbeddingBagCollection

rank, world, out_dir, port = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
if world > 1:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
TABLES = [
    EmbeddingBagConfig(name="t0", embedding_dim=8, num_embeddings=400, feature_names=["f0"]),
    EmbeddingBagConfig(name="t1", embedding_dim=8, num_embeddings=300, feature_names=["f1"],
                       pooling=PoolingType.MEAN),
]

def global_batch(step, size):
    rng = np.random.default_rng(step)
    lengths = np.stack([rng.integers(1, 3, size), rng.integers(0, 4, size)])
    ids = [(rng.zipf(1.3, size=l.sum()) * 7919) % (1 << 40) for l in lengths]
    return lengths, ids

def local_kjt(step, size, weighted=False):
    lengths, ids = global_batch(step, size)
    weights = [np.random.default_rng(30_000 + step).random(len(v), dtype=np.float32) for v in ids]
    share = size // world
    values, lens, local_weights = [], [], []
    for l, v, w in zip(lengths, ids, weights):
        offsets = np.concatenate([[0], np.cumsum(l)])
        lo, hi = rank * share, (rank + 1) * share
        values.append(v[offsets[lo]:offsets[hi]])
        local_weights.append(w[offsets[lo]:offsets[hi]])
        lens.append(l[lo:hi])
    return KeyedJaggedTensor(keys=["f0", "f1"], values=torch.from_numpy(np.concatenate(values)),
                             lengths=torch.from_numpy(np.concatenate(lens)),
                             weights=torch.from_numpy(np.concatenate(local_weights)) if weighted else None)

def local_event_time(step, size):
    # Each example's event time, late ones among them; a rank sees its slice's newest only.
    times = 1_796_000_000 + 2700 * step + np.random.default_rng(10_000 + step).integers(0, 5400, size)
    share = size // world
    return float(times[rank * share:(rank + 1) * share].max())

def local_labels(step, size):
    # Each example's click (about one in three); a rank has its slice's.
    clicks = (np.random.default_rng(20_000 + step).random(size) < 0.3).astype(np.float32)
    share = size // world
    return torch.from_numpy(clicks[rank * share:(rank + 1) * share])

loss_weights = torch.randn(16, generator=torch.Generator().manual_seed(0))

def run(make, label, steps, cut, size, at_cut=None):
    # The case trained: straight through, or cut and resumed in a new collection. Returns it,
    # the rows of every id seen and its extra state (both collective when sharded);
    # at_cut(extra state) is called at the cut.
    ebc = make(label)
    for step in range(steps):
        if step == cut and (label.endswith("resumed") or at_cut is not None):
            ebc.checkpoint_to_snapshots(None)
            state = ebc.state_dict()
            if at_cut is not None:
                at_cut(state["_extra_state"])
            if label.endswith("resumed"):
                ebc = make(label + "_again")
                ebc.load_state_dict(state)
        ebc.observe_event_time(local_event_time(step, size))  # collective where a ttl counts in data time
        ebc.observe_labels(local_labels(step, size))  # for a score that counts clicks
        pooled = ebc(local_kjt(step, size, weighted="weighted" in label)).values()
        (pooled @ loss_weights).mean().backward()
    seen = {t.name: sorted({int(i) for s in range(steps) for i in global_batch(s, size)[1][k]})
            for k, t in enumerate(TABLES)}
    rows = {name: ebc.rows(name, ids) for name, ids in seen.items()}
    ebc.checkpoint_to_snapshots(None)
    return ebc, rows, ebc.get_extra_state()

def export(extra_state, name, since=None):
    # What ctr-lightning export writes from a checkpoint of a module holding this collection.
    from ctr_lightning.serving_export import export_for_serving
    ckpt = os.path.join(out_dir, name + ".ckpt")
    torch.save({"state_dict": {"tables._extra_state": extra_state}, "hyper_parameters": {}}, ckpt)
    export_for_serving(ckpt, os.path.join(out_dir, name), since=since)

def gathered(value):
    out = [None] * world
    if world > 1:
        dist.all_gather_object(out, value)
    else:
        out = [value]
    return out

def storage(label, **kwargs):
    return StorageConfig(device_rows=kwargs.pop("device_rows"), host_rows=0,
                         ssd_dir=os.path.join(out_dir, f"ssd_{label}_{world}"), **kwargs)

def admitting(label):
    sync = dict(sparse_sync="k_step", sync_every=2) if label.startswith("kstep") else {}
    return TieredEmbeddingBagCollection(
        TABLES, optimizer=SparseAdam(lr=0.05), sharding=label.split("+")[0].replace("kstep_", ""),
        # The sighting counters halve every 3 steps (a resume at 5, between; k-step tables merge
        # every 2 steps, and the resumed run once more, at the cut, inside a halving period).
        admission=Admission(admit_after=2, halve_every=3), storage=storage(label, device_rows=40),
        **sync)

LABELS = ["row_wise", "table_wise", "row_wise+resumed"]
if world > 1:
    LABELS += ["kstep_row_wise", "kstep_row_wise+resumed", "kstep_table_wise", "kstep_table_wise+resumed"]
for label in LABELS:
    ebc, rows, state = run(admitting, label, steps=10, cut=5, size=64)
    counters = gathered(ebc.tier_stats())
    if rank == 0:
        torch.save({"rows": rows, "stored": {n: sorted(s["ids"].tolist()) for n, s in state["tables"].items()},
                    "sightings": state["sightings"], "counters": counters},
                   os.path.join(out_dir, f"admission_{label}_{world}.pt"))

def expiring(label):
    sharding = label.split("+")[0].replace("kstep_", "")
    kstep = label.startswith("kstep")
    # t0's admission counters are halved every 3 steps, its ttl (the default); t1's never.
    expiry = {"t0": Expiry(ttl=3, max_rows=15), "t1": Expiry(ttl="2h")}
    sync = dict(sparse_sync="k_step", sync_every=2) if kstep else {}
    return TieredEmbeddingBagCollection(
        TABLES, optimizer=SparseAdam(lr=0.05), sharding=sharding, admission=Admission(admit_after=2), expiry=expiry,
        storage=storage("expiry_" + label, device_rows=30, ssd_segment_bytes=4096), **sync)

def run_exporting(make, label, kind, **saved):
    # 14 steps cut at 7: a full export for serving at the cut, and a delta after it at the end;
    # rank 0 saves the rows, ids, floors and counts (and what ``saved`` computes from the state).
    base = f"export_{label}_{world}_cut"
    ebc, rows, state = run(make, label, steps=14, cut=7, size=32,
                           at_cut=lambda cut_state: export(cut_state, base) if rank == 0 else None)
    counts = gathered(ebc.expiry_counts())
    if rank == 0:
        export(state, f"export_{label}_{world}_end", since=os.path.join(out_dir, base))
        torch.save({"rows": rows, "stored": {n: sorted(s["ids"].tolist()) for n, s in state["tables"].items()},
                    "floors": state["expiry"], "counts": counts, **{k: f(state) for k, f in saved.items()}},
                   os.path.join(out_dir, f"{kind}_{label}_{world}.pt"))

for label in ["row_wise", "row_wise+resumed", "table_wise", "table_wise+resumed"]:
    run_exporting(expiring, label, "expiry")
def scoring(label):
    score = {"lfu": "lfu", "click": "show_click"}[label.split("_")[0]]
    weighted = "weighted" in label  # weighted bags pool by sum
    tables = [dataclasses.replace(t, pooling=PoolingType.SUM) for t in TABLES] if weighted else TABLES
    return TieredEmbeddingBagCollection(
        tables, optimizer=SparseAdam(lr=0.05), sharding="row_wise" if "row_wise" in label else "table_wise",
        admission=Admission(admit_after=2), is_weighted=weighted,
        expiry={"t0": Expiry(max_rows=25, score=score, decay=0.9), "t1": Expiry(ttl=2)},
        storage=storage("scored_" + label, device_rows=30, ssd_segment_bytes=4096))

def stamps(table_state):
    # The scored table's stored rows' last words, their stamp and score, in the order of their ids.
    order = torch.argsort(table_state["ids"])
    return table_state["rows"][order, -3:]

for label in ["lfu_table_wise", "lfu_table_wise+resumed", "lfu_row_wise", "lfu_row_wise+resumed",
              "click_table_wise", "click_weighted_row_wise+resumed"]:
    # A row cap by score (LFU or show/click, decaying): the owners count every rank's
    # occurrences (and clicks) of their rows; row-wise, the floor is found over every rank's
    # score buckets (SharedRowCaps). Clicks travel as the ids' weights, or, where the ids carry
    # pooling weights, on their own. A full export at the cut and a delta after it at the end.
    run_exporting(scoring, label, "scored", stamps=lambda state: stamps(state["tables"]["t0"]))
if world > 1:
    # k-step tables (merges every 2 steps; the owners raise their floors at each merge), with
    # a checkpoint at the cut as above: resumed or not, the same rows kept.
    for label in ["kstep_row_wise", "kstep_row_wise+resumed", "kstep_table_wise", "kstep_table_wise+resumed"]:
        ebc, rows, state = run(expiring, label, steps=14, cut=7, size=32, at_cut=lambda cut_state: None)
        counts = gathered(ebc.expiry_counts())
        if rank == 0:
            torch.save({"rows": rows, "stored": {n: sorted(s["ids"].tolist()) for n, s in state["tables"].items()},
                        "floors": state["expiry"], "counts": counts},
                       os.path.join(out_dir, f"expiry_{label}_{world}.pt"))
    def kstep_scoring(label):
        # A row cap by score under k-step tables: capped (max_rows=25, decaying, with
        # admission), or "count": never reached, no decay, no admission, so each row's score is
        # the count of its lookups (show/click: weighted by each example's label) on every rank.
        score = "show_click" if "click" in label else "lfu"
        counting = "count" in label
        t0 = Expiry(max_rows=10**6, score=score, decay=1.0) if counting else Expiry(max_rows=25, score=score,
                                                                                     decay=0.9)
        return TieredEmbeddingBagCollection(
            TABLES, optimizer=SparseAdam(lr=0.05), sharding="row_wise" if "row_wise" in label else "table_wise",
            admission=None if counting else Admission(admit_after=2), sparse_sync="k_step", sync_every=2,
            expiry={"t0": t0} if counting else {"t0": t0, "t1": Expiry(ttl=2)},
            storage=storage("kscored_" + label, device_rows=30, ssd_segment_bytes=4096))

    for label in ["kstep_lfu_row_wise", "kstep_lfu_row_wise+resumed", "kstep_click_table_wise",
                  "kstep_click_table_wise+resumed", "kstep_count_lfu_row_wise", "kstep_count_click_table_wise"]:
        ebc, rows, state = run(kstep_scoring, label, steps=14, cut=7, size=32, at_cut=lambda cut_state: None)
        counts = gathered(ebc.expiry_counts())
        if rank == 0:
            torch.save({"rows": rows, "stored": {n: sorted(s["ids"].tolist()) for n, s in state["tables"].items()},
                        "stamps": stamps(state["tables"]["t0"]), "floors": state["expiry"], "counts": counts},
                       os.path.join(out_dir, f"scored_{label}_{world}.pt"))
    def save_refusal(name, **settings):
        # Refused by name, on every rank alike (rank 0 keeps the message).
        try:
            TieredEmbeddingBagCollection(TABLES, sharding="row_wise", **settings)(local_kjt(0, 32))
            refusal = None
        except ValueError as e:
            refusal = str(e)
        if rank == 0:
            torch.save(refusal, os.path.join(out_dir, name))

    # A training step of a show/click table without its labels.
    save_refusal("unlabelled_refusal.pt", expiry={"t0": Expiry(max_rows=25, score="show_click")})

    def save_refused_run(name, make, load=None, steps=3):
        # Trains ``steps`` steps (after loading ``load``'s state dict, if any) without event
        # times; the refusal comes on every rank alike (rank 0 keeps the message).
        ebc = make()
        if load is not None:
            ebc.load_state_dict(load)
        try:
            for step in range(steps):
                (ebc(local_kjt(step, 32)).values() @ loss_weights).mean().backward()
            refusal = None
        except ValueError as e:
            refusal = str(e)
        if rank == 0:
            torch.save(refusal, os.path.join(out_dir, name))

    # Rows saved without expiry, more than a row-wise table's max_rows over both ranks.
    plain = TieredEmbeddingBagCollection(TABLES, sharding="row_wise")
    for step in range(4):
        (plain(local_kjt(step, 32)).values() @ loss_weights).mean().backward()
    save_refused_run("widened_cap_refusal.pt", lambda: TieredEmbeddingBagCollection(
        TABLES, sharding="row_wise", expiry={"t0": Expiry(max_rows=25)}), load=plain.state_dict(), steps=1)
    # k-step tables whose ttl counts in data time, trained without event times: refused at
    # the first merge, on every rank, before any row moves.
    save_refused_run("kstep_no_event_time_refusal.pt", lambda: TieredEmbeddingBagCollection(
        TABLES, sharding="row_wise", sparse_sync="k_step", sync_every=2, expiry={"t1": Expiry(ttl="2h")}))
print("RESULT {}", flush=True)
if dist.is_initialized():
    dist.destroy_process_group()
"""


@pytest.fixture(scope="module")
def runs(tmp_path_factory, run_ranks_in_fixture):
    """The directory of every case's results, one process's and 2 ranks'."""
    out = tmp_path_factory.mktemp("lifecycle_ranks")
    # The one-process reference runs here; the 2 ranks in processes of their own.
    argv = sys.argv
    sys.argv = ["rank", "0", "1", str(out), "0"]
    try:
        exec(compile(RANK_SCRIPT, "rank_script", "exec"), {"__name__": "__main__"})
    finally:
        sys.argv = argv
    run_ranks_in_fixture(RANK_SCRIPT, ["2", str(out), "{port}"], world=2, ddp_env=False)
    return out


def delta_rows(export):
    """Per table, the ids (ascending) and vectors a delta export's own files hold, and its floor."""
    described = json.loads((export / "export.json").read_text())
    assert "since" in described
    out = {}
    for name, table in described["tables"].items():
        parts = [pq.read_table(export / f["path"]) for f in table["files"]]
        ids = np.concatenate([p.column("id").to_numpy() for p in parts]) if parts else np.empty(0, dtype=np.int64)
        vectors = (np.concatenate([np.stack(p.column("vector").to_numpy(zero_copy_only=False)) for p in parts])
                   if parts else np.empty((0, table["dim"])))
        order = np.argsort(ids)
        out[name] = (ids[order], vectors[order], table["floor"])
    return out


def load(runs, kind, label, world):
    return torch.load(runs / f"{kind}_{label}_{world}.pt", weights_only=False)


@pytest.mark.slow
def test_two_ranks_admit_what_one_process_admits(runs):
    one = load(runs, "admission", "row_wise", 1)
    admitted = sum(c["rows_admitted"] for c in one["counters"])
    assert admitted == sum(len(ids) for ids in one["stored"].values())  # every admitted row is stored
    assert 20 < admitted and sum(c["rows_rejected"] for c in one["counters"]) > admitted
    for label in ("row_wise", "table_wise", "row_wise+resumed"):
        for world in (1, 2):
            run = load(runs, "admission", label, world)
            assert run["stored"] == one["stored"], (label, world)  # the same ids admitted, exactly
            for name, counts in one["sightings"].items():
                assert torch.equal(run["sightings"][name], counts), (label, world, name)
            for name, rows in one["rows"].items():
                torch.testing.assert_close(run["rows"][name], rows, atol=1e-5, rtol=0)
    # Row-wise, each rank admitted its own share; the counts add up to one process's.
    two = load(runs, "admission", "row_wise", 2)
    assert all(c["rows_admitted"] > 0 for c in two["counters"])
    assert sum(c["rows_admitted"] for c in two["counters"]) == admitted
    # k-step tables: straight and resumed keep the same set of rows and the same sketches.
    for kind in ("kstep_row_wise", "kstep_table_wise"):
        straight = load(runs, "admission", kind, 2)
        resumed = load(runs, "admission", kind + "+resumed", 2)
        admitted = sum(c["rows_admitted"] for c in straight["counters"])
        assert admitted == sum(len(ids) for ids in straight["stored"].values()) > 20
        assert sum(c["rows_rejected"] for c in straight["counters"]) > admitted
        assert resumed["stored"] == straight["stored"], kind
        for name, counts in straight["sightings"].items():
            assert torch.equal(resumed["sightings"][name], counts), (kind, name)


@pytest.mark.slow
def test_two_ranks_keep_the_rows_one_process_keeps(runs):
    for sharding in ("row_wise", "table_wise"):
        one = load(runs, "expiry", sharding, 1)
        gone = {n: sum(c[n]["expired"] + c[n]["evicted"] for c in one["counts"]) for n in one["stored"]}
        assert all(g > 10 for g in gone.values()), gone  # rows did go
        assert sum(len(ids) for ids in one["stored"].values()) == sum(c[n]["rows"] for c in one["counts"] for n in c)
        assert sum(c["t0"]["evicted"] for c in one["counts"]) > 0 and len(one["stored"]["t0"]) <= 15
        for label in (sharding, sharding + "+resumed"):
            for world in (1, 2):
                run = load(runs, "expiry", label, world)
                assert run["stored"] == one["stored"], (label, world)  # the same rows kept, exactly
                assert run["floors"] == one["floors"], (label, world)
                for name, rows in one["rows"].items():
                    torch.testing.assert_close(run["rows"][name], rows, atol=1e-5, rtol=0)
    # The delta exports after the cut: the same files' rows on 2 ranks, resumed or not, as in
    # one uninterrupted process; base + delta read back as the rows kept.
    for sharding in ("row_wise", "table_wise"):
        want = delta_rows(runs / f"export_{sharding}_1_end")
        one = load(runs, "expiry", sharding, 1)
        assert all(len(ids) > 5 and floor > 0 for ids, _, floor in want.values())
        for label in (sharding, sharding + "+resumed"):
            for world in (1, 2):
                got = delta_rows(runs / f"export_{label}_{world}_end")
                for name, (ids, vectors, floor) in want.items():
                    assert np.array_equal(got[name][0], ids) and got[name][2] == floor, (label, world, name)
                    np.testing.assert_allclose(got[name][1], vectors, atol=1e-5, rtol=0)
                served = read_export(runs / f"export_{label}_{world}_end")
                assert {n: t.ids.tolist() for n, t in served.tables.items()} == one["stored"], (label, world)
    # k-step tables: straight and resumed keep the same rows, and rows did go. t1's ttl counts
    # in data time: the owners take each step's newest event time over both ranks at the
    # merges, so its floor is the one of one process that saw every step's time.
    for kind in ("kstep_row_wise", "kstep_table_wise"):
        straight = load(runs, "expiry", kind, 2)
        resumed = load(runs, "expiry", kind + "+resumed", 2)
        gone = {n: sum(c[n]["expired"] + c[n]["evicted"] for c in straight["counts"] if n in c)
                for n in straight["stored"]}
        assert all(g > 10 for g in gone.values()), (kind, gone)
        stored = sum(len(ids) for ids in straight["stored"].values())
        assert stored == sum(c[n]["rows"] for c in straight["counts"] for n in c) > 20, kind
        assert resumed["stored"] == straight["stored"] and resumed["floors"] == straight["floors"], kind
        assert straight["floors"]["t1"] == load(runs, "expiry", "row_wise", 1)["floors"]["t1"] > 0, kind
        for name, rows in straight["rows"].items():
            torch.testing.assert_close(resumed["rows"][name], rows, atol=1e-5, rtol=0)
        assert sum(c["t0"]["evicted"] for c in straight["counts"] if "t0" in c) > 0
        assert len(straight["stored"]["t0"]) <= 15
    # A row cap by score, table-wise and row-wise: 2 ranks and a resume keep what one process keeps.
    one = load(runs, "scored", "lfu_table_wise", 1)
    assert sum(c["t0"]["evicted"] for c in one["counts"]) > 5 and len(one["stored"]["t0"]) <= 25
    for label in ("lfu_table_wise", "lfu_table_wise+resumed", "lfu_row_wise", "lfu_row_wise+resumed"):
        for world in (1, 2):
            run = load(runs, "scored", label, world)
            assert run["stored"] == one["stored"] and run["floors"] == one["floors"], (label, world)
            for name, rows in one["rows"].items():
                torch.testing.assert_close(run["rows"][name], rows, atol=1e-5, rtol=0)
    two = load(runs, "scored", "lfu_row_wise", 2)
    assert all(c["t0"]["evicted"] > 0 for c in two["counts"])  # each rank evicted its own share
    # Its delta exports (t0's floor on score buckets): the same on 2 ranks, resumed or not, and
    # base + delta read back as the rows kept.
    want = delta_rows(runs / "export_lfu_table_wise_1_end")
    assert len(want["t0"][0]) > 5
    at_cut = read_export(runs / "export_lfu_table_wise_1_cut").tables["t0"].ids
    assert (~np.isin(at_cut, one["stored"]["t0"])).sum() > 5  # evicted since the cut: the delta's floor deletes them
    for label in ("lfu_table_wise", "lfu_table_wise+resumed", "lfu_row_wise", "lfu_row_wise+resumed"):
        for world in (1, 2):
            got = delta_rows(runs / f"export_{label}_{world}_end")
            for name, (ids, vectors, floor) in want.items():
                assert np.array_equal(got[name][0], ids) and got[name][2] == floor, (label, world, name)
                np.testing.assert_allclose(got[name][1], vectors, atol=1e-5, rtol=0)
            served = read_export(runs / f"export_{label}_{world}_end")
            assert {n: t.ids.tolist() for n, t in served.tables.items()} == one["stored"], (label, world)
    # A show/click score: the clicks came from the labels of every rank's examples, so 2 ranks
    # keep what one process keeps, and the scores are the same floats.
    lfu, click = one, load(runs, "scored", "click_table_wise", 1)
    assert sum(c["t0"]["evicted"] for c in click["counts"]) > 5 and len(click["stored"]["t0"]) <= 25
    assert click["stored"]["t0"] != lfu["stored"]["t0"]  # the clicks decided which rows stay
    for label in ("lfu_table_wise", "lfu_row_wise+resumed", "click_table_wise", "click_weighted_row_wise+resumed"):
        one = load(runs, "scored", label, 1)
        two = load(runs, "scored", label, 2)
        assert two["stored"] == one["stored"] and two["floors"] == one["floors"], label
        for name, rows in one["rows"].items():
            torch.testing.assert_close(two["rows"][name], rows, atol=1e-5, rtol=0)
        assert torch.equal(two["stamps"], one["stamps"]), label
    refusal = torch.load(runs / "widened_cap_refusal.pt")
    assert "table 't0': the checkpoint was saved without expiry and holds" in refusal
    assert "above Expiry.max_rows (25)" in refusal
    refusal = torch.load(runs / "kstep_no_event_time_refusal.pt")
    assert "tables ['t1']: the ttl counts in data time, but training step 1 carried no event time" in refusal
    refusal = torch.load(runs / "unlabelled_refusal.pt")
    assert "tables ['t0']: Expiry(score='show_click') counts clicks, but this training batch came without" in refusal
    # Row-wise, each rank expired its own share; the counts add up to one process's.
    one = load(runs, "expiry", "row_wise", 1)
    two = load(runs, "expiry", "row_wise", 2)
    assert all(c["t0"]["expired"] > 0 for c in two["counts"])
    assert sum(c["t0"]["expired"] for c in two["counts"]) == one["counts"][0]["t0"]["expired"]


def lookups_of_t0(steps, size, click_weight=None, nonclick_weight=None):
    """Per id of t0, what its score counts over the global batches (as RANK_SCRIPT makes
    them), worked out here on its own: its occurrences, or with weights, each weighted by its
    example's click."""
    totals = {}
    for step in range(steps):
        rng = np.random.default_rng(step)
        lengths = np.stack([rng.integers(1, 3, size), rng.integers(0, 4, size)])
        ids = [(rng.zipf(1.3, size=l.sum()) * 7919) % (1 << 40) for l in lengths][0]
        clicks = (np.random.default_rng(20_000 + step).random(size) < 0.3).astype(np.float32)
        example = np.repeat(np.arange(size), lengths[0])
        for i, e in zip(ids.tolist(), example):
            add = 1.0 if click_weight is None else (click_weight if clicks[e] else nonclick_weight)
            totals[i] = totals.get(i, 0.0) + add
    return totals


@pytest.mark.slow
def test_kstep_tables_keep_rows_by_score(runs):
    # A row cap by LFU or show/click score: straight and resumed keep the same rows, with the
    # same score keys, and rows did go.
    for kind in ("kstep_lfu_row_wise", "kstep_click_table_wise"):
        straight = load(runs, "scored", kind, 2)
        resumed = load(runs, "scored", kind + "+resumed", 2)
        evicted = sum(c["t0"]["evicted"] for c in straight["counts"] if "t0" in c)
        assert evicted > 5 and 10 < len(straight["stored"]["t0"]) <= 25, kind
        # The owners' live counts per score bucket follow the merged rows.
        assert len(straight["stored"]["t0"]) == sum(c["t0"]["rows"] for c in straight["counts"] if "t0" in c), kind
        assert resumed["stored"] == straight["stored"] and resumed["floors"] == straight["floors"], kind
        assert torch.equal(resumed["stamps"], straight["stamps"]), kind
        for name, rows in straight["rows"].items():
            torch.testing.assert_close(resumed["rows"][name], rows, atol=1e-5, rtol=0)
    lfu, click = (load(runs, "scored", k, 2) for k in ("kstep_lfu_row_wise", "kstep_click_table_wise"))
    assert click["stored"]["t0"] != lfu["stored"]["t0"]
    # The merges lose no rank's lookups and count none twice: with no decay and no cap reached,
    # each row's score is the count of its lookups over both ranks and every interval.
    for kind, weights in (("kstep_count_lfu_row_wise", {}),
                          ("kstep_count_click_table_wise", {"click_weight": 1.0, "nonclick_weight": 0.1})):
        run = load(runs, "scored", kind, 2)
        want = lookups_of_t0(14, 32, **weights)
        assert run["stored"]["t0"] == sorted(want), kind
        scores = np.exp2(run["stamps"][:, -1].double().numpy())
        expected = np.array([want[i] for i in run["stored"]["t0"]])
        assert (expected > 3).sum() > 10, kind  # rows looked up in several intervals, by both ranks
        np.testing.assert_allclose(scores, expected, rtol=1e-5, err_msg=kind)
