"""Validation AUC of k-step Adam (k = 1, 4, 16, 64) at the same number of examples.

Two CPU processes (one "node" each, mode="all") train the DLRM on the synthetic demo
data and, where ../shared/data is present, on the real Criteo sample; k=1 is
synchronous data parallel training. Prints one table per dataset with AUC - AUC(k=1),
after every epoch, averaged over seeds and paired by seed (+- one standard error over seeds), and
the standard error the validation set itself leaves on that difference ("val": DeLong's paired
test on the same validation rows, for the seed-averaged difference); "16o" is k=16 with
overlap=True (each merge applied k steps late), "16f" k=16 with Adam's moments averaged
in float32 rather than the default bfloat16, "64w" (on request) k=64 after 64 synchronous
warm-up steps, "16s" (on request) k=16 for the tables too (``sparse_sync="k_step"``: replicas
merged into their owners every 16 steps) where every other configuration syncs the tables
every step; "16sf" as "16s" with the tables' optimizer state sent in float32; "16sw" as "16s"
after 16 synchronous warm-up steps (dense part and tables).

    python benchmarks/kstep_convergence.py [--train-rows 200000 --epochs 1]
    python benchmarks/kstep_convergence.py --data sample --configs 1,64,64w
    python benchmarks/kstep_convergence.py --configs 1,16,16s --sample-epochs 1   # k-step tables
    python benchmarks/kstep_convergence.py --data sample --real-train day_0.tsv --real-val day_1.tsv \
        --sample-batch 512 --sample-epochs 1 --sample-seeds 3
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT.parent / "shared" / "data" / "criteo_kaggle_sample"

RANK_SCRIPT = r"""
import json, os, sys
import lightning.pytorch as pl
import numpy as np
import torch
from ctr_lightning.datamodules import CriteoDataModule
from ctr_lightning.models import DLRMModule
from ctr_lightning.strategies import KStepAdamStrategy

k, train, val, epochs, batch, seed = (int(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]),
                                      int(sys.argv[6]))
options, out_dir, model_options = json.loads(sys.argv[7]), sys.argv[8], json.loads(sys.argv[9])
pl.seed_everything(seed)
dm = CriteoDataModule(train_paths=[train], val_paths=[val], batch_size=batch)
model = DLRMModule(embedding_dim=16, num_embeddings=100_000, dense_arch_layer_sizes=[64],
                   over_arch_layer_sizes=[128, 64, 1], learning_rate=1e-3, sparse_learning_rate=0.01, seed=seed,
                   **model_options)
aucs = []

class EpochAuc(pl.Callback):
    # AUC after every epoch; every validation row's prediction goes to a file per rank
    # and epoch (for the paired test), not through the process pipes.
    def on_validation_epoch_start(self, trainer, module):
        self.scores, self.labels = [], []

    def on_validation_batch_end(self, trainer, module, outputs, batch, batch_idx, dataloader_idx=0):
        # Evaluation forwards are collective when the tables are sharded: both ranks run
        # this for every batch, as they do validation_step.
        self.scores.append(torch.sigmoid(module(batch)).float().numpy())
        self.labels.append(batch.labels.numpy().astype(np.int8))

    def on_validation_epoch_end(self, trainer, module):
        aucs.append(float(trainer.callback_metrics["val/auc"]))
        np.savez(os.path.join(out_dir, f"rank{trainer.global_rank}_epoch{len(aucs) - 1}.npz"),
                 scores=np.concatenate(self.scores), labels=np.concatenate(self.labels))

trainer = pl.Trainer(accelerator="cpu", devices=1, num_nodes=2, strategy=KStepAdamStrategy(k=k, mode="all", **options),
                     max_epochs=epochs, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                     enable_model_summary=False, num_sanity_val_steps=0, callbacks=[EpochAuc()])
trainer.fit(model, datamodule=dm)
print("RESULT " + json.dumps({"aucs": aucs, "steps": trainer.global_step}))
import torch.distributed as _dist
if _dist.is_initialized():  # an orderly shutdown: gloo threads left to exit-time destructors can abort
    _dist.destroy_process_group()
