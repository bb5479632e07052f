import numpy as np
import pytest
import torch
from torchrec.modules.embedding_configs import EmbeddingBagConfig

from ctr_lightning.embedding import Admission, Expiry, SparseAdam, StorageConfig, TieredEmbeddingBagCollection
from tests.embedding.lifecycle.id_streams import kjt, occurrences_kept, train, zipf_stream

TABLES = [
    EmbeddingBagConfig(name="t0", embedding_dim=8, num_embeddings=1000, feature_names=["f0"]),
    EmbeddingBagConfig(name="t1", embedding_dim=8, num_embeddings=1000, feature_names=["f1"]),
]
BATCH, STEPS = 16, 24


def stream(seed: int = 0, steps: int = STEPS) -> list[list[tuple[np.ndarray, np.ndarray]]]:
    return zipf_stream(seed, steps, BATCH, 1.3)


def lives(steps, ttl: int | None = None, max_rows: int | None = None, times=None, ttl_seconds=None):
    """What expiry must do, computed apart from the library: per table, each id's last
    lookup step and the step its current life began, and the floor after the last step.
    With ``times`` (each step's event time) and ``ttl_seconds``: the ttl in data time."""
    last = [{}, {}]
    began = [{}, {}]
    floor = [0, 0]
    newest = [max(times[: k + 1]) for k in range(len(times))] if times is not None else None
    for clock, features in enumerate(steps):
        for t, (_, ids) in enumerate(features):
            for i in np.unique(ids).tolist():
                if last[t].get(i, -1) < floor[t]:
                    began[t][i] = clock
                last[t][i] = clock
            new_floor = floor[t]
            if ttl is not None:
                new_floor = max(new_floor, clock + 1 - ttl)
            if ttl_seconds is not None:
                while newest[new_floor] < newest[clock] - ttl_seconds:
                    new_floor += 1
            if max_rows is not None:
                while sum(1 for s in last[t].values() if s >= new_floor) > max_rows:
                    new_floor += 1
            floor[t] = new_floor
    live = [{i: b for i, b in began[t].items() if last[t][i] >= floor[t]} for t in range(2)]
    return live, [{i for i, s in last[t].items() if s < floor[t]} for t in range(2)]


def from_life_start(steps, live):
    """The stream with every occurrence of a live id before its current life removed, and
    ids gone dropped: what a collection that keeps every row must see to hold the live rows
    as the expiring one does (the loss below is linear: a row's updates are its own)."""
    return occurrences_kept(steps, lambda step, t, ids: np.array(
        [i in live[t] and step >= live[t][i] for i in ids.tolist()], dtype=bool))


def collection(tmp_path, name, **kwargs) -> TieredEmbeddingBagCollection:
    # A 30-row device tier a table over an SSD tier: rows leave memory, expire there, come back.
    return TieredEmbeddingBagCollection(
        TABLES, optimizer=SparseAdam(lr=0.05), seed=3,
        storage=StorageConfig(device_rows=30, host_rows=0, ssd_dir=str(tmp_path / name),
                              ssd_segment_bytes=4096), **kwargs)


def check_rows(ebc, reference, live, gone) -> None:
    fresh = TieredEmbeddingBagCollection(TABLES, seed=3)
    for t, name in enumerate(("t0", "t1")):
        ids = sorted(live[t])
        torch.testing.assert_close(ebc.rows(name, ids), reference.rows(name, ids), atol=0, rtol=0)
        dead = sorted(gone[t])
        assert len(dead) > 3
        torch.testing.assert_close(ebc.rows(name, dead), fresh.rows(name, dead), atol=0, rtol=0)
        assert ebc.expiry_counts()[name]["rows"] == len(ids)


@pytest.mark.parametrize("kernel", ["numba", "torch"])
def test_ttl_keeps_the_rows_looked_up_in_the_window_trained_from_their_return(tmp_path, kernel):
    steps = stream()
    ebc = collection(tmp_path, f"e_{kernel}", expiry=Expiry(ttl=3), kernel=kernel)
    train(ebc, steps)
    live, gone = lives(steps, ttl=3)
    reference = collection(tmp_path, f"r_{kernel}", kernel=kernel)
    train(reference, from_life_start(steps, live))
    check_rows(ebc, reference, live, gone)
    restarted = sum(1 for t in range(2) for i, b in live[t].items() if b > 0 and i in {
        x for f in steps[: b] for x in f[t][1].tolist()})
    assert restarted > 3  # ids that expired and came back: they start over
    assert ebc.tier_stats()["rows_expired"] > 10 and ebc.tier_stats()["ssd_hits"] > 0


