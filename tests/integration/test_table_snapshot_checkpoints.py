"""Lightning checkpoints with TableSnapshots: the .ckpt holds a reference, the rows stream to
a snapshot; top-k rotation deletes only snapshots no kept checkpoint names; a resumed run
ends bit for bit where an uninterrupted one does."""

import fcntl
import shutil

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from ctr_lightning.callbacks import TableSnapshots
from ctr_lightning.callbacks.table_snapshots import snapshot_references, with_ancestors
from ctr_lightning.datamodules import CriteoDataModule, write_synthetic_criteo
from ctr_lightning.embedding import StorageConfig, TieredEmbeddingBagCollection
from ctr_lightning.embedding.snapshots.table_snapshot import MANIFEST, WRITING, SnapshotManifest
from ctr_lightning.models import DLRMModule

STEPS, EVERY = 24, 6


def fit(work, data, max_steps, ckpt_path=None, top_k=2, full_every=8):
    pl.seed_everything(0)
    model = DLRMModule(embedding_dim=8, num_embeddings=5000, dense_arch_layer_sizes=[16],
                       over_arch_layer_sizes=[16, 1],
                       storage=StorageConfig(device_rows=150, host_rows=0, ssd_dir=str(work / "ssd")))
    checkpoints = ModelCheckpoint(dirpath=work / "ckpt", every_n_train_steps=EVERY, save_top_k=top_k, monitor="step",
                                  mode="max", save_last=True)
    trainer = pl.Trainer(accelerator="cpu", max_steps=max_steps, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[checkpoints, TableSnapshots(full_every=full_every)], default_root_dir=work)
    trainer.fit(model, datamodule=CriteoDataModule(train_paths=[str(data)], batch_size=64), ckpt_path=ckpt_path)
    return model


def final_rows(model):
    collection = next(m for m in model.modules() if isinstance(m, TieredEmbeddingBagCollection))
    out = {}
    for name, table in collection._built().export().items():
        order = torch.argsort(table["ids"])
        out[name] = (table["ids"][order], table["rows"][order], table["steps"])
    return out


def test_checkpoints_reference_snapshots_rotate_them_and_resume_bit_exact(tmp_path):
    data = tmp_path / "day_0.tsv"
    write_synthetic_criteo(data, rows=STEPS * 64 + 500, seed=0)
    full = fit(tmp_path / "full", data, STEPS, full_every=2)  # saves: full, incremental, full, incremental
    ckpts = sorted((tmp_path / "full" / "ckpt").glob("*.ckpt"))
    assert len(ckpts) == 3  # the top 2 by step and last.ckpt
    named = set()
    for path in ckpts:
        state = torch.load(path, weights_only=True)["state_dict"]
        refs = snapshot_references(state)
        assert len(refs) == 1 and not any("tables" in v for k, v in state.items() if k.endswith("_extra_state"))
        named |= refs
    snapshots = {str(p.resolve()) for p in (tmp_path / "full" / "ckpt" / "table_snapshots").iterdir()}
    # Those of rotated-out checkpoints are gone, the kept ones' are there, with the full
    # snapshot the last one builds on.
    manifests = {p: SnapshotManifest.read(p) for p in snapshots}
    assert snapshots == with_ancestors(named) and len(snapshots) == 2
    last = snapshot_references(torch.load(tmp_path / "full" / "ckpt" / "last.ckpt", weights_only=True)["state_dict"])
    parent = manifests[last.pop()].parent
    assert parent is not None and parent.path in snapshots and manifests[parent.path].parent is None

    # A run stopped at a checkpoint, its directory moved elsewhere (the checkpoint names
    # snapshots by their old paths), then resumed from it, ends where the full run does.
    fit(tmp_path / "before", data, STEPS // 2, top_k=-1)
    shutil.move(tmp_path / "before", tmp_path / "part")
    # What a save killed before its manifest leaves (row files, no manifest, its writer's
    # lock file unlocked), the same while its writer still writes (this process holds the
    # lock), and a folder that is not a snapshot: the resumed run deletes only the first.
    root = tmp_path / "part" / "ckpt" / "table_snapshots"
    complete = next(root.iterdir())
    killed, writing = root / "v000000099-0badf00d", root / "v000000099-0000beef"
    for incomplete in (killed, writing):
        shutil.copytree(complete, incomplete)
        (incomplete / MANIFEST).unlink()
        (incomplete / f"{WRITING}rank0").touch()
    (root / "notes").mkdir()
    with open(writing / f"{WRITING}rank0") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        resumed = fit(tmp_path / "part", data, STEPS, ckpt_path=str(tmp_path / "part" / "ckpt" / "last.ckpt"),
                      top_k=-1)
    assert not killed.exists() and writing.is_dir() and (root / "notes").is_dir()
    shutil.rmtree(writing)
    # Completed saves leave no lock file behind.
    assert all((d / MANIFEST).exists() and not list(d.glob(f"{WRITING}*")) for d in root.iterdir() if d.name != "notes")
    a, b = final_rows(full), final_rows(resumed)
    # The last snapshot of the resumed run is the third incremental one over the first:
    # loaded through that chain, it holds the final rows too.
    # (Lightning names it last-v1.ckpt: it does not overwrite a last.ckpt of another dirpath.)
    final = next((tmp_path / "part" / "ckpt").glob(f"*step={STEPS}.ckpt"))
    last = snapshot_references(torch.load(final, weights_only=True)["state_dict"])
    chain = SnapshotManifest.read(next(iter(last))).chain(next(iter(last)))
    assert [m.parent is None for _, m in chain] == [False, False, False, True]
    reloaded = DLRMModule(embedding_dim=8, num_embeddings=5000, dense_arch_layer_sizes=[16],
                          over_arch_layer_sizes=[16, 1],
                          storage=StorageConfig(device_rows=100, host_rows=0, ssd_dir=str(tmp_path / "reload")))
    reloaded.embeddings.load_tables(next(iter(last)))
    assert final_rows(reloaded).keys() == a.keys()
    for name, (ids, rows, steps) in final_rows(reloaded).items():
        assert torch.equal(ids, a[name][0]) and torch.equal(rows, a[name][1]) and steps == a[name][2], name
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name][0], b[name][0]) and torch.equal(a[name][1], b[name][1]), name
        assert a[name][2] == b[name][2]
    for (k, x), (_, y) in zip(full.state_dict().items(), resumed.state_dict().items()):
        if isinstance(x, torch.Tensor):
            assert torch.equal(x, y), k
