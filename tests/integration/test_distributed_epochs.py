import pytest

from ctr_lightning.datamodules import write_synthetic_criteo

# One fit per number of loader workers given, in turn in the same processes (each a fresh
# data module, model and Trainer); the results by number of workers.
RANK_SCRIPT = """
import json, sys
import lightning.pytorch as pl
from ctr_lightning.datamodules import CriteoDataModule
from ctr_lightning.models import DLRMModule

class Count(pl.Callback):
    def __init__(self):
        self.batches = self.examples = 0
    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.batches += 1
        self.examples += len(batch)

def fit(num_workers):
    count = Count()
    dm = CriteoDataModule(train_paths=[sys.argv[2]], batch_size=50, num_workers=num_workers)
    model = DLRMModule(num_embeddings=1000, embedding_dim=4, dense_arch_layer_sizes=[4], over_arch_layer_sizes=[4, 1])
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=2, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[count])
    trainer.fit(model, datamodule=dm)
    held = dm._train_loader.held_back
    return {"rank": trainer.global_rank, "batches": count.batches, "examples": count.examples,
            "held_back_examples": held[1]}

print("RESULT " + json.dumps({n: fit(int(n)) for n in sys.argv[3].split(",")}))
import torch.distributed as _dist
if _dist.is_initialized():  # an orderly shutdown: gloo threads left to exit-time destructors can abort
    _dist.destroy_process_group()
"""


@pytest.fixture(scope="module")
def fits(tmp_path_factory, run_ranks_in_fixture):
    """Each rank's results of a fit with no loader worker, and with 2, by number of workers."""
    # Long lines first, short ones after: rank 0's half of the bytes holds far fewer rows,
    # but the shards are cut by rows, so both ranks read 600 a epoch.
    tmp_path = tmp_path_factory.mktemp("uneven")
    full = write_synthetic_criteo(tmp_path / "full.tsv", rows=600, seed=0).read_text().splitlines()
    short = ["\t".join(line.split("\t")[:1] + [""] * 39) for line in full]
    path = tmp_path / "uneven.tsv"
    path.write_text("\n".join(full + short) + "\n")
    return run_ranks_in_fixture(RANK_SCRIPT, [str(path), "0,2"], world=2, timeout=300)


@pytest.mark.slow
@pytest.mark.parametrize("num_workers", [0, 2])
def test_ranks_take_equal_steps_on_uneven_shards(fits, num_workers):
    a, b = sorted((r[str(num_workers)] for r in fits), key=lambda r: r["rank"])
    assert a["batches"] == b["batches"] == 2 * 12
    # Two epochs: every example trained on once an epoch, none held back to keep ranks even.
    assert a["examples"] == b["examples"] == 2 * 600
    assert a["held_back_examples"] == b["held_back_examples"] == 0
