"""A log file that cannot be read to its end (here a gzip file cut off mid-stream, made
from the real Criteo sample) fails `ctr-lightning fit`, `validate`, `test` and `predict`
naming the file and the record, unless `--data.bad_files skip` asks to use the records
before the break."""

import gzip
import re

import pytest

from ctr_lightning.datamodules import UnreadableFileError

from ..conftest import real_criteo_sample
from .test_cli_runs import run_cli

SMALL = ["--config", "configs/criteo.yaml", "--data.batch_size", "256", "--data.num_workers", "1",
         "--model.embedding_dim", "4", "--model.num_embeddings", "1000", "--model.dense_arch_layer_sizes", "[8, 4]",
         "--model.over_arch_layer_sizes", "[8, 1]", "--trainer.enable_progress_bar", "false"]


def test_a_truncated_gzip_fails_every_stage_unless_skipped(tmp_path, in_process):
    # As in the report: the sample gzipped, cut to its first 311,728 bytes.
    truncated = tmp_path / "trunc.tsv.gz"
    truncated.write_bytes(gzip.compress(real_criteo_sample().big.read_bytes())[:311_728])
    fit = ["fit", *SMALL, "--data.train_paths", f"[{truncated}]", "--trainer.max_steps", "3",
           "--trainer.logger.init_args.save_dir", str(tmp_path / "runs")]

    failed = run_cli(*fit)
    assert failed.returncode != 0, failed.stdout[-2000:]
    broke = re.search(rf"UnreadableFileError: {re.escape(str(truncated))}: unreadable from record (\d+) on "
                      r"\(EOFError", failed.stderr)
    assert broke, failed.stderr[-3000:]
    intact = int(broke.group(1)) - 1
    assert 0 < intact < 4584 and "Run finished" not in failed.stdout + failed.stderr

    skipped = run_cli(*fit, "--data.bad_files", "skip")
    assert skipped.returncode == 0, skipped.stderr[-3000:]
    assert f"{truncated}: unreadable from record {intact + 1} on" in skipped.stderr
    (checkpoint,) = (tmp_path / "runs").rglob("last.ckpt")  # the failed run saved none

    predict = ["predict", *SMALL, "--data.predict_paths", f"[{truncated}]", "--ckpt_path", str(checkpoint),
               "--trainer.logger", "false", "--trainer.default_root_dir", str(tmp_path / "pred")]
    failed = run_cli(*predict)
    assert failed.returncode != 0, failed.stdout[-2000:]
    assert f"{truncated}: unreadable from record {intact + 1} on (EOFError" in failed.stderr, failed.stderr[-3000:]
    assert not (tmp_path / "pred" / "predictions" / "scores-rank00000.tsv").exists()

    for stage, paths in (("validate", "--data.val_paths"), ("test", "--data.test_paths")):
        # In this process (the same CLI, without a second interpreter's start-up).
        with pytest.raises(UnreadableFileError, match=f"{re.escape(str(truncated))}: unreadable from record "
                                                      f"{intact + 1} on"):
            in_process([stage, *SMALL, paths, f"[{truncated}]", "--ckpt_path", str(checkpoint),
                        "--trainer.logger", "false", "--trainer.default_root_dir", str(tmp_path / stage)])

    scored = run_cli(*predict, "--data.bad_files", "skip")
    assert scored.returncode == 0, scored.stderr[-3000:]
    lines = (tmp_path / "pred" / "predictions" / "scores-rank00000.tsv").read_text().splitlines()
    assert len(lines) == 1 + intact  # a header, then a score for every record before the break
