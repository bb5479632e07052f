import logging

import pytest

from ctr_lightning.datamodules.followed_log import FollowedLog


def land(root, day, hour, text="x\n", marker=True):
    part = root / f"dt=2026-12-{day:02d}" / f"hour={hour:02d}"
    part.mkdir(parents=True, exist_ok=True)
    (part / "part-0.tsv").write_text(text)
    if marker:
        (part / "_SUCCESS").write_text("")
    return str(part / "part-0.tsv")


def test_partitions_with_markers_are_taken_in_order_and_one_being_written_waits(tmp_path):
    followed = FollowedLog(str(tmp_path))
    assert followed.poll() == []  # nothing landed: not an error
    first = land(tmp_path, 1, 0)
    writing = land(tmp_path, 1, 1, marker=False)  # no marker yet, while others have one
    later = land(tmp_path, 1, 2)
    # hour 01 is not complete, so hour 02 waits behind it: slices are trained in order.
    assert followed.poll() == [[first]]
    assert followed.poll() == []
    (tmp_path / "dt=2026-12-01" / "hour=01" / "_SUCCESS").write_text("")
    assert followed.poll() == [[writing], [later]]
    assert followed.slices == [[first], [writing], [later]]


def test_without_markers_a_file_counts_once_its_size_is_stable_over_two_polls(tmp_path):
    followed = FollowedLog(str(tmp_path / "*.tsv"))
    log = tmp_path / "a.tsv"
    log.write_text("1\n")
    assert followed.poll() == []  # first sighting: its size is not known to be stable yet
    log.write_text("1\n2\n")
    assert followed.poll() == []  # it grew
    assert followed.poll() == [[str(log)]]
    with pytest.raises(ValueError, match="ready must be"):
        FollowedLog(str(tmp_path), ready="soon")
    marker_only = FollowedLog(str(tmp_path / "*.tsv"), ready="marker")
    assert marker_only.poll() == [] and marker_only.poll() == []  # a plain file never has a marker


def test_a_slice_landing_after_a_later_one_was_taken_is_skipped_and_logged(tmp_path, caplog):
    followed = FollowedLog(str(tmp_path))
    land(tmp_path, 2, 0)
    assert len(followed.poll()) == 1
    late = land(tmp_path, 1, 0)
    with caplog.at_level(logging.WARNING):
        assert followed.poll() == []
    assert followed.skipped == [late.rsplit("/", 1)[0]]
    assert "landed after" in caplog.text and "dt=2026-12-01/hour=00" in caplog.text
    again = FollowedLog(str(tmp_path))
    again.load(followed.state())  # a resumed run keeps the order and the skip
    assert again.slices == followed.slices and again.poll() == []


def test_wait_for_ends_on_a_stop_file_or_an_idle_timeout(tmp_path):
    followed = FollowedLog(str(tmp_path))
    land(tmp_path, 1, 0)
    assert followed.wait_for(1, poll_seconds=0.01, idle_timeout=5)
    assert not followed.wait_for(2, poll_seconds=0.01, idle_timeout=0.05)  # nothing more lands
    stop = tmp_path / "STOP"
    stop.write_text("")
    land(tmp_path, 1, 1)
    assert not followed.wait_for(2, poll_seconds=0.01, idle_timeout=5, stop_file=str(stop))
    stop.unlink()
    assert followed.wait_for(2, poll_seconds=0.01, idle_timeout=5, stop_file=str(stop))


def test_follow_mode_without_a_time_order_is_refused(tmp_path):
    from ctr_lightning.datamodules import CriteoDataModule

    land(tmp_path, 1, 0)
    with pytest.raises(ValueError, match="shuffle_shards"):
        CriteoDataModule(train_paths=str(tmp_path), follow=True, shuffle_shards=True)
    fixed = str(tmp_path / "dt=2026-12-01" / "hour=00" / "part-0.tsv")
    with pytest.raises(ValueError, match="name fixed files"):
        CriteoDataModule(train_paths=[fixed], follow=True)
    with pytest.raises(ValueError, match="not online"):
        CriteoDataModule(train_paths=str(tmp_path), follow=True, online=True)
    CriteoDataModule(train_paths=str(tmp_path / "dt=*" / "hour=*" / "*.tsv"), follow=True)  # a glob: fine