"""


def fit(k: int, train: Path, val: Path, epochs: int, batch: int, seed: int = 0, options: dict | None = None,
        model_options: dict | None = None) -> dict:
    """One 2-rank run: its AUC per epoch, steps, and per epoch the validation rows'
    ``(scores, labels)`` in rank order (the same rows in every run)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", LOCAL_RANK="0",
               PYTHONWARNINGS="ignore")
    with tempfile.TemporaryDirectory() as out_dir:
        procs = [subprocess.Popen([sys.executable, "-c", RANK_SCRIPT, str(k), str(train), str(val), str(epochs),
                                   str(batch), str(seed), json.dumps(options or {}), out_dir,
                                   json.dumps(model_options or {})],
                                  env=dict(env, NODE_RANK=str(r)), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True) for r in range(2)]
        outs = [p.communicate(timeout=3600) for p in procs]
        line = next((l for l in outs[0][0].splitlines() if l.startswith("RESULT ")), None)
        if line is None:
            raise RuntimeError(f"k={k} failed:\n{outs[0][1][-3000:]}")
        result = json.loads(line[len("RESULT "):])
        result["predictions"] = []
        for epoch in range(len(result["aucs"])):
            parts = [np.load(Path(out_dir) / f"rank{r}_epoch{epoch}.npz") for r in range(2)]
            result["predictions"].append((np.concatenate([p["scores"] for p in parts]),
                                          np.concatenate([p["labels"] for p in parts])))
    return result


# label: (k, further KStepAdamStrategy arguments, further DLRMModule arguments); "1" (fully
# synchronous: dense k=1, tables sharded row-wise with per-step sync) is the reference every
# other is paired with. Only "16s*" sync the tables every k steps too (sparse_sync="k_step").
CONFIGS = {"1": (1, {}, {}), "4": (4, {}, {}), "16": (16, {}, {}), "64": (64, {}, {}),
           "16o": (16, {"overlap": True}, {}), "16f": (16, {"moment_dtype": "float32"}, {}),
           "64w": (64, {"warmup_steps": 64}, {}), "16s": (16, {}, {"sparse_sync": "k_step"}),
           "16sf": (16, {}, {"sparse_sync": "k_step", "sync_state_dtype": "float32"}),
           "16sw": (16, {"warmup_steps": 16}, {"sparse_sync": "k_step"})}
DEFAULT_CONFIGS = "1,4,16,64,16o,16f"


