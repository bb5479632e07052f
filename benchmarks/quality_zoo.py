"""Validation AUC of ctr-lightning's DeepFM, DCN-v2 and Wide & Deep against DeepCTR-Torch's,
trained side by side on the same rows.

Both sides get the same arrays: the rows are read once by ctr-lightning's Criteo reader
(its dense transform, its hashed ids), each feature's ids are numbered by order of first
appearance in the training rows (ids seen only in validation share one "unseen" index),
and every seed shuffles the training rows with one permutation that both sides read in
order. Same embedding size, MLP sizes, optimizer (Adam, one learning rate for everything),
batch size and epochs; no regularisation on either side. Ours trains through a Lightning
Trainer with its fused lazy sparse Adam on the tables; DeepCTR-Torch (the reference,
``pip install -e .[zoo]``) through its own ``fit`` with torch's Adam over every parameter.
Ours takes continuous features as DeepCTR does (``dense_features="raw"``: concatenated to
the deep input, a weight each in the linear term). Where the architectures still differ:
DeepCTR's DCN adds a first-order (linear) term to its logit, FuxiCTR's DCNv2 and ours do
not; DeepCTR initialises embeddings and MLP weights from N(0, 1e-4), ours as torch and the
tables do.

Prints, per dataset and model, the AUC of every seed, the mean and spread, and the paired
difference ours - reference (the issue's target: within 0.003, or better).

    python benchmarks/quality_zoo.py                              # synthetic demo data + real Criteo sample
    python benchmarks/quality_zoo.py --data synthetic --seeds 2 --train-rows 50000
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT.parent / "shared" / "data" / "criteo_kaggle_sample"
# Published full-Criteo figure for context (BARS benchmark, cited in the issue): not a
# target these samples can reach.
PUBLISHED = "published (BARS, full Criteo): DCN-v2 about 0.814 test AUC"


def read_rows(path: str, split: str) -> dict[str, np.ndarray]:
    """Labels, dense [n, 13] and ids [n, 26] of a Criteo-layout file, as ctr-lightning reads them."""
    from ctr_lightning.datamodules import CriteoDataModule

    dm = CriteoDataModule(**{f"{split}_paths": [path]}, batch_size=1 << 16)
    dm.setup("fit" if split == "train" else "validate")
    loader = dm.train_dataloader() if split == "train" else dm.val_dataloader()
    labels, dense, ids = [], [], []
    for batch in loader:
        n = len(batch)
        labels.append(batch.labels.numpy())
        dense.append(batch.dense.numpy())
        ids.append(batch.sparse.values().view(-1, n).T.numpy())  # one-hot features, feature-major
    return {"labels": np.concatenate(labels), "dense": np.concatenate(dense), "ids": np.concatenate(ids)}


def number_ids(train: np.ndarray, val: np.ndarray) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """Each feature's ids as 1..V in order of first appearance in ``train``; 0 for ids only in ``val``."""
    out_train, out_val, sizes = np.empty_like(train), np.empty_like(val), []
    for f in range(train.shape[1]):
        uniques, first, inverse = np.unique(train[:, f], return_index=True, return_inverse=True)
        rank = np.empty(len(uniques), dtype=np.int64)
        rank[np.argsort(first, kind="stable")] = np.arange(1, len(uniques) + 1)
        out_train[:, f] = rank[inverse]
        pos = np.clip(np.searchsorted(uniques, val[:, f]), 0, len(uniques) - 1)
        out_val[:, f] = np.where(uniques[pos] == val[:, f], rank[pos], 0)
        sizes.append(len(uniques) + 1)
    return out_train, out_val, sizes


def auc(labels: np.ndarray, scores: np.ndarray) -> float:
    from sklearn.metrics import roc_auc_score

    return float(roc_auc_score(labels, scores))


