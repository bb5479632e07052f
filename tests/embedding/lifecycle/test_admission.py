import dataclasses
import warnings
from collections import Counter

import numpy as np
import pytest
import torch
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from ctr_lightning.embedding import Admission, Expiry, SparseAdam, StorageConfig, TieredEmbeddingBagCollection
from tests.embedding.lifecycle.id_streams import kjt, occurrences_kept, train, zipf_stream

TABLES = [
    EmbeddingBagConfig(name="t0", embedding_dim=8, num_embeddings=1000, feature_names=["f0"]),
    EmbeddingBagConfig(name="t1", embedding_dim=8, num_embeddings=1000, feature_names=["f1"]),
]
BATCH, STEPS = 32, 12


def stream(seed: int = 0) -> list[list[tuple[np.ndarray, np.ndarray]]]:
    return zipf_stream(seed, STEPS, BATCH, 1.4)


def without_unadmitted(steps, admit_after: int):
    """The stream with every occurrence before an id's admitting step removed (exact counts):
    what a collection that admits every id must see to train as the admitting one does."""
    seen = [Counter(), Counter()]

    def admitted(step, f, ids):
        seen[f].update(ids.tolist())
        return np.array([seen[f][i] >= admit_after for i in ids.tolist()], dtype=bool)

    return occurrences_kept(steps, admitted)


def collection(tmp_path, name, **kwargs) -> TieredEmbeddingBagCollection:
    # A 20-row device tier a table over an SSD tier: admitted rows leave memory and come back.
    return TieredEmbeddingBagCollection(
        TABLES, optimizer=SparseAdam(lr=0.05), seed=3,
        storage=StorageConfig(device_rows=20, host_rows=0, ssd_dir=str(tmp_path / name)), **kwargs)


@pytest.mark.parametrize("kernel", ["numba", "torch"])
def test_admit_after_trains_as_if_earlier_sightings_were_absent(tmp_path, kernel):
    steps = stream()
    admitting = collection(tmp_path, f"a_{kernel}", admission=Admission(admit_after=3), kernel=kernel)
    reference = collection(tmp_path, f"r_{kernel}", kernel=kernel)
    got = train(admitting, steps)
    want = train(reference, without_unadmitted(steps, 3))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=0, rtol=0)  # zeros pool as absent ids: bit for bit
    counts = [Counter(np.concatenate([f[t][1] for f in steps]).tolist()) for t in range(2)]
    for t, name in enumerate(("t0", "t1")):
        admitted = sorted(i for i, c in counts[t].items() if c >= 3)
        rejected = sorted(i for i, c in counts[t].items() if c < 3)
        assert len(admitted) > 5 and len(rejected) > 50  # the tail is long: most ids never get a row
        torch.testing.assert_close(admitting.rows(name, admitted), reference.rows(name, admitted), atol=0, rtol=0)
        assert not admitting.rows(name, rejected).any()  # stored nowhere: zeros
    stored = admitting.storage_stats()
    assert stored["ssd_rows"] + stored["memory_rows"] >= sum(1 for c in counts for n in c.values() if n >= 3)
    counters = admitting.tier_stats()
    assert counters["rows_admitted"] == sum(1 for c in counts for n in c.values() if n >= 3)
    assert counters["rows_rejected"] > counters["rows_admitted"]
    assert admitting.tier_stats()["ssd_hits"] > 0  # admitted rows went through the SSD tier


