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


def test_a_truncated_gzip_fails_every_stage_unless_skipped(tmp_path, in_process, capfd):
    # As in the report: the sample gzipped, cut to its first 311,728 bytes.
    truncated = tmp_path / "trunc.tsv.gz"
    truncated.write_bytes(gzip.compress(real_criteo_sample().big.read_bytes())[:311_728])
    fit = ["fit", *SMALL, "--data.train_paths", f"[{truncated}]", "--trainer.max_steps", "3",
           "--trainer.logger.init_args.save_dir", str(tmp_path / "runs")]

    # A real `ctr-lightning fit` process: it exits non-zero, its traceback naming the file and record.
    failed = run_cli(*fit)
    assert failed.returncode != 0, failed.stdout[-2000:]
    broke = re.search(rf"UnreadableFileError: {re.escape(str(truncated))}: unreadable from record (\d+) on "
                      r"\(EOFError", failed.stderr)
    assert broke, failed.stderr[-3000:]
    intact = int(broke.group(1)) - 1
    assert 0 < intact < 4584 and "Run finished" not in failed.stdout + failed.stderr

    # The other runs call the same CLI in this process, without a second interpreter's start-up:
    # a failure is the exception the process above died of.
    capfd.readouterr()
    in_process([*fit, "--data.bad_files", "skip"])
    assert f"{truncated}: unreadable from record {intact + 1} on" in capfd.readouterr().err
    (checkpoint,) = (tmp_path / "runs").rglob("last.ckpt")  # the failed run saved none

    predict = ["predict", *SMALL, "--data.predict_paths", f"[{truncated}]", "--ckpt_path", str(checkpoint),
               "--trainer.logger", "false", "--trainer.default_root_dir", str(tmp_path / "pred")]
    with pytest.raises(UnreadableFileError, match=f"{re.escape(str(truncated))}: unreadable from record "
                                                  f"{intact + 1} on \\(EOFError"):
        in_process(predict)
    assert not (tmp_path / "pred" / "predictions" / "scores-rank00000.tsv").exists()

    for stage, paths in (("validate", "--data.val_paths"), ("test", "--data.test_paths")):
        with pytest.raises(UnreadableFileError, match=f"{re.escape(str(truncated))}: unreadable from record "
                                                      f"{intact + 1} on"):
            in_process([stage, *SMALL, paths, f"[{truncated}]", "--ckpt_path", str(checkpoint),
                        "--trainer.logger", "false", "--trainer.default_root_dir", str(tmp_path / stage)])

    in_process([*predict, "--data.bad_files", "skip"])
    lines = (tmp_path / "pred" / "predictions" / "scores-rank00000.tsv").read_text().splitlines()
    assert len(lines) == 1 + intact  # a header, then a score for every record before the break
