"""Delta exports for serving: ``ctr-lightning export --since`` writes only the rows changed
since the export it follows and the floors that delete the rows gone; ``ctr_lightning.serving``
applies base and deltas in order to the model's rows, bit for bit, across expiry, admission
and a resume, in tables kept by recency and by a score."""

import json
import subprocess
import sys

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from ctr_lightning.callbacks import ServingExport
from ctr_lightning.callbacks.serving_exports import LATEST
from ctr_lightning.cli import main
from ctr_lightning.datamodules import CriteoDataModule, write_synthetic_criteo
from ctr_lightning.embedding import Admission, Expiry, StorageConfig
from ctr_lightning.models import DLRMModule
from ctr_lightning.serving import read_export
from tests.integration.test_serving_export import _example


def model(tmp_path, name, expiry=Expiry(ttl=12), admission=Admission(admit_after=2)):
    return DLRMModule(embedding_dim=8, num_embeddings=5000, dense_arch_layer_sizes=[16], over_arch_layer_sizes=[16, 1],
                      expiry=expiry, admission=admission,
                      storage=StorageConfig(device_rows=150, host_rows=0, ssd_dir=str(tmp_path / f"ssd_{name}"),
                                            ssd_segment_bytes=1 << 14))


def fit(module, tmp_path, name, data, max_steps, ckpt_path=None, callbacks=()):
    pl.Trainer(accelerator="cpu", max_steps=max_steps, logger=False, enable_progress_bar=False,
               enable_model_summary=False, default_root_dir=tmp_path,
               callbacks=[*callbacks, ModelCheckpoint(dirpath=tmp_path / f"ckpt_{name}", every_n_train_steps=8,
                                                      save_top_k=-1, filename="{step}")]).fit(
        module, datamodule=CriteoDataModule(train_paths=[str(data)], batch_size=64), ckpt_path=ckpt_path)


def export(tmp_path, name, step, out, since=None):
    main(["export", "--ckpt_path", str(tmp_path / f"ckpt_{name}" / f"step={step}.ckpt"), "--out", str(out),
          *(["--since", str(since)] if since else [])])
    return json.loads((out / "export.json").read_text())


def check_equal(served, module):
    """The reader's rows are the model's stored rows, bit for bit, table by table."""
    stored = module.embeddings._built().export()
    for name, table in stored.items():
        dim = served.tables[name].dim
        order = np.argsort(table["ids"].numpy())
        assert np.array_equal(served.tables[name].ids, table["ids"].numpy()[order]), name
        assert np.array_equal(served.tables[name].vectors, table["rows"][:, :dim].numpy()[order]), name


