"""Score ad logs with a DLRM exported by ``ctr-lightning export``: Parquet tables, a
safetensors dense part, no trainer, no table snapshot.

    ctr-lightning export --ckpt_path runs/demo/version_0/checkpoints/last.ckpt --out serving/v1
    python examples/score_exported.py serving/v1 data/synthetic_criteo/.../val-100000.tsv --rows 8

The tables are read with :func:`ctr_lightning.serving.read_export`, which follows a delta
export (``export --since``) back to its base and applies the chain. A row the export lacks
was never trained (or expired): it reads zeros in a table that admits ids selectively
(``"unstored": "zeros"``), else the model's initial row, recomputed here with
ctr_lightning's initializer (a server may use zeros instead, at a small cost in quality
for brand-new ids).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file
from torchrec.models.dlrm import DLRM
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

from ctr_lightning.embedding.initializer import initial_rows, range_bounds, table_key
from ctr_lightning.serving import read_export


class ExportedTables(torch.nn.Module):
    """torchrec's EmbeddingBagCollection interface (KJT in, KeyedTensor out) over the
    exported tables, with sum pooling, as the DLRM was trained."""

    def __init__(self, export_dir: str | Path, feature_names: list[str]) -> None:
        super().__init__()
        self.model = read_export(export_dir)
        self.tables = self.model.description["tables"]
        self.configs = [EmbeddingBagConfig(name=f"t_{f}", embedding_dim=self.tables[f"t_{f}"]["dim"],
                                           num_embeddings=self.tables[f"t_{f}"]["num_embeddings"],
                                           feature_names=[f]) for f in feature_names]

    def embedding_bag_configs(self) -> list[EmbeddingBagConfig]:
        return self.configs

    def rows(self, table: str, ids: np.ndarray) -> np.ndarray:
        """Weights of ``ids`` of ``table``: from the export, else what a row stored nowhere reads."""
        info = self.tables[table]
        out, found = self.model.tables[table].lookup(ids)
        if info["unstored"] == "zeros" or found.all():
            return out
        # Exports before init_range was written: torchrec's default range.
        low, high = info.get("init_range") or (-math.sqrt(1.0 / info["num_embeddings"]),
                                               math.sqrt(1.0 / info["num_embeddings"]))
        rest = ~found
        out[rest] = initial_rows(info["seed"], np.full(int(rest.sum()), table_key(table)), ids[rest], info["dim"],
                                 *range_bounds(np.full(int(rest.sum()), low), np.full(int(rest.sum()), high)))
        return out

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        pooled = []
        for config in self.configs:
            jt = features[config.feature_names[0]]
            ids = jt.values().numpy()
            bags = torch.repeat_interleave(torch.arange(len(jt.lengths())), jt.lengths().long())
            sums = torch.zeros(len(jt.lengths()), config.embedding_dim)
            pooled.append(sums.index_add_(0, bags, torch.from_numpy(self.rows(config.name, ids))))
        return KeyedTensor(keys=[c.feature_names[0] for c in self.configs],
                           length_per_key=[c.embedding_dim for c in self.configs], values=torch.cat(pooled, dim=1))


def load_model(export_dir: str | Path) -> DLRM:
    """The exported DLRM, ready to score: dense weights from safetensors, tables from Parquet."""
    root = Path(export_dir)
    hp = json.loads((root / "export.json").read_text())["hyper_parameters"]
    tables = ExportedTables(root, list(hp["sparse_feature_names"]))
    model = DLRM(embedding_bag_collection=tables,
                 dense_in_features=hp["num_dense_features"],
                 dense_arch_layer_sizes=[*hp["dense_arch_layer_sizes"], hp["embedding_dim"]],
                 over_arch_layer_sizes=list(hp["over_arch_layer_sizes"]))
    dense = {k.removeprefix("dlrm."): v for k, v in load_file(str(tables.model.dense_path)).items()
             if k.startswith("dlrm.")}
    model.load_state_dict(dense, strict=True)
    return model.eval()


@torch.no_grad()
def score(model: DLRM, dense: torch.Tensor, sparse: KeyedJaggedTensor) -> torch.Tensor:
    """Click probabilities ``[batch]``."""
    return torch.sigmoid(model(dense, sparse).squeeze(-1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("export_dir")
    parser.add_argument("data", help="a Criteo TSV file (as the model was trained on)")
    parser.add_argument("--rows", type=int, default=8)
    args = parser.parse_args()
    logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)  # torchrec's KJT asks fx, which warns
    from ctr_lightning.datamodules import CriteoDataModule

    loader = CriteoDataModule(train_paths=[args.data], batch_size=args.rows).train_dataloader()
    batch = next(iter(loader))
    for p, label in zip(score(load_model(args.export_dir), batch.dense, batch.sparse).tolist(), batch.labels.tolist()):
        print(f"p(click) {p:.4f}   label {int(label)}")


if __name__ == "__main__":
    main()