def test_a_ttl_in_data_time_keeps_the_rows_looked_up_within_it_of_the_newest_event(tmp_path):
    """Event times jump, stand still and go back (late data): a row is gone once the newest
    event time is more than the ttl past the newest one as of its last lookup."""
    steps = stream(seed=4, steps=30)
    rng = np.random.default_rng(4)
    times = (1_796_000_000 + np.cumsum(rng.choice([0, 600, 1800, 3600, 7200], size=30))
             - rng.choice([0, 0, 0, 5400], size=30)).tolist()
    ebc = collection(tmp_path, "e", expiry=Expiry(ttl="2h"))
    train(ebc, steps, times)
    live, gone = lives(steps, times=times, ttl_seconds=7200)
    reference = collection(tmp_path, "r")
    train(reference, from_life_start(steps, live))
    check_rows(ebc, reference, live, gone)
    assert ebc.tier_stats()["rows_expired"] > 10
    # A resume from the state dict goes on exactly as the uninterrupted run.
    first = collection(tmp_path, "a", expiry=Expiry(ttl="2h"))
    train(first, steps[:17], times[:17])
    first.checkpoint_to_snapshots(None)
    state = first.state_dict()
    resumed = collection(tmp_path, "b", expiry=Expiry(ttl="2h"))
    resumed.load_state_dict(state)
    train(resumed, steps[17:], times[17:])
    for name in ("t0", "t1"):
        ids = np.unique(np.concatenate([f[int(name[1])][1] for f in steps]))
        torch.testing.assert_close(resumed.rows(name, ids), ebc.rows(name, ids), atol=0, rtol=0)
    # Without the event times of the window, the floors after the cut would differ.
    state["_extra_state"].pop("expiry_clock")
    with pytest.raises(KeyError, match="ttl in data time but the checkpoint holds no event times"):
        collection(tmp_path, "c", expiry=Expiry(ttl="2h")).load_state_dict(state)


def test_a_ttl_in_data_time_without_event_times_names_the_table(tmp_path):
    ebc = collection(tmp_path, "n", expiry={"t1": Expiry(ttl="7d")})
    with pytest.raises(ValueError, match="table 't1': Expiry.ttl '7d' counts in data time, but this training batch "
                                         "carries no event time"):
        train(ebc, stream(steps=1))
    with pytest.raises(ValueError, match="neither a whole number of training steps nor a duration"):
        Expiry(ttl="7 weeks")
    assert Expiry(ttl="1.5h").ttl_seconds == 5400 and Expiry(ttl=3).ttl_steps == 3


def score_lives(steps, labels, max_rows, score, decay=1.0, click_weight=1.0, nonclick_weight=0.1):
    """What a score cap must keep, computed apart from the library: per table each id's
    score key (log2 of its score scaled by decay^-step, kept as float32 as a row keeps it),
    16 buckets a doubling, the floor the lowest bucket whose rows with all higher fit
    ``max_rows``; each live id's current life's first step, and the ids gone."""
    gain = -np.log2(decay)
    key, began = [{}, {}], [{}, {}]
    floor = [None, None]
    for clock, features in enumerate(steps):
        for t, (lengths, ids) in enumerate(features):
            examples = np.repeat(np.arange(len(lengths)), lengths)
            for i in np.unique(ids).tolist():
                where = ids == i
                shows = float(where.sum())
                clicks = float(labels[clock][examples[where]].sum())
                added = nonclick_weight * (shows - clicks) + click_weight * clicks if score == "show_click" else shows
                fresh = np.log2(added) + clock * gain
                alive = i in key[t] and (floor[t] is None or np.floor(key[t][i] * 16) >= floor[t])
                if not alive:
                    began[t][i] = clock
                before = np.float64(key[t][i]) if alive else -np.inf
                key[t][i] = np.float32(np.logaddexp2(before, fresh))
            live = {i: int(np.floor(np.float64(k) * 16)) for i, k in key[t].items()
                    if floor[t] is None or np.floor(np.float64(k) * 16) >= floor[t]}
            buckets = sorted(set(live.values()))
            for b in buckets:  # the lowest bucket that, with all higher, fits
                if sum(1 for v in live.values() if v >= b) <= max_rows:
                    if sum(1 for v in live.values()) > max_rows:
                        floor[t] = b if floor[t] is None else max(floor[t], b)
                    break
    live = [{i: began[t][i] for i, k in key[t].items() if floor[t] is None or np.floor(np.float64(k) * 16) >= floor[t]}
            for t in range(2)]
    gone = [{i for i in key[t] if i not in live[t]} for t in range(2)]
    return live, gone