def test_base_and_deltas_read_back_the_models_rows_across_expiry_admission_and_a_resume(tmp_path):
    data = write_synthetic_criteo(tmp_path / "train.tsv", rows=40 * 64, seed=0)
    # ServingExport every 4 steps, every third export whole: 4 (full), 8, 12, 16 (full), 20, 24.
    straight = model(tmp_path, "a")
    fit(straight, tmp_path, "a", data, max_steps=24, callbacks=[ServingExport(tmp_path / "serving_a", 4, 3)])
    root = tmp_path / "serving_a"
    latest = root / (root / "LATEST").read_text().strip()
    served = read_export(latest)
    assert [p.name for p in served.chain] == ["step=000000016", "step=000000020", "step=000000024"]
    check_equal(served, straight)

    # By hand, from the run's checkpoints: a full export at step 8, deltas at 16 and 24.
    base = export(tmp_path, "a", 8, tmp_path / "serving" / "8")
    first = export(tmp_path, "a", 16, tmp_path / "serving" / "16", since=tmp_path / "serving" / "8")
    second = export(tmp_path, "a", 24, tmp_path / "serving" / "24", since=tmp_path / "serving" / "16")
    served = read_export(tmp_path / "serving" / "24")
    assert [p.name for p in served.chain] == ["8", "16", "24"]
    check_equal(served, straight)
    # The deltas hold the rows looked up since, fewer than a full export's; rows expired
    # since the base are gone from the reader's tables too.
    rows = {name: sum(t["rows"] for t in d["tables"].values()) for name, d in
            (("base", base), ("first", first), ("second", second))}
    full = sum(len(t["ids"]) for t in straight.embeddings._built().export().values())
    assert 0 < rows["second"] < full and rows["first"] < rows["base"] + full
    in_base = read_export(tmp_path / "serving" / "8").tables
    deleted = sum(int((~np.isin(t.ids, served.tables[name].ids)).sum()) for name, t in in_base.items())
    assert deleted > 50  # by the deltas' floors
    assert sum(c["expired"] for c in straight.embeddings.expiry_counts().values()) > 100
    assert straight.embeddings.tier_stats()["rows_rejected"] > 100

    # Resumed from step 8: the callback's chain goes on after the first run's export of step
    # 8, and its export of step 24 is the first run's model; so is a delta written by hand
    # from its step-24 checkpoint after the first run's step-16 export.
    resumed = model(tmp_path, "b")
    fit(resumed, tmp_path, "b", data, max_steps=24, ckpt_path=str(tmp_path / "ckpt_a" / "step=8.ckpt"),
        callbacks=[ServingExport(tmp_path / "serving_b", 4, 3)])
    chain = read_export(tmp_path / "serving_b" / "step=000000012").chain
    assert [(p.parent.name, p.name) for p in chain] == [
        ("serving_a", "step=000000004"), ("serving_a", "step=000000008"), ("serving_b", "step=000000012")]
    check_equal(read_export(tmp_path / "serving_b" / "step=000000024"), straight)
    export(tmp_path, "b", 24, tmp_path / "serving" / "24b", since=tmp_path / "serving" / "16")
    check_equal(read_export(tmp_path / "serving" / "24b"), resumed)
    check_equal(read_export(tmp_path / "serving" / "24b"), straight)

    # Scores from the reader's rows and the exported dense part: the model's, within 1e-6.
    batch = next(iter(CriteoDataModule(train_paths=[str(data)], batch_size=200).train_dataloader()))
    straight.eval()
    with torch.no_grad():
        expected = torch.sigmoid(straight(batch))
    example = _example()
    served_scores = example.score(example.load_model(tmp_path / "serving" / "24"), batch.dense, batch.sparse)
    torch.testing.assert_close(served_scores, expected, atol=1e-6, rtol=0)

    # A damaged link, or a parent replaced, is refused by name.
    (tmp_path / "serving" / "16" / "export.json").write_text(
        (tmp_path / "serving" / "16" / "export.json").read_text().replace('"global_step"', '"global_step" '))
    with pytest.raises(ValueError, match="is not the one it was written after"):
        read_export(tmp_path / "serving" / "24")


class CheckEachExport(Callback):
    """After each export of the ServingExport before it in the callbacks: the newest export
    read back (base and deltas) is the model's rows at that step, bit for bit (``rows()``)."""

    def __init__(self, root, every: int) -> None:
        self.root, self.every, self.checked, self.tombstoned = root, every, [], 0
        self.held: dict[str, np.ndarray] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step % self.every:
            return
        served = read_export(self.root / (self.root / LATEST).read_text().strip())
        stored = pl_module.embeddings._built().export()
        for name, table in served.tables.items():
            assert table.ids.tolist() == sorted(stored[name]["ids"].tolist()), (trainer.global_step, name)
            rows = pl_module.embeddings.rows(name, table.ids)
            assert torch.equal(torch.from_numpy(table.vectors), rows), (trainer.global_step, name)
            self.tombstoned += int((~np.isin(self.held.get(name, table.ids), table.ids)).sum())
            self.held[name] = table.ids
        self.checked.append(served.chain[-1].name)