def train_reference(name: str, data: dict, sizes: list[int], order: np.ndarray, seed: int, args) -> float:
    import torch
    from deepctr_torch.inputs import DenseFeat, SparseFeat
    from deepctr_torch.models import DCN, WDL, DeepFM

    torch.manual_seed(seed)
    columns = ([SparseFeat(f"C{f + 1}", vocabulary_size=v, embedding_dim=args.dim) for f, v in enumerate(sizes)]
               + [DenseFeat(f"I{j + 1}", 1) for j in range(data["train"]["dense"].shape[1])])
    common = dict(dnn_hidden_units=tuple(args.mlp), l2_reg_linear=0, l2_reg_embedding=0, l2_reg_dnn=0, seed=seed,
                  task="binary", device="cpu")
    if name == "deepfm":
        model = DeepFM(columns, columns, **common)
    elif name == "wide_deep":
        model = WDL(columns, columns, **common)
    else:
        model = DCN(columns, columns, cross_num=args.cross_layers, cross_parameterization="matrix", l2_reg_cross=0,
                    **common)
    model.compile(torch.optim.Adam(model.parameters(), lr=args.lr), "binary_crossentropy")
    quiet = contextlib.redirect_stdout(io.StringIO())  # DeepCTR prints its device and a line per fit

    def inputs(split: dict, rows: np.ndarray | slice) -> dict[str, np.ndarray]:
        x = {f"C{f + 1}": split["numbered"][rows, f] for f in range(len(sizes))}
        x.update({f"I{j + 1}": split["dense"][rows, j] for j in range(split["dense"].shape[1])})
        return x

    train = data["train"]
    with quiet:
        model.fit(inputs(train, order), train["labels"][order], batch_size=args.batch, epochs=args.epochs, verbose=0,
                  shuffle=False)
    scores = model.predict(inputs(data["val"], slice(None)), batch_size=8192).reshape(-1)
    return auc(data["val"]["labels"], scores)


def train_ours(name: str, data: dict, sizes: list[int], order: np.ndarray, seed: int, args) -> float:
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from ctr_lightning import Batch
    from ctr_lightning.datamodules.criteo_schema import SPARSE_NAMES
    from ctr_lightning.models import DCNv2Module, DeepFMModule, WideDeepModule

    def batches(split: dict, rows: np.ndarray) -> list[Batch]:
        out = []
        for start in range(0, len(rows), args.batch):
            r = rows[start : start + args.batch]
            ids = torch.from_numpy(np.ascontiguousarray(split["numbered"][r].T)).reshape(-1)
            out.append(Batch(dense=torch.from_numpy(split["dense"][r]),
                             sparse=KeyedJaggedTensor(keys=list(SPARSE_NAMES), values=ids,
                                                      lengths=torch.ones(len(ids), dtype=torch.int32)),
                             labels=torch.from_numpy(split["labels"][r])))
        return out

    pl.seed_everything(seed, verbose=False)
    model_class = {"deepfm": DeepFMModule, "wide_deep": WideDeepModule, "dcnv2": DCNv2Module}[name]
    extra = {"cross_layers": args.cross_layers, "structure": "parallel"} if name == "dcnv2" else {}
    model = model_class(embedding_dim=args.dim, num_embeddings=int(np.mean(sizes)), learning_rate=args.lr,
                        sparse_learning_rate=args.lr, seed=seed, deep_layer_sizes=args.mlp, dense_features="raw",
                        num_dense_features=data["train"]["dense"].shape[1], **extra)
    loader = DataLoader(batches(data["train"], order), batch_size=None, collate_fn=lambda b: b)
    trainer = pl.Trainer(accelerator="cpu", max_epochs=args.epochs, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, train_dataloaders=loader)
    model.eval()
    with torch.no_grad():
        scores = torch.cat([torch.sigmoid(model(b)) for b in batches(data["val"], np.arange(len(data["val"]["labels"])))])
    return auc(data["val"]["labels"], scores.numpy())