def without_unadmitted_halving(steps, admit_after: int, every: int):
    """As :func:`without_unadmitted`, with every count halved (rounding down) each time the
    step count passes a multiple of ``every``, before that step's sightings count; an id
    admitted keeps its row."""
    seen, halved, stored = [Counter(), Counter()], [0, 0], [set(), set()]

    def admitted(step, f, ids):
        while halved[f] < step // every:
            seen[f] = Counter({i: c // 2 for i, c in seen[f].items() if c // 2})
            halved[f] += 1
        seen[f].update(ids.tolist())
        stored[f].update(i for i in ids.tolist() if seen[f][i] >= admit_after)
        return np.array([i in stored[f] for i in ids.tolist()], dtype=bool)

    return occurrences_kept(steps, admitted)


def test_halving_the_counters_forgets_old_sightings_exactly_and_across_a_resume(tmp_path):
    steps = zipf_stream(4, 24, BATCH, 1.3)
    setting = Admission(admit_after=3, halve_every=4)
    halving = collection(tmp_path, "h", admission=setting)
    reference = collection(tmp_path, "r")
    got = train(halving, steps)
    want = train(reference, without_unadmitted_halving(steps, 3, 4))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    # Halving changes what is admitted: fewer ids than counting for ever.
    forever = collection(tmp_path, "f", admission=Admission(admit_after=3))
    train(forever, steps)
    assert halving.tier_stats()["rows_admitted"] < forever.tier_stats()["rows_admitted"] - 10
    # A resume between two halvings (step 10; the next is due at 12) and one right at one (step 12).
    in_memory = lambda: TieredEmbeddingBagCollection(TABLES, optimizer=SparseAdam(lr=0.05), seed=3, admission=setting)
    uninterrupted = train(in_memory(), steps)
    for cut in (10, 12):
        first = in_memory()
        train(first, steps[:cut])
        resumed = in_memory()
        resumed.load_state_dict(first.state_dict())
        for a, b in zip(train(resumed, steps[cut:]), uninterrupted[cut:]):
            torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_counters_age_with_a_ttl_in_steps_by_default(tmp_path):
    # halve_every unset on a table with Expiry(ttl=4): halved every 4 steps, as halve_every=4
    # (the sighting counts age as the rows do); 0 never halves, nor does a ttl in data time.
    settings = TieredEmbeddingBagCollection(
        TABLES, admission={"t0": Admission(admit_after=3), "t1": Admission(admit_after=3, halve_every=0)},
        expiry=Expiry(ttl=4))._setup.admission
    assert settings["t0"].halve_every == 4 and settings["t1"].halve_every == 0
    assert Admission(admit_after=3).aged_with(None).halve_every == 0
    data_time = TieredEmbeddingBagCollection(TABLES, admission=Admission(admit_after=3), expiry=Expiry(ttl="2h"))
    assert {s.halve_every for s in data_time._setup.admission.values()} == {0}
    steps = zipf_stream(4, 24, BATCH, 1.3)
    by_default = collection(tmp_path, "d", admission=Admission(admit_after=3), expiry=Expiry(ttl=4))
    by_hand = collection(tmp_path, "h", admission=Admission(admit_after=3, halve_every=4), expiry=Expiry(ttl=4))
    never = collection(tmp_path, "n", admission=Admission(admit_after=3, halve_every=0), expiry=Expiry(ttl=4))
    for a, b in zip(train(by_default, steps), train(by_hand, steps)):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    train(never, steps)
    assert by_default.tier_stats()["rows_admitted"] == by_hand.tier_stats()["rows_admitted"]
    assert by_default.tier_stats()["rows_admitted"] < never.tier_stats()["rows_admitted"] - 10


def test_a_save_warns_once_a_table_when_a_sketch_is_over_half_full():
    # The smallest sketch (322,560 counters in each of its 2 rows) over 400,000 distinct ids.
    small = Admission(admit_after=2, sketch_bytes=645_120, halve_every=0)
    ebc = TieredEmbeddingBagCollection(TABLES, admission=small, seed=3)
    ids = np.random.default_rng(0).integers(0, 2**62, 400_000)
    one_each = lambda n: [(np.ones(n, dtype=np.int64), ids[:n])] * 2
    ebc.train()
    ebc(kjt(one_each(10)))
    ebc.state_dict()  # few counters in use: nothing said
    fill = ebc.admission_counts()["t0"]
    assert 0 < fill["counters_used"] <= 20 and fill["counters"] == 645_120
    ebc(kjt(one_each(400_000)))
    with pytest.warns(UserWarning, match=r"table 't[01]': admission's sighting counters are \d+% in use") as said:
        ebc.state_dict()
    assert sorted(str(w.message)[7:9] for w in said) == ["t0", "t1"]
    assert ebc.admission_counts()["t0"]["counters_used"] > 645_120 // 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ebc.state_dict()  # once a table
    # Counters halved every 5 steps: over half in use inside a period warns too; once the
    # halving is due, the ids seen once are forgotten and nothing is said.
    for steps, warns in ((1, True), (6, False)):
        aging = TieredEmbeddingBagCollection(TABLES, admission=dataclasses.replace(small, halve_every=5), seed=3)
        aging.train()
        aging(kjt(one_each(400_000))).values().sum().backward()
        for _ in range(steps - 1):
            aging(kjt(one_each(1))).values().sum().backward()
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            aging.state_dict()
        assert [str(w.message)[7:9] for w in said] == (["t0", "t1"] if warns else []), steps
        if warns:
            assert "halved every 5 steps, they still fill" in str(said[0].message)


def test_mean_pooling_counts_an_unadmitted_id_as_a_zero_row():
    table = EmbeddingBagConfig(name="t0", embedding_dim=4, num_embeddings=100, feature_names=["f0"],
                               pooling=PoolingType.MEAN)
    ebc = TieredEmbeddingBagCollection([table], admission=Admission(admit_after=2), seed=1)
    plain = TieredEmbeddingBagCollection([table], seed=1)
    # Bag 0: id 5 twice (admitted at once) and id 9 once (not): the mean of (r5, r5, 0).
    features = KeyedJaggedTensor(keys=["f0"], values=torch.tensor([5, 5, 9]), lengths=torch.tensor([3]))
    with torch.no_grad():
        got = ebc(features).values()
    # Evaluation admits nothing, and reads zeros for ids stored nowhere.
    assert not got.any()
    got = ebc(features).values()
    expected = 2 * plain.rows("t0", [5]) / 3
    torch.testing.assert_close(got, expected, atol=1e-7, rtol=0)
    got.sum().backward()
    assert not ebc.rows("t0", [9]).any()
    assert ebc.storage_stats()["memory_rows"] == 1


def test_probability_admission_is_a_pure_function_of_the_stream(tmp_path):
    steps = stream(seed=5)
    runs = [collection(tmp_path, f"p{i}", admission=Admission(probability=0.3, seed=7)) for i in range(2)]
    outputs = [train(ebc, steps) for ebc in runs]
    for a, b in zip(*outputs):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    counters = runs[0].tier_stats()
    share = counters["rows_admitted"] / (counters["rows_admitted"] + counters["rows_rejected"])
    assert 0.2 < share < 0.45  # a third of first sightings, and more of the repeated ones
    other_seed = collection(tmp_path, "p_other", admission=Admission(probability=0.3, seed=8))
    train(other_seed, steps)
    assert other_seed.tier_stats()["rows_admitted"] != counters["rows_admitted"]


def test_a_resume_from_a_state_dict_admits_what_an_uninterrupted_run_does():
    steps = stream(seed=2)
    uninterrupted = TieredEmbeddingBagCollection(TABLES, admission=Admission(admit_after=2), seed=3)
    want = train(uninterrupted, steps)
    first = TieredEmbeddingBagCollection(TABLES, admission=Admission(admit_after=2), seed=3)
    train(first, steps[:5])
    state = first.state_dict()
    assert state["_extra_state"]["sightings"]["t0"].dtype == torch.uint8
    resumed = TieredEmbeddingBagCollection(TABLES, admission=Admission(admit_after=2), seed=3)
    resumed.load_state_dict(state)
    got = train(resumed, steps[5:])
    for a, b in zip(got, want[5:]):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    # Without the counters, ids seen once before the cut would be admitted later: it differs.
    state["_extra_state"].pop("sightings")
    forgetful = TieredEmbeddingBagCollection(TABLES, admission=Admission(admit_after=2), seed=3)
    forgetful.load_state_dict(state)
    assert any(not torch.equal(a, b) for a, b in zip(train(forgetful, steps[5:]), want[5:]))


def test_bad_admission_settings_name_the_setting_or_table():
    with pytest.raises(ValueError, match="admit_after must be in"):
        Admission(admit_after=0)
    with pytest.raises(ValueError, match="probability must be in"):
        Admission(probability=0.0)
    with pytest.raises(ValueError, match="two modes"):
        Admission(admit_after=2, probability=0.5)
    with pytest.raises(ValueError, match="halve_every ages the sighting counters of admit_after > 1"):
        Admission(admit_after=1, halve_every=10)
    with pytest.raises(ValueError, match="halve_every=-1"):
        Admission(admit_after=2, halve_every=-1)
    with pytest.raises(ValueError, match="halve_every=2.5"):
        Admission(admit_after=2, halve_every=2.5)
    with pytest.raises(ValueError, match="table 't0'.*sketch_bytes 1000 is below"):
        TieredEmbeddingBagCollection(TABLES, admission={"t0": Admission(admit_after=2, sketch_bytes=1000)})
    with pytest.raises(ValueError, match=r"unknown tables \['nope'\]"):
        TieredEmbeddingBagCollection(TABLES, admission={"nope": Admission(admit_after=2)})
