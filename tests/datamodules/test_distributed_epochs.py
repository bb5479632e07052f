import json
import os
import socket
import subprocess
import sys

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

dm = CriteoDataModule(train_paths=[sys.argv[1]], batch_size=50, num_workers=int(sys.argv[2]))
model = DLRMModule(num_embeddings=1000, embedding_dim=4, dense_arch_layer_sizes=[4], over_arch_layer_sizes=[4, 1])
trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=2, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                     callbacks=[Count()])
trainer.fit(model, datamodule=dm)
held = dm._train_loader.held_back
print("RESULT " + json.dumps({"rank": trainer.global_rank, "batches": Count.batches, "examples": Count.examples,
                              "held_back_examples": held[1]}))
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.parametrize("num_workers", [0, 2])
def test_ranks_take_equal_steps_on_uneven_shards(tmp_path, num_workers):
    # Long lines first, short ones after: rank 0's half of the bytes holds far fewer rows.
    full = write_synthetic_criteo(tmp_path / "full.tsv", rows=600, seed=0).read_text().splitlines()
    short = ["\t".join(line.split("\t")[:1] + [""] * 39) for line in full]
    path = tmp_path / "uneven.tsv"
    path.write_text("\n".join(full + short) + "\n")
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="2", NODE_RANK="0",
               PYTHONWARNINGS="ignore")
    procs = [
        subprocess.Popen([sys.executable, "-c", RANK_SCRIPT, str(path), str(num_workers)],
                         env=dict(env, LOCAL_RANK=str(r), RANK=str(r)), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
        for r in range(2)
    ]
    results = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=300)  # a hang at the end of an epoch fails here
            line = next((l for l in out.splitlines() if l.startswith("RESULT ")), None)
            assert p.returncode == 0 and line, err[-3000:]
            results.append(json.loads(line[len("RESULT "):]))
    finally:
        for p in procs:
            p.kill()
    a, b = sorted(results, key=lambda r: r["rank"])
    assert a["batches"] == b["batches"] > 0
    # Two epochs: every example was trained on or counted as held back, each epoch.
    assert a["examples"] + b["examples"] + 2 * (a["held_back_examples"] + b["held_back_examples"]) == 2 * 1200
    assert a["held_back_examples"] + b["held_back_examples"] > 0  # the shards really were uneven