@pytest.mark.parametrize("score,decay", [("lfu", 1.0), ("show_click", 0.97)])
def test_a_score_cap_keeps_the_highest_scoring_rows_trained_from_their_return(tmp_path, score, decay):
    steps = stream(seed=5, steps=30)
    rng = np.random.default_rng(5)
    labels = [(rng.random(BATCH) < 0.3).astype(np.float32) for _ in steps]
    expiry = Expiry(max_rows=40, score=score, decay=decay)
    ebc = collection(tmp_path, "s", expiry=expiry)
    train(ebc, steps, labels=labels)
    live, gone = score_lives(steps, labels, 40, score, decay)
    assert all(len(live[t]) <= 40 for t in range(2))
    reference = collection(tmp_path, "r")
    train(reference, from_life_start(steps, live))
    check_rows(ebc, reference, live, gone)
    assert ebc.tier_stats()["rows_evicted"] > 10 and ebc.tier_stats()["ssd_hits"] > 0
    # A resume from the state dict keeps and drops what the uninterrupted run does.
    first = collection(tmp_path, "a", expiry=expiry)
    train(first, steps[:17], labels=labels[:17])
    first.checkpoint_to_snapshots(None)
    resumed = collection(tmp_path, "b", expiry=expiry)
    resumed.load_state_dict(first.state_dict())
    train(resumed, steps[17:], labels=labels[17:])
    for t, name in enumerate(("t0", "t1")):
        ids = sorted(live[t]) + sorted(gone[t])
        torch.testing.assert_close(resumed.rows(name, ids), ebc.rows(name, ids), atol=0, rtol=0)
        assert resumed.expiry_counts()[name]["rows"] == len(live[t])


def save_checkpoint(ebc, path) -> None:
    """A checkpoint of the collection alone, as ``export_for_serving`` reads it (in-file tables)."""
    ebc.checkpoint_to_snapshots(None)
    torch.save({"state_dict": {"tables._extra_state": ebc.state_dict()["_extra_state"]},
                "hyper_parameters": {"embedding_dim": 8}}, path)


def check_served(served, ebc) -> None:
    """The reader's rows are the collection's live rows, bit for bit: the same ids, the
    weights ``rows()`` gives."""
    stored = ebc.state_dict()["_extra_state"]["tables"]
    for name in ("t0", "t1"):
        table = served.tables[name]
        assert table.ids.tolist() == sorted(stored[name]["ids"].tolist()), name
        assert len(table) == ebc.expiry_counts()[name]["rows"], name
        torch.testing.assert_close(torch.from_numpy(table.vectors), ebc.rows(name, table.ids), atol=0, rtol=0)