@pytest.mark.parametrize("expiry", [Expiry(max_rows=150, score="lfu", decay=0.9),
                                    Expiry(max_rows=150, score="show_click", decay=0.97)], ids=["lfu", "show_click"])
def test_score_tables_base_and_deltas_read_back_the_models_rows_across_evictions_and_a_resume(tmp_path, expiry):
    data = write_synthetic_criteo(tmp_path / "train.tsv", rows=40 * 64, seed=0)
    # ServingExport every 4 steps, every third export whole; each read back at its step.
    straight = model(tmp_path, "a", expiry, admission=None)
    check = CheckEachExport(tmp_path / "serving_a", 4)
    fit(straight, tmp_path, "a", data, max_steps=24, callbacks=[ServingExport(tmp_path / "serving_a", 4, 3), check])
    assert check.checked == [f"step={s:09d}" for s in range(4, 25, 4)]
    description = read_export(tmp_path / "serving_a" / "step=000000024").description
    assert {t["ranked_by"] for t in description["tables"].values()} == {"score_bucket"}
    assert "since" in description
    assert check.tombstoned > 1000  # rows evicted between exports, deleted by the deltas' floors
    assert sum(c["evicted"] for c in straight.embeddings.expiry_counts().values()) > 3000

    # Resumed from step 8: the chain goes on after the first run's step-8 export, each export
    # read back at its step, and the last is the first run's model.
    resumed = model(tmp_path, "b", expiry, admission=None)
    check = CheckEachExport(tmp_path / "serving_b", 4)
    fit(resumed, tmp_path, "b", data, max_steps=24, ckpt_path=str(tmp_path / "ckpt_a" / "step=8.ckpt"),
        callbacks=[ServingExport(tmp_path / "serving_b", 4, 3), check])
    assert check.checked == [f"step={s:09d}" for s in range(12, 25, 4)]
    chain = read_export(tmp_path / "serving_b" / "step=000000012").chain
    assert [(p.parent.name, p.name) for p in chain] == [
        ("serving_a", "step=000000004"), ("serving_a", "step=000000008"), ("serving_b", "step=000000012")]
    check_equal(read_export(tmp_path / "serving_b" / "step=000000024"), straight)


def test_a_full_export_reads_without_torch_and_a_delta_needs_stamped_tables(tmp_path):
    data = write_synthetic_criteo(tmp_path / "train.tsv", rows=10 * 64, seed=0)
    plain = DLRMModule(embedding_dim=4, num_embeddings=1000, dense_arch_layer_sizes=[4], over_arch_layer_sizes=[4, 1])
    plain.embeddings.checkpoint_to_snapshots(None)
    fit(plain, tmp_path, "p", data, max_steps=8)
    export(tmp_path, "p", 8, tmp_path / "full")
    script = ("import sys; sys.modules['torch'] = None\n"  # any import of torch fails
              "from ctr_lightning.serving import read_export\n"
              f"m = read_export({str(tmp_path / 'full')!r})\n"
              "print(sum(len(t) for t in m.tables.values()))")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert int(out.stdout) == sum(len(t["ids"]) for t in plain.embeddings._built().export().values()) > 100
    with pytest.raises(ValueError, match="table 't_C1' does not record its rows' last lookup step"):
        export(tmp_path, "p", 8, tmp_path / "delta", since=tmp_path / "full")
    with pytest.raises(ValueError, match=r"tables \['t_C1', .* do not"):
        ServingExport(tmp_path / "x").setup(pl.Trainer(logger=False), plain, "fit")
    scored = DLRMModule(embedding_dim=4, num_embeddings=1000, dense_arch_layer_sizes=[4], over_arch_layer_sizes=[4, 1],
                        expiry=Expiry(max_rows=100, score="lfu"))
    ServingExport(tmp_path / "y").setup(pl.Trainer(logger=False), scored, "fit")  # deltas ranked by score: fine