def datasets(args, tmp: Path) -> list[tuple[str, str, str, int, int]]:
    """(label, train file, validation file, epochs, batch size) of each dataset asked for."""
    from ctr_lightning.datamodules import write_synthetic_criteo

    out = []
    if "synthetic" in args.data:
        train = write_synthetic_criteo(tmp / "train.tsv", rows=args.train_rows, seed=0)
        val = write_synthetic_criteo(tmp / "val.tsv", rows=args.val_rows, seed=0, stream=1)
        out.append((f"synthetic {args.train_rows // 1000}k/{args.val_rows // 1000}k", str(train), str(val),
                    args.epochs, args.batch))
    if "sample" in args.data:
        if (SAMPLE / "train_random4584.tsv").is_file():
            out.append(("real Criteo sample 4584/1999", str(SAMPLE / "train_random4584.tsv"),
                        str(SAMPLE / "train_head1999.tsv"), args.sample_epochs, args.sample_batch))
        else:
            print(f"(real Criteo sample not found at {SAMPLE}: skipped)")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default="synthetic,sample")
    parser.add_argument("--models", default="deepfm,dcnv2,wide_deep")
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--train-rows", type=int, default=200_000)
    parser.add_argument("--val-rows", type=int, default=50_000)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--batch", type=int, default=2048)
    parser.add_argument("--sample-epochs", type=int, default=3, help="epochs on the real sample (4,584 rows)")
    parser.add_argument("--sample-batch", type=int, default=256, help="batch size on the real sample")
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--mlp", type=lambda s: [int(x) for x in s.split(",")], default=[256, 128])
    parser.add_argument("--cross-layers", type=int, default=3)
    parser.add_argument("--lr", type=float, default=1e-3)
    args = parser.parse_args()
    try:
        import deepctr_torch  # noqa: F401
        import sklearn  # noqa: F401
    except ImportError as e:
        sys.exit(f"quality_zoo needs the reference: pip install -e '.[zoo]' ({e})")
    warnings.filterwarnings("ignore")
    for name in ("lightning", "lightning.pytorch", "lightning.pytorch.utilities.rank_zero",
                 "lightning.fabric.utilities.seed"):
        logging.getLogger(name).setLevel(logging.ERROR)
    os.environ.setdefault("CTR_LIGHTNING_CACHE", tempfile.mkdtemp(prefix="quality_zoo_index_"))
    print(f"quality_zoo: dim {args.dim}, MLP {args.mlp}, Adam lr {args.lr}, {args.seeds} seeds; DCN-v2: "
          f"{args.cross_layers} cross layers, parallel")
    summary = []
    with tempfile.TemporaryDirectory(prefix="quality_zoo_") as tmp:
        for label, train_path, val_path, epochs, batch in datasets(args, Path(tmp)):
            run = argparse.Namespace(**{**vars(args), "epochs": epochs, "batch": batch})
            data = {"train": read_rows(train_path, "train"), "val": read_rows(val_path, "val")}
            data["train"]["numbered"], data["val"]["numbered"], sizes = number_ids(data["train"]["ids"],
                                                                                     data["val"]["ids"])
            print(f"\n{label}: {len(data['train']['labels'])} train rows, {len(data['val']['labels'])} validation "
                  f"rows, click rate {data['train']['labels'].mean():.3f}, {sum(sizes)} ids; batch {batch}, "
                  f"{epochs} epoch(s)")
            print(f"  {'model':10} {'seed':>4} {'ours':>8} {'DeepCTR':>8} {'diff':>8} {'s ours':>7} {'s ref':>7}")
            for name in args.models.split(","):
                rows = []
                for seed in range(args.seeds):
                    order = np.random.default_rng(seed).permutation(len(data["train"]["labels"]))
                    t0 = time.perf_counter()
                    ours = train_ours(name, data, sizes, order, seed, run)
                    t1 = time.perf_counter()
                    ref = train_reference(name, data, sizes, order, seed, run)
                    t2 = time.perf_counter()
                    rows.append((ours, ref))
                    print(f"  {name:10} {seed:>4} {ours:8.4f} {ref:8.4f} {ours - ref:+8.4f} {t1 - t0:7.1f} "
                          f"{t2 - t1:7.1f}", flush=True)
                ours_auc, ref_auc = np.array(rows).T
                diff = ours_auc - ref_auc
                line = (f"{label:30} {name:10} ours {ours_auc.mean():.4f} +- {ours_auc.std(ddof=1):.4f}  DeepCTR "
                        f"{ref_auc.mean():.4f} +- {ref_auc.std(ddof=1):.4f}  diff {diff.mean():+.4f} "
                        f"(seeds {diff.min():+.4f} .. {diff.max():+.4f})  "
                        f"{'ok' if diff.mean() >= -0.003 else 'BELOW'}")
                summary.append(line)
    print("\nsummary (mean +- sd over seeds; diff = ours - DeepCTR-Torch, paired by seed; target >= -0.003)")
    for line in summary:
        print("  " + line)
    print(f"  {PUBLISHED}")


if __name__ == "__main__":
    main()
