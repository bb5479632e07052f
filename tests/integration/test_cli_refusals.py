"""A run that cannot start says why in its last line, as itself: not wrapped in
jsonargparse's "Does not validate against any of the Union subtypes"."""

import os

from ctr_lightning.embedding.tiers.ssd.directory_lock import DirectoryLock

from .test_cli_resume import demo, run_cli


def test_a_second_run_on_a_used_ssd_dir_is_refused_naming_the_directory_and_holder(tmp_path):
    ssd = tmp_path / "ssd"
    ssd.mkdir()
    (ssd / "group0_dim4.000000.0.seg").write_bytes(b"a live run's rows")
    held = DirectoryLock(ssd, "the first run", "StorageConfig.ssd_dir")  # this process: the run already there
    try:
        second = run_cli(*demo(tmp_path, "--model.storage.ssd_dir", str(ssd), "--model.storage.device_rows", "100"))
    finally:
        held.release()
    assert second.returncode != 0
    last = second.stderr.strip().splitlines()[-1]
    assert last.startswith("ctr_lightning.embedding.tiers.ssd.directory_lock.DirectoryInUseError: ") and "Union" not in second.stderr
    assert f"{ssd} is in use by another process (PID {os.getpid()})" in last
    assert (ssd / "group0_dim4.000000.0.seg").read_bytes() == b"a live run's rows"
    assert not (tmp_path / "runs" / "demo").exists() or not any((tmp_path / "runs" / "demo").rglob("*.ckpt"))


def test_a_directory_without_room_for_one_segment_is_refused_as_itself(tmp_path):
    # More than any disk here has free: the check the rerun on a full disk meets.
    rerun = run_cli(*demo(tmp_path, "--model.storage.ssd_dir", str(tmp_path / "ssd"), "--model.storage.device_rows",
                          "100", "--model.storage.ssd_segment_bytes", str(1 << 60)))
    assert rerun.returncode != 0
    last = rerun.stderr.strip().splitlines()[-1]
    assert "Union subtypes" not in rerun.stderr, rerun.stderr[-2000:]
    assert last.startswith("OSError: [Errno 28] SSD tier of tables ['t_C1'") and f"{tmp_path / 'ssd'} has " in last
    assert "choose another ssd_dir" in last