def placements(scores: np.ndarray, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """DeLong's structural components of one model's validation AUC: for every positive,
    the share of negatives it outranks (ties count half), and for every negative the share
    of positives that outrank it. AUC is the mean of either."""
    pos, neg = scores[labels == 1], scores[labels == 0]  # in row order: runs are paired row by row
    # By rank (sorted searches), not by an all-pairs matrix: 50k rows would need gigabytes.
    sorted_pos, sorted_neg = np.sort(pos), np.sort(neg)
    v10 = (np.searchsorted(sorted_neg, pos, "left") + np.searchsorted(sorted_neg, pos, "right")) / (2 * len(neg))
    v01 = 1.0 - (np.searchsorted(sorted_pos, neg, "left") + np.searchsorted(sorted_pos, neg, "right")) / (2 * len(pos))
    return v10, v01


Predictions = tuple[np.ndarray, np.ndarray]  # (scores, labels) of the validation rows, in a fixed order


def validation_error(runs: list[Predictions], reference: list[Predictions]) -> float:
    """Standard error, over the choice of validation rows, of the seed-averaged AUC
    difference between two configurations evaluated on the same rows (DeLong's paired
    test). The seed error says how the difference moves with the initial weights; this one
    says how far the validation set itself can pin it down."""
    d10, d01 = [], []
    for (scores, labels), (ref_scores, ref_labels) in zip(runs, reference):
        if not np.array_equal(labels, ref_labels):
            raise RuntimeError("paired runs saw different validation rows")
        (a10, a01), (b10, b01) = placements(scores, labels), placements(ref_scores, ref_labels)
        d10.append(a10 - b10)
        d01.append(a01 - b01)
    m10, m01 = np.mean(d10, axis=0), np.mean(d01, axis=0)
    return float(np.sqrt(m10.var(ddof=1) / len(m10) + m01.var(ddof=1) / len(m01)))


def table(name: str, train: Path, val: Path, epochs: int, batch: int, seeds: int, labels: list[str]) -> None:
    """AUC after each epoch per k, averaged over ``seeds`` seeds (initial weights), and the
    difference to k=1 paired by seed: on a small validation set the seed alone moves AUC
    by more than the effect being measured, and pairing removes most of that."""
    print(f"\n{name}: 2 ranks x batch {batch}, {epochs} epoch(s), {seeds} seed(s)")
    configs = {label: CONFIGS[label] for label in ["1"] + [c for c in labels if c != "1"]}
    aucs: dict[str, list[list[float]]] = {c: [] for c in configs}
    predictions: dict[str, list[list[Predictions]]] = {c: [] for c in configs}  # [seed][epoch]
    steps = 0
    for seed in range(seeds):
        for label, (k, options, model_options) in configs.items():
            r = fit(k, train, val, epochs, batch, seed, options, model_options)
            aucs[label].append(r["aucs"])
            predictions[label].append(r["predictions"])
            steps = r["steps"] // epochs
    base = np.array(aucs["1"])  # [seed, epoch]
    others = [c for c in configs if c != "1"]
    print("each cell: mean over seeds +- its standard error over seeds (val: over the validation rows, DeLong)")
    print(f"{'epoch':>6}{'steps':>7}{'AUC(k=1)':>10}" + "".join(f"{f'k={c} - k=1':>31}" for c in others))
    for e in range(epochs):
        cells = []
        for c in others:
            diff = np.array(aucs[c])[:, e] - base[:, e]
            error = diff.std(ddof=1) / np.sqrt(len(diff)) if len(diff) > 1 else 0.0
            val_error = validation_error([p[e] for p in predictions[c]], [p[e] for p in predictions["1"]])
            cells.append(f"{diff.mean():+.4f} +- {error:.4f} (val {val_error:.4f})")
        print(f"{e + 1:>6}{(e + 1) * steps:>7}{base[:, e].mean():>10.4f}" + "".join(f"{c:>31}" for c in cells),
              flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train-rows", type=int, default=200_000)
    parser.add_argument("--val-rows", type=int, default=50_000)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--seeds", type=int, default=1, help="seeds on the synthetic data")
    parser.add_argument("--sample-seeds", type=int, default=8, help="seeds on the real sample")
    # 4.6k rows: a small batch gives k=64 two merges an epoch, as production runs merge many
    # times before any example comes round again.
    parser.add_argument("--sample-batch", type=int, default=16, help="batch per rank on the real sample")
    parser.add_argument("--sample-epochs", type=int, default=3)
    parser.add_argument("--configs", default=DEFAULT_CONFIGS,
                        help=f"comma-separated, of {','.join(CONFIGS)} (64w: k=64 after 64 synchronous steps)")
    parser.add_argument("--data", choices=["both", "synthetic", "sample"], default="both")
    # The shared sample's 2k validation rows leave about 0.002 of error on a difference:
    # a larger real log (Criteo layout) settles what the sample cannot.
    parser.add_argument("--real-train", type=Path, default=SAMPLE / "train_random4584.tsv",
                        help="real Criteo-layout training log for the 'sample' table")
    parser.add_argument("--real-val", type=Path, default=SAMPLE / "train_head1999.tsv",
                        help="real Criteo-layout validation log for the 'sample' table")
    args = parser.parse_args()
    labels = args.configs.split(",")
    unknown = [c for c in labels if c not in CONFIGS]
    if unknown:
        parser.error(f"unknown configurations {unknown}; choose from {list(CONFIGS)}")
    from ctr_lightning.datamodules import write_synthetic_criteo

    if args.data != "sample":
        with tempfile.TemporaryDirectory() as tmp:
            train = write_synthetic_criteo(Path(tmp) / "train.tsv", rows=args.train_rows, seed=0)
            val = write_synthetic_criteo(Path(tmp) / "val.tsv", rows=args.val_rows, seed=0, stream=1)
            table(f"synthetic demo data ({args.train_rows:,} train rows)", train, val, args.epochs, 512, args.seeds,
                  labels)
    if args.data != "synthetic":
        missing = [str(p) for p in (args.real_train, args.real_val) if not p.is_file()]
        if missing and args.data == "sample":
            parser.error(f"real data not found: {missing}")
        if not missing:
            table(f"real Criteo data ({args.real_train.name} -> {args.real_val.name})", args.real_train,
                  args.real_val, args.sample_epochs, args.sample_batch, args.sample_seeds, labels)


if __name__ == "__main__":
    main()