@pytest.mark.parametrize("score,decay", [("lfu", 0.9), ("show_click", 0.97)])
def test_a_score_table_exports_base_and_deltas_that_read_back_its_rows_across_evictions_and_a_resume(
        tmp_path, score, decay):
    import pyarrow.parquet as pq

    from ctr_lightning.serving import read_export
    from ctr_lightning.serving_export import export_for_serving

    steps = stream(seed=6, steps=30)
    rng = np.random.default_rng(6)
    labels = [(rng.random(BATCH) < 0.3).astype(np.float32) for _ in steps]
    expiry = Expiry(max_rows=40, score=score, decay=decay)
    ebc = collection(tmp_path, "e", expiry=expiry)
    # A full export at step 5, then a delta every 5 steps, each read back against the model.
    previous, tombstoned, unchanged, resume_state = None, 0, 0, None
    for step in range(5, 31, 5):
        train(ebc, steps[step - 5 : step], labels=labels[step - 5 : step])
        save_checkpoint(ebc, tmp_path / f"{step}.ckpt")
        if step == 15:
            resume_state = ebc.state_dict()
        out = tmp_path / "serving" / str(step)
        description = export_for_serving(tmp_path / f"{step}.ckpt", out, since=previous)
        assert {t["ranked_by"] for t in description["tables"].values()} == {"score_bucket"}
        served = read_export(out)
        check_served(served, ebc)
        if previous is not None:
            before = read_export(previous).tables
            for name, table in before.items():
                files = [pq.read_table(out / f["path"]) for f in description["tables"][name]["files"]]
                delta = {c: np.concatenate([f.column(c).to_numpy() for f in files]) for c in ("id", "last_seen")}
                # A delta holds the rows looked up since the export before, no other...
                assert (delta["last_seen"] >= step - 5).all()
                unchanged += int((served.tables[name].last_seen < step - 5).sum())
                # ...and the rows the reader held that are gone now (not in it) its floor deleted.
                tombstoned += int((~np.isin(table.ids, served.tables[name].ids)).sum())
                assert not np.isin(table.ids[~np.isin(table.ids, served.tables[name].ids)], delta["id"]).any()
        previous = out
    assert [p.name for p in served.chain] == ["5", "10", "15", "20", "25", "30"]
    assert sum(c["evicted"] for c in ebc.expiry_counts().values()) > 100
    assert tombstoned > 50 and unchanged > 20  # deltas smaller than full exports; rows evicted since

    # Resumed from step 15: deltas after the first run's step-15 export read back its rows.
    resumed = collection(tmp_path, "r", expiry=expiry)
    resumed.load_state_dict(resume_state)
    previous = tmp_path / "serving" / "15"
    for step in range(20, 31, 5):
        train(resumed, steps[step - 5 : step], labels=labels[step - 5 : step])
        save_checkpoint(resumed, tmp_path / f"r{step}.ckpt")
        export_for_serving(tmp_path / f"r{step}.ckpt", tmp_path / "serving" / f"r{step}", since=previous)
        previous = tmp_path / "serving" / f"r{step}"
    served = read_export(previous)
    assert [p.name for p in served.chain] == ["5", "10", "15", "r20", "r25", "r30"]
    check_served(served, resumed)
    check_served(served, ebc)


def test_a_score_delta_needs_score_buckets_in_the_export_it_follows(tmp_path):
    """An export without score buckets (format 1, or the table kept by recency then) cannot
    be followed by a delta of a table kept by a score: its rows could not be deleted."""
    import json

    from ctr_lightning.serving import read_export
    from ctr_lightning.serving_export import export_for_serving

    ebc = collection(tmp_path, "e", expiry=Expiry(max_rows=40, score="lfu"))
    train(ebc, stream(seed=7, steps=4))
    save_checkpoint(ebc, tmp_path / "model.ckpt")
    export_for_serving(tmp_path / "model.ckpt", tmp_path / "full")
    description = json.loads((tmp_path / "full" / "export.json").read_text())
    for table in description["tables"].values():  # as an export of the version before wrote it
        table["floor"] = None
        del table["ranked_by"]
    description["format"] = "ctr-lightning-export-1"
    (tmp_path / "full" / "export.json").write_text(json.dumps(description))
    assert sum(len(t) for t in read_export(tmp_path / "full").tables.values()) > 20  # still readable
    with pytest.raises(ValueError, match="table 't0' ranks its rows by score_bucket now, the export it would follow "
                                         "by nothing"):
        export_for_serving(tmp_path / "model.ckpt", tmp_path / "delta", since=tmp_path / "full")


def test_bad_score_settings_are_named(tmp_path):
    with pytest.raises(ValueError, match="give max_rows, and no ttl"):
        Expiry(score="lfu")
    with pytest.raises(ValueError, match="give max_rows, and no ttl"):
        Expiry(ttl=3, max_rows=10, score="lfu")
    with pytest.raises(ValueError, match="Expiry.decay must be in"):
        Expiry(max_rows=10, score="lfu", decay=0.0)
    ebc = collection(tmp_path, "c", expiry={"t1": Expiry(max_rows=50, score="show_click")})
    with pytest.raises(ValueError, match="table 't1': Expiry.score='show_click'.* without its labels"):
        train(ebc, stream(steps=1))


