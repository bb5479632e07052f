import pytest

from ctr_lightning.merge_schedule import MergeSchedule


def run(schedule, steps):
    """Per step: (synchronous, merge after it)."""
    return [(schedule.synchronous(), schedule.step()) for _ in range(steps)]


def test_every_k_after_the_warmup():
    plan = run(MergeSchedule(k=4, warmup_steps=2), 12)
    assert [s for s, _ in plan] == [True, True] + [False] * 10
    assert [i + 1 for i, (_, merge) in enumerate(plan) if merge] == [6, 10]


def test_k1_is_synchronous_and_never_merges():
    schedule = MergeSchedule(k=1)
    assert run(schedule, 5) == [(True, False)] * 5
    assert not schedule.pending()


def test_pending_local_steps_and_unscheduled_merges():
    schedule = MergeSchedule(k=4, warmup_steps=1)
    run(schedule, 1)
    assert not schedule.pending()  # the warm-up step kept the ranks equal
    run(schedule, 2)
    assert schedule.pending()
    schedule.note_merge()  # e.g. validation started after step 3
    assert not schedule.pending()
    # The schedule keeps its place: merges after steps 5 and 9 (1 + 4k), not 3 + 4.
    assert [i + 4 for i, (_, merge) in enumerate(run(schedule, 6)) if merge] == [5, 9]
    run(schedule, 1)
    assert schedule.pending()


def test_resume_continues_the_phase():
    schedule = MergeSchedule(k=4)
    schedule.resume(6)  # a checkpoint after step 6 holds one merged model
    assert not schedule.pending()
    assert [i + 7 for i, (_, merge) in enumerate(run(schedule, 6)) if merge] == [8, 12]


@pytest.mark.parametrize("kwargs, match", [(dict(k=0), "k must be an integer >= 1"),
                                           (dict(k=2.5), "k must be an integer >= 1"),
                                           (dict(warmup_steps=-1), "warmup_steps must be >= 0")])
def test_bad_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MergeSchedule(**kwargs)
