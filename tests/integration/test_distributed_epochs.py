import pytest

from ctr_lightning.datamodules import write_synthetic_criteo

RANK_SCRIPT = """
import json, sys
import lightning.pytorch as pl
from ctr_lightning.datamodules import CriteoDataModule
from ctr_lightning.models import DLRMModule

class Count(pl.Callback):
    batches = examples = 0
    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        Count.batches += 1
        Count.examples += len(batch)

dm = CriteoDataModule(train_paths=[sys.argv[2]], batch_size=50, num_workers=int(sys.argv[3]))
model = DLRMModule(num_embeddings=1000, embedding_dim=4, dense_arch_layer_sizes=[4], over_arch_layer_sizes=[4, 1])
trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=2, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                     callbacks=[Count()])
trainer.fit(model, datamodule=dm)
held = dm._train_loader.held_back
print("RESULT " + json.dumps({"rank": trainer.global_rank, "batches": Count.batches, "examples": Count.examples,
                              "held_back_examples": held[1]}))
import torch.distributed as _dist
if _dist.is_initialized():  # an orderly shutdown: gloo threads left to exit-time destructors can abort
    _dist.destroy_process_group()
"""


@pytest.mark.slow
@pytest.mark.parametrize("num_workers", [0, 2])
def test_ranks_take_equal_steps_on_uneven_shards(tmp_path, num_workers, run_ranks):
    # Long lines first, short ones after: rank 0's half of the bytes holds far fewer rows,
    # but the shards are cut by rows, so both ranks read 600 a epoch.
    full = write_synthetic_criteo(tmp_path / "full.tsv", rows=600, seed=0).read_text().splitlines()
    short = ["\t".join(line.split("\t")[:1] + [""] * 39) for line in full]
    path = tmp_path / "uneven.tsv"
    path.write_text("\n".join(full + short) + "\n")
    results = run_ranks(RANK_SCRIPT, [str(path), str(num_workers)], world=2, timeout=300)
    a, b = sorted(results, key=lambda r: r["rank"])
    assert a["batches"] == b["batches"] == 2 * 12
    # Two epochs: every example trained on once an epoch, none held back to keep ranks even.
    assert a["examples"] == b["examples"] == 2 * 600
    assert a["held_back_examples"] == b["held_back_examples"] == 0