def test_max_rows_keeps_the_most_recently_looked_up_rows(tmp_path):
    steps = stream(seed=1)
    ebc = collection(tmp_path, "m", expiry=Expiry(max_rows=60))
    train(ebc, steps)
    live, gone = lives(steps, max_rows=60)
    assert all(len(live[t]) <= 60 for t in range(2))
    reference = collection(tmp_path, "r")
    train(reference, from_life_start(steps, live))
    check_rows(ebc, reference, live, gone)
    assert ebc.tier_stats()["rows_evicted"] > 10 and ebc.tier_stats()["rows_expired"] == 0


def test_the_ssd_files_of_rows_gone_are_deleted_and_the_tables_stop_growing(tmp_path):
    """Every step brings 16 ids never seen before a table: without expiry the SSD files grow with
    the steps; with a ttl the cleaning deletes the records of rows gone, whole segments of
    them at once, and the files level off."""
    fresh_ids = iter(range(10**6, 2 * 10**6))
    steps = []
    for _ in range(48):
        features = []
        for _f in range(2):
            lengths = np.ones(BATCH, dtype=np.int64)
            ids = np.array([next(fresh_ids) for _ in range(BATCH)], dtype=np.int64)
            features.append((lengths, ids))
        steps.append(features)
    sizes = {}
    weights = torch.randn(16, generator=torch.Generator().manual_seed(1))
    for name, expiry in (("kept", None), ("ttl", Expiry(ttl=2)), ("resumed", Expiry(ttl=2))):
        ebc = collection(tmp_path, name, expiry=expiry)
        sizes[name] = []
        for step, features in enumerate(steps):
            if name == "resumed" and step == 12:
                # A resume from a snapshot on the same file system takes the SSD segments by
                # hard link: they must still be deleted once their rows are gone.
                ebc.checkpoint_to_snapshots(tmp_path / "snapshots")
                state = ebc.get_extra_state()
                del ebc
                ebc = collection(tmp_path, "resumed_again", expiry=expiry)
                ebc.set_extra_state(state)
            (ebc(kjt(features)).values() @ weights).sum().backward()
            sizes[name].append(ebc.storage_stats())
        if name == "ttl":
            counters = ebc.tier_stats()
            live, _ = lives(steps, ttl=2)
            assert ebc.expiry_counts()["t0"]["rows"] == len(live[0])
    # The files are a few 4 KiB segments, and which step a segment is sealed or retired at
    # follows the writer thread's timing: compare the largest size of each half of the run.
    grown = {name: max(x["ssd_bytes"] for x in s[24:]) / max(x["ssd_bytes"] for x in s[:24])
             for name, s in sizes.items()}
    assert sizes["kept"][-1]["ssd_bytes"] > 3.0 * sizes["kept"][11]["ssd_bytes"]  # 4x the steps, 4x the rows
    assert grown["ttl"] < 1.5 and grown["resumed"] < 1.5  # within a segment of the first half
    assert sizes["ttl"][-1]["ssd_rows"] < 0.3 * sizes["kept"][-1]["ssd_rows"]
    assert counters["ssd_records_dropped"] > 1000 and counters["rows_expired"] > 1000


def test_a_resume_keeps_and_drops_what_an_uninterrupted_run_does_with_admission(tmp_path):
    steps = stream(seed=2, steps=30)
    settings = dict(expiry={"t0": Expiry(ttl=4, max_rows=12), "t1": Expiry(ttl=6)},
                    admission=Admission(admit_after=2))
    uninterrupted = collection(tmp_path, "u", **settings)
    want = train(uninterrupted, steps)
    first = collection(tmp_path, "a", **settings)
    train(first, steps[:13])
    first.checkpoint_to_snapshots(None)  # a state dict gathers the SSD rows on purpose
    state = first.state_dict()
    assert set(state["_extra_state"]["expiry"]) == {"t0", "t1"}
    resumed = collection(tmp_path, "b", **settings)
    resumed.load_state_dict(state)
    got = train(resumed, steps[13:])
    for a, b in zip(got, want[13:]):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    ids = np.unique(np.concatenate([f[0][1] for f in steps]))
    torch.testing.assert_close(resumed.rows("t0", ids), uninterrupted.rows("t0", ids), atol=0, rtol=0)
    assert resumed.expiry_counts()["t0"]["rows"] == uninterrupted.expiry_counts()["t0"]["rows"] <= 12
    counts = uninterrupted.tier_stats()
    assert counts["rows_expired"] > 0 and counts["rows_evicted"] > 0 and counts["rows_rejected"] > 0
    # Without the floors, rows gone before the cut would be back: it differs.
    state["_extra_state"].pop("expiry")
    forgetful = collection(tmp_path, "c", **settings)
    forgetful.load_state_dict(state)
    assert any(not torch.equal(a, b) for a, b in zip(train(forgetful, steps[13:]), want[13:]))


