"""IntervalRecord: a k-step interval's sightings per halving period, so the owners' sketches
count what one process's would wherever the merges fall."""

import numpy as np

from ctr_lightning.embedding.admission_config import Admission
from ctr_lightning.embedding.distributed.kstep_interval import IntervalRecord
from ctr_lightning.embedding.lifecycle.admission_gate import AdmissionGate
from ctr_lightning.embedding.lifecycle.sighting_sketch import min_sketch_bytes

IDS = 400
SETTINGS = [Admission(admit_after=3, halve_every=4, sketch_bytes=min_sketch_bytes()),
            Admission(admit_after=2, sketch_bytes=min_sketch_bytes())]


def batches(steps, rng):
    """Per step: the rows it looks up (tables 0 and 1 of one group, unique) and their occurrences."""
    out = []
    for _ in range(steps):
        tables = rng.integers(0, 2, 300)
        ids = rng.integers(0, IDS, 300)  # ids recur over the steps, some reaching admit_after within a period
        key = np.unique(tables * 1000 + ids, return_counts=True)
        out.append((key[0] // 1000, key[0] % 1000, key[1]))
    return out


def test_segments_cut_where_a_halving_table_enters_a_new_period():
    record = IntervalRecord(groups=1, halve_every=np.array([4, 0]))
    for step in range(2, 11):
        record.note_step(np.array([step, step]), None)
        record.note_sightings(0, np.array([0, 1]), np.array([7, 7]), np.array([1, 2]))
    # Steps 2-3, 4-7, 8-10: three periods of table 0's halvings.
    assert record.segment_steps().tolist() == [[2, 2], [4, 4], [8, 8]]
    got = record.sightings(0, np.array([0, 1, 0]), np.array([7, 7, 8]))
    assert got.tolist() == [[2, 4, 3], [4, 8, 6], [0, 0, 0]]
    record.clear()
    assert record.segments == 1 and record.sightings(0, np.array([0]), np.array([7])).tolist() == [[0]]


def test_sketches_fed_at_merges_anywhere_equal_one_process_fed_every_step():
    rng = np.random.default_rng(0)
    stream = batches(23, rng)
    one = AdmissionGate(["a", "b"], SETTINGS, [(1, 0), (1, 0)])
    admitted = set()  # (table, id) admitted at some step (here every id is offered at every sighting)
    for step, (tables, ids, occurrences) in enumerate(stream):
        took = one.admit(tables, ids, occurrences, np.array([step, step]))
        admitted |= set(zip(tables[took].tolist(), ids[took].tolist()))
    want = one.state(np.array([23, 23]))
    # Merges every 3 steps, and "checkpoints" merging early at steps 5 and 13 (inside a
    # period of the halvings every 4).
    for cuts in ([3, 5, 6, 9, 12, 13, 15, 18, 21], [7, 8, 16]):
        merged = AdmissionGate(["a", "b"], SETTINGS, [(1, 0), (1, 0)])
        record = IntervalRecord(groups=1, halve_every=np.array([4, 0]))
        got_admitted = set()
        for step, (tables, ids, occurrences) in enumerate(stream):
            if step in cuts:
                got_admitted |= _merge(merged, record, step)
            record.note_step(np.array([step, step]), None)
            record.note_sightings(0, tables, ids, occurrences)
        got_admitted |= _merge(merged, record, 23)
        # An id reaching admit_after in a segment is admitted even where a halving later in
        # the interval brings its count back down, as one process admits it at that step.
        assert got_admitted == admitted, cuts
        got = merged.state(np.array([23, 23]))
        assert got.keys() == want.keys()
        for name in want:
            np.testing.assert_array_equal(got[name], want[name], err_msg=f"{cuts} {name}")
    # The halvings did matter: counters that only grew hold more.
    grown = AdmissionGate(["a", "b"], [Admission(admit_after=3, sketch_bytes=min_sketch_bytes()), SETTINGS[1]],
                          [(1, 0), (1, 0)])
    for step, (tables, ids, occurrences) in enumerate(stream):
        grown.admit(tables, ids, occurrences, np.array([step, step]))
    assert grown.state(np.array([23, 23]))["a"].sum() > 2 * want["a"].sum()


def _merge(gate, record, clock):
    tables = np.repeat([0, 1], IDS)
    ids = np.tile(np.arange(IDS), 2)
    sightings = record.sightings(0, tables, ids)
    seen = sightings.sum(axis=1) > 0
    took = gate.admit(tables[seen], ids[seen], sightings[seen], np.array([clock, clock]), record.segment_steps())
    record.clear()
    return set(zip(tables[seen][took].tolist(), ids[seen][took].tolist()))
