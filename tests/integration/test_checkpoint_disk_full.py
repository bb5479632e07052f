"""A checkpoint that meets a full disk fails naming the file, leaves the previous checkpoint
loadable and the training state intact: on a real, small file system (tmpfs in a mount
namespace of the test's own)."""

SCRIPT = r"""
import os, sys
import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from ctr_lightning.callbacks import TableSnapshots
from ctr_lightning.datamodules import CriteoDataModule, write_synthetic_criteo
from ctr_lightning.embedding import StorageConfig
from ctr_lightning.models import DLRMModule

root = sys.argv[1]
data = os.path.join(root, "day_0.tsv")
write_synthetic_criteo(data, rows=20 * 64 + 100, seed=0)
small = os.path.join(root, "small")
os.makedirs(small)
os.system(f"mount -t tmpfs -o size=32m tmpfs {small}")

def fit(work, ckpt_dir, max_steps, ckpt_path=None):
    pl.seed_everything(0)
    model = DLRMModule(embedding_dim=8, num_embeddings=5000, dense_arch_layer_sizes=[16], over_arch_layer_sizes=[16, 1],
                       storage=StorageConfig(device_rows=150, host_rows=0, ssd_dir=os.path.join(work, "ssd")))
    trainer = pl.Trainer(accelerator="cpu", max_steps=max_steps, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=work,
                         callbacks=[ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=10, save_last=True),
                                    TableSnapshots(full_every=1)])
    try:
        trainer.fit(model, datamodule=CriteoDataModule(train_paths=[data], batch_size=64), ckpt_path=ckpt_path)
        error = None
    except OSError as e:
        error = e
    state = {name: (t["ids"][torch.argsort(t["ids"])], t["rows"][torch.argsort(t["ids"])])
             for name, t in model.embeddings._built().export().items()}
    # Not state_dict(): with TableSnapshots that would save a snapshot.
    return error, state, {k: v.detach().clone() for k, v in model.named_parameters()}

def same(a, b):
    return a.keys() == b.keys() and all(all(torch.equal(x, y) for x, y in zip(a[k], b[k])) if isinstance(a[k], tuple)
                                        else torch.equal(a[k], b[k]) for k in a)

_, reference, reference_dense = fit(os.path.join(root, "reference"), os.path.join(root, "reference", "ckpt"), 20)
ckpt = os.path.join(small, "ckpt")
error, _, _ = fit(os.path.join(root, "run"), ckpt, 10)
assert error is None, error
# The disk fills up: what is left cannot hold the next table snapshot.
st = os.statvfs(small)
with open(os.path.join(small, "filler"), "wb") as f:
    f.truncate(0)
    f.write(b"\0" * (st.f_bavail * st.f_frsize - 48 * 1024))
error, state, dense = fit(os.path.join(root, "run"), ckpt, 20, ckpt_path=os.path.join(ckpt, "last.ckpt"))
print("ERROR", error)
print("STATE INTACT", same(state, reference) and same(dense, reference_dense))
last = torch.load(os.path.join(ckpt, "last.ckpt"), weights_only=True)
print("LAST STEP", last["global_step"])
snapshots = os.path.join(ckpt, "table_snapshots")
print("LEFTOVERS", sorted(p for d in os.listdir(snapshots) for p in os.listdir(os.path.join(snapshots, d))
                          if p.endswith(".partial") or p == "manifest.json.partial"))
os.remove(os.path.join(small, "filler"))
error, state, dense = fit(os.path.join(root, "run"), ckpt, 20, ckpt_path=os.path.join(ckpt, "last.ckpt"))
print("RESUMED", error is None and same(state, reference) and same(dense, reference_dense))
"""


def test_a_full_disk_fails_the_save_naming_the_file_and_the_previous_checkpoint_resumes(tmp_path,
                                                                                         in_mount_namespace):
    result = in_mount_namespace(SCRIPT, [str(tmp_path)])
    out = {line.split(" ", 1)[0]: line.split(" ", 1)[1] for line in result.stdout.splitlines()
           if line.startswith(("ERROR", "STATE", "LAST", "LEFTOVERS", "RESUMED"))}
    assert len(out) == 5, result.stdout + result.stderr[-3000:]
    assert "No space left on device" in out["ERROR"] and f"{tmp_path}/small/ckpt/table_snapshots/" in out["ERROR"], out
    assert out["STATE"] == "INTACT True"  # the failed save changed nothing the run holds
    assert out["LAST"] == "STEP 10"  # last.ckpt still names the previous, complete snapshot
    assert out["LEFTOVERS"] == "[]"  # no partial file left to fill the disk further
    assert out["RESUMED"] == "True"  # and the run resumes from it to where an unbroken one ends