def test_bad_expiry_settings_name_the_setting_or_table():
    with pytest.raises(ValueError, match="ttl must be a whole number"):
        Expiry(ttl=0)
    with pytest.raises(ValueError, match="max_rows must be a whole number"):
        Expiry(max_rows=-1)
    with pytest.raises(ValueError, match="table 't0'.*hashed ids"):
        TieredEmbeddingBagCollection(TABLES, id_space={"t0": "bounded", "t1": "hashed"}, expiry={"t0": Expiry(ttl=5)})
    with pytest.raises(ValueError, match=r"unknown tables \['nope'\]"):
        TieredEmbeddingBagCollection(TABLES, expiry={"nope": Expiry(ttl=5)})
    ebc = TieredEmbeddingBagCollection(TABLES, expiry={"t1": Expiry(max_rows=5)})
    with pytest.raises(ValueError, match="table 't1': one training batch touched .* rows, more than Expiry.max_rows"):
        train(ebc, stream(steps=1))


def test_rows_read_ahead_and_rows_in_flight_stay_while_the_cleaning_deletes_others(tmp_path):
    """With the working-set prefetcher reading rows ahead from SSD while the cleaning
    deletes the records of rows gone, training equals fetching on demand, bit for bit, and
    every row of each batch is stored after its step (its stamp is the step's)."""
    from ctr_lightning.embedding import WorkingSetPrefetcher

    steps = stream(seed=6, steps=40)
    batches = [kjt(features) for features in steps]
    weights = torch.randn(16, generator=torch.Generator().manual_seed(1))
    untrained = TieredEmbeddingBagCollection(TABLES, seed=3)
    runs = {}
    for name, lookahead in (("demand", None), ("ahead", 4)):
        ebc = collection(tmp_path, name, expiry=Expiry(ttl=3))
        loop = batches if lookahead is None else WorkingSetPrefetcher(batches, ebc, lookahead, release_on_next=True)
        for features, batch in zip(steps, loop):
            (ebc(batch).values() @ weights).sum().backward()
            trained = np.unique(features[0][1])
            # Each row trained (no row reads its initial weights, as a row gone would).
            assert (ebc.rows("t0", trained) != untrained.rows("t0", trained)).any(dim=1).all()
        runs[name] = ebc
    ids = np.unique(np.concatenate([f[0][1] for f in steps]))
    torch.testing.assert_close(runs["ahead"].rows("t0", ids), runs["demand"].rows("t0", ids), atol=0, rtol=0)
    counters = runs["ahead"].tier_stats()
    assert counters["prefetch_hits"] > 0 and counters["ssd_records_dropped"] > 0


def ttl_after_a_resume(steps, cut, ttl, t):
    """Worked out apart from the library, for table ``t`` saved without expiry at step
    ``cut`` and resumed with ``ttl``: each id's last lookup (cut - 1 for every row saved), a
    row gone before its next lookup starting over. Returns the ids live at the end, those
    of them that never started over, the ids gone, and those gone that were saved."""
    last = {i: cut - 1 for f in steps[:cut] for i in f[t][1].tolist()}
    restarted, floor = set(), 0
    for clock in range(cut, len(steps)):
        for i in np.unique(steps[clock][t][1]).tolist():
            if i in last and last[i] < floor:
                restarted.add(i)
            last[i] = clock
        floor = clock + 1 - ttl
    live = sorted(i for i, s in last.items() if s >= floor)
    gone = sorted(i for i, s in last.items() if s < floor)
    saved = {x for f in steps[:cut] for x in f[t][1].tolist()}
    return live, [i for i in live if i not in restarted], gone, [i for i in gone if i in saved]


@pytest.mark.parametrize("saved", ["state_dict", "snapshot"])
def test_expiry_turned_on_at_a_resume_beside_a_table_saved_with_it(tmp_path, saved):
    # t0 expired rows before the save, t1 did not; resumed with a ttl on both (one group
    # now): t0 goes on as if uninterrupted, t1 as a table saved without expiry.
    steps, cut, ttl = stream(seed=5), 10, 3
    snapshots = tmp_path / "snapshots" if saved == "snapshot" else None
    before = {"t0": Expiry(ttl=ttl)}
    first = collection(tmp_path, "first", expiry=before)
    train(first, steps[:cut])
    first.checkpoint_to_snapshots(snapshots)
    state = first.state_dict()
    going_on_at_cut = first
    resumed = collection(tmp_path, "resumed", expiry=Expiry(ttl=ttl))
    resumed.load_state_dict(state)
    train(resumed, steps[cut:])
    going_on = collection(tmp_path, "going_on", expiry=before)
    train(going_on, steps)
    ids = sorted({i for f in steps for i in f[0][1].tolist()})
    torch.testing.assert_close(resumed.rows("t0", ids), going_on.rows("t0", ids), atol=0, rtol=0)
    assert resumed.expiry_counts()["t0"]["rows"] == going_on.expiry_counts()["t0"]["rows"]
    live, kept, gone, saved_gone = ttl_after_a_resume(steps, cut, ttl, 1)
    assert len(kept) > 10 and len(saved_gone) > 10 and resumed.expiry_counts()["t1"]["rows"] == len(live)
    torch.testing.assert_close(resumed.rows("t1", kept), going_on.rows("t1", kept), atol=0, rtol=0)
    fresh = TieredEmbeddingBagCollection(TABLES, seed=3)
    torch.testing.assert_close(resumed.rows("t1", gone), fresh.rows("t1", gone), atol=0, rtol=0)
    # A lower row cap on t0 beside it: t0's rows go by their saved stamps, as with t0 alone
    # (t1's rows, saved without stamps, do not make t0's look unknown).
    live_t0 = going_on_at_cut.expiry_counts()["t0"]["rows"]
    capped = {"t0": Expiry(ttl=ttl, max_rows=live_t0 // 2)}
    runs = {}
    for name, settings in (("alone", capped), ("beside", {**capped, "t1": Expiry(ttl=ttl)})):
        runs[name] = collection(tmp_path, name, expiry=settings)
        runs[name].load_state_dict(state)
        train(runs[name], steps[cut:])
    torch.testing.assert_close(runs["beside"].rows("t0", ids), runs["alone"].rows("t0", ids), atol=0, rtol=0)
    assert runs["beside"].expiry_counts()["t0"]["evicted"] > 0
    # A ttl in data time: the checkpoint's event times are t0's alone; refused, naming t1.
    hours = [1_796_000_000 + 3600 * k for k in range(len(steps))]
    timed = collection(tmp_path, "timed", expiry={"t0": Expiry(ttl="2h")})
    train(timed, steps[:cut], hours[:cut])
    timed.checkpoint_to_snapshots(snapshots)
    widened = collection(tmp_path, "widened", expiry=Expiry(ttl="2h"))
    with pytest.raises(KeyError, match="table 't1' has a ttl in data time but the checkpoint holds no event times"):
        widened.load_state_dict(timed.state_dict())
        train(widened, steps[cut : cut + 1], hours[cut : cut + 1])


@pytest.mark.parametrize("saved", ["state_dict", "snapshot", "empty_floors"])
def test_a_checkpoint_saved_without_expiry_resumes_with_it(tmp_path, saved):
    """A run that kept every row turns expiry on at a resume (its disk fills): the rows it
    saved count as looked up at its last step, so a ttl runs from the resume; they go
    unless looked up again, and those looked up train on as in the run that kept them.
    ``empty_floors``: what tiers planned under storage auto saved before 8a89ffe, which
    dropped the expiry setting (rows without expiry's words, and no floors)."""
    steps, cut, ttl = stream(seed=5), 10, 3
    snapshots = tmp_path / "snapshots" if saved == "snapshot" else None
    plain = collection(tmp_path, "plain")
    train(plain, steps[:cut])
    plain.checkpoint_to_snapshots(snapshots)
    state = plain.state_dict()
    if saved == "empty_floors":
        state["_extra_state"]["expiry"] = {}
    resumed = collection(tmp_path, "resumed", expiry=Expiry(ttl=ttl))
    resumed.load_state_dict(state)
    train(resumed, steps[cut : cut + 5])
    # Saved again and resumed once more (from a snapshot: incremental over the one saved
    # without expiry, whose unchanged rows keep their stamp): the same as going on.
    resumed.checkpoint_to_snapshots(snapshots)
    again = collection(tmp_path, "again", expiry=Expiry(ttl=ttl))
    again.load_state_dict(resumed.state_dict())
    train(again, steps[cut + 5 :])
    train(resumed, steps[cut + 5 :])
    train(plain, steps[cut:])
    fresh = TieredEmbeddingBagCollection(TABLES, seed=3)
    for t, name in enumerate(("t0", "t1")):
        live, kept, gone, saved_gone = ttl_after_a_resume(steps, cut, ttl, t)
        assert len(kept) > 10 and len(saved_gone) > 10 and resumed.expiry_counts()[name]["rows"] == len(live)
        torch.testing.assert_close(resumed.rows(name, kept), plain.rows(name, kept), atol=0, rtol=0)
        torch.testing.assert_close(resumed.rows(name, gone), fresh.rows(name, gone), atol=0, rtol=0)
        everything = sorted(set(live) | set(gone))
        torch.testing.assert_close(again.rows(name, everything), resumed.rows(name, everything), atol=0, rtol=0)
        assert again.expiry_counts()[name]["rows"] == resumed.expiry_counts()[name]["rows"]
    # Nothing tells the saved rows' last lookups apart: a row cap they exceed is refused.
    capped = collection(tmp_path, "capped", expiry={"t0": Expiry(max_rows=5)})
    capped.load_state_dict(state)
    with pytest.raises(ValueError, match="table 't0': the checkpoint was saved without expiry and holds .* rows, "
                                         "above Expiry.max_rows"):
        train(capped, steps[cut : cut + 1])  # refused at its first step, before any row goes
    # A score cap above them: each saved row starts at one lookup (LFU), and all stay.
    scored = collection(tmp_path, f"scored_{saved}", expiry={"t0": Expiry(max_rows=10**6, score="lfu")})
    scored.load_state_dict(state)
    train(scored, steps[cut:])
    ids = sorted({i for f in steps for i in f[0][1].tolist()})
    assert scored.expiry_counts()["t0"]["rows"] == len(ids)
    torch.testing.assert_close(scored.rows("t0", ids), plain.rows("t0", ids), atol=0, rtol=0)


def test_a_checkpoint_saved_without_expiry_resumes_with_a_ttl_in_data_time(tmp_path):
    """The saved rows' step takes the first event time trained after the resume."""
    steps = stream(seed=6, steps=16)
    plain = collection(tmp_path, "plain")
    train(plain, steps[:8])
    plain.checkpoint_to_snapshots(tmp_path / "snapshots")
    resumed = collection(tmp_path, "resumed", expiry=Expiry(ttl="2h"))
    resumed.load_state_dict(plain.state_dict())
    saved = {t: {i for f in steps[:8] for i in f[t][1].tolist()} for t in range(2)}
    hour = 3600
    for k, features in enumerate(steps[8:]):
        if k == 2:  # saved (incremental over the snapshot without expiry) and resumed once more
            again = collection(tmp_path, "again", expiry=Expiry(ttl="2h"))
            resumed.checkpoint_to_snapshots(tmp_path / "snapshots")
            again.load_state_dict(resumed.state_dict())
            resumed = again
        train(resumed, [features], [1_796_000_000 + hour * k])
        since = {t: {i for f in steps[8:9 + k] for i in f[t][1].tolist()} for t in range(2)}
        untouched = {t: sorted(saved[t] - since[t]) for t in range(2)}
        # Saved rows not looked up since live while the newest event time is within 2h of the first one.
        held = [resumed.expiry_counts()[n]["rows"] for n in ("t0", "t1")]
        want = [len(since[t] | (saved[t] if k <= 2 else set())) for t in range(2)]
        if k <= 2:  # all rows looked up since the resume are within 2h too (at most 2 steps of 1h)
            assert held == want, k
        else:
            assert all(len(untouched[t]) > 5 for t in range(2))
            fresh = TieredEmbeddingBagCollection(TABLES, seed=3)
            for t, name in enumerate(("t0", "t1")):
                torch.testing.assert_close(resumed.rows(name, untouched[t]), fresh.rows(name, untouched[t]),
                                           atol=0, rtol=0)
