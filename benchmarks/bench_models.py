"""Training-step speed of every model, ours against the same architecture on TorchRec's
DistributedModelParallel (fused FBGEMM CPU kernel) and on plain ``nn.EmbeddingBag`` +
``SparseAdam``, in ONE run; then the cost of Lightning plus our DataModule over a plain loop.

Every model (DLRM, DCN-v2, DeepFM, Wide & Deep) is built once per implementation from the
same class, so the dense part is the same code; only its table collection differs:
  torchrec  torchrec ``EmbeddingBagCollection`` sharded by ``DistributedModelParallel`` on a
            1-rank gloo group, fused row-wise Adagrad (FBGEMM's CPU kernels have no Adam);
            rows 17 wide are stored 20 wide (FBGEMM wants multiples of 4) and cut after pooling
  plain     one ``nn.EmbeddingBag(sparse=True)`` per table, ``torch.optim.SparseAdam``
  ours      ``TieredEmbeddingBagCollection``, fused lazy Adam, every row in the device tier
and the dense part is trained by ``torch.optim.Adam`` everywhere. Shapes: 26 tables x 100k
rows x dim 16 (17 with the first-order column of DeepFM / Wide & Deep), 13 dense features,
MLPs 512-256, batch 2048, Zipf ids (s=1.1), the same batches for all. Steps are timed in
interleaved passes after a warm-up pass each (the best pass counts), as bench_embedding does.

The Lightning part trains the same DLRM through ``Trainer.fit`` on a ``CriteoDataModule``
reading a synthetic Criteo file (1 worker), against a plain loop over the same rows already
in memory; steps after the first 10 are timed on both. ``--lightning-rounds`` pairs run
alternately (Trainer.fit first, then the plain loop first, ...); the cost is their median,
with its spread.

    python benchmarks/bench_models.py [--models dlrm,dcnv2 --steps 20 --repeats 3]
    python benchmarks/bench_models.py --models "" --lightning-rounds 5   # the Lightning part alone
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import socket
import tempfile
import time
import warnings

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

from ctr_lightning import Batch
from ctr_lightning.datamodules.criteo_schema import NUM_DENSE, SPARSE_NAMES
from ctr_lightning.models import DCNv2Module, DeepFMModule, DLRMModule, WideDeepModule
from ctr_lightning.topology.calibration import zipf_ids

ROWS, DIM, BATCH = 100_000, 16, 2048
MLP = [512, 256]


def build(name: str) -> nn.Module:
    common = dict(embedding_dim=DIM, num_embeddings=ROWS, learning_rate=1e-3, sparse_learning_rate=1e-3)
    if name == "dlrm":
        return DLRMModule(dense_arch_layer_sizes=MLP, over_arch_layer_sizes=[*MLP, 1], **common)
    cls = {"dcnv2": DCNv2Module, "deepfm": DeepFMModule, "wide_deep": WideDeepModule}[name]
    extra = {"cross_layers": 3} if name == "dcnv2" else {}
    return cls(deep_layer_sizes=MLP, **common, **extra)


def zipf_batches(steps: int, seed: int, s: float = 1.1) -> list[Batch]:
    rng = np.random.default_rng(seed)
    f = len(SPARSE_NAMES)
    out = []
    for _ in range(steps):
        ids = torch.from_numpy(zipf_ids(rng, ROWS, f * BATCH, s))
        out.append(Batch(dense=torch.from_numpy(rng.standard_normal((BATCH, NUM_DENSE), dtype=np.float32)),
                         sparse=KeyedJaggedTensor(keys=list(SPARSE_NAMES), values=ids,
                                                  lengths=torch.ones(f * BATCH, dtype=torch.int32)),
                         labels=torch.from_numpy((rng.random(BATCH) < 0.25).astype(np.float32))))
    return out


def swap_tables(model: nn.Module, tables: nn.Module) -> None:
    """Put another collection under the model's dense part (torchrec's DLRM holds its own reference)."""
    model.embeddings = tables
    if hasattr(model, "dlrm"):
        model.dlrm.sparse_arch.embedding_bag_collection = tables


def table_configs(model: nn.Module) -> list[EmbeddingBagConfig]:
    return [EmbeddingBagConfig(name=t.name, embedding_dim=t.embedding_dim, num_embeddings=t.num_embeddings,
                               feature_names=list(t.feature_names)) for t in model.embeddings.embedding_bag_configs()]


class TorchrecTables(nn.Module):
    """torchrec's EBC under DistributedModelParallel. FBGEMM's kernels take widths that are
    multiples of 4: a 17-wide row (16 + the first-order column) is stored 20 wide and cut
    back to 17 after pooling, a cost the anchor carries."""

    def __init__(self, configs: list[EmbeddingBagConfig]) -> None:
        from fbgemm_gpu.split_embedding_configs import EmbOptimType
        from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
        from torchrec.distributed.model_parallel import DistributedModelParallel

        super().__init__()
        if not dist.is_initialized():
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            with socket.socket() as probe:  # a port nothing listens on, so runs side by side do not collide
                probe.bind(("127.0.0.1", 0))
                os.environ.setdefault("MASTER_PORT", str(probe.getsockname()[1]))
            dist.init_process_group("gloo", rank=0, world_size=1)
        self.configs = configs
        self.dim = configs[0].embedding_dim
        self.stored = -(-self.dim // 4) * 4
        padded = [EmbeddingBagConfig(name=t.name, embedding_dim=self.stored, num_embeddings=t.num_embeddings,
                                     feature_names=list(t.feature_names)) for t in configs]
        ebc = EmbeddingBagCollection(tables=padded, device=torch.device("meta"))
        sharder = EmbeddingBagCollectionSharder(fused_params={
            "optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.01})
        self.dmp = DistributedModelParallel(ebc, device=torch.device("cpu"), sharders=[sharder])

    def embedding_bag_configs(self) -> list[EmbeddingBagConfig]:
        return self.configs

    def forward(self, kjt: KeyedJaggedTensor) -> KeyedTensor:
        pooled = self.dmp(kjt)
        pooled = pooled.wait() if hasattr(pooled, "wait") else pooled
        if self.stored == self.dim:
            return pooled
        values = pooled.values().view(-1, len(self.configs), self.stored)[..., : self.dim].reshape(
            -1, len(self.configs) * self.dim)
        return KeyedTensor(keys=pooled.keys(), length_per_key=[self.dim] * len(self.configs), values=values)


class PlainTables(nn.Module):
    """One ``nn.EmbeddingBag(sparse=True)`` per table, pooled into a KeyedTensor as an EBC returns."""

    def __init__(self, configs: list[EmbeddingBagConfig]) -> None:
        super().__init__()
        self.configs = configs
        self.bags = nn.ModuleList(nn.EmbeddingBag(t.num_embeddings, t.embedding_dim, mode="sum", sparse=True)
                                  for t in configs)

    def embedding_bag_configs(self) -> list[EmbeddingBagConfig]:
        return self.configs

    def forward(self, kjt: KeyedJaggedTensor) -> KeyedTensor:
        parts = [bag(jt.values(), jt.offsets()[:-1]) for bag, jt in zip(self.bags, kjt.to_dict().values())]
        keys = [t.feature_names[0] for t in self.configs]
        return KeyedTensor(keys=keys, length_per_key=[t.embedding_dim for t in self.configs],
                           values=torch.cat(parts, dim=1))


def implementation(name: str, kind: str):
    """(model, one training step) for a model on one kind of tables."""
    torch.manual_seed(0)
    model = build(name)
    extra_optimizer = None
    if kind == "torchrec":
        swap_tables(model, TorchrecTables(table_configs(model)))
    elif kind == "plain":
        plain = PlainTables(table_configs(model))
        swap_tables(model, plain)
        extra_optimizer = torch.optim.SparseAdam(plain.parameters(), lr=1e-3)
    dense = torch.optim.Adam(model.dense_parameters(), lr=1e-3)

    def step(batch: Batch) -> None:
        loss = F.binary_cross_entropy_with_logits(model(batch), batch.labels)
        dense.zero_grad(set_to_none=True)
        if extra_optimizer is not None:
            extra_optimizer.zero_grad(set_to_none=True)
        loss.backward()
        dense.step()
        if extra_optimizer is not None:
            extra_optimizer.step()
    return model, step


def time_interleaved(steps: dict[str, object], warmup: list[Batch], batches: list[Batch], repeats: int) -> dict:
    for step in steps.values():
        for b in warmup:
            step(b)
    best = {name: float("inf") for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            start = time.perf_counter()
            for b in batches:
                step(b)
            best[name] = min(best[name], time.perf_counter() - start)
    return {name: len(batches) * BATCH / s for name, s in best.items()}


def lightning_overhead(steps: int, tmp: str, rounds: int) -> list[tuple[float, float]]:
    """``rounds`` pairs of (plain loop, Lightning + CriteoDataModule) examples/s of the DLRM on
    the same file, alternating which of the two runs first (a machine that warms up or
    slows down over the run then favours neither)."""
    import lightning.pytorch as pl

    from ctr_lightning.datamodules import CriteoDataModule, write_synthetic_criteo

    path = write_synthetic_criteo(os.path.join(tmp, "train.tsv"), rows=BATCH * steps, seed=0,
                                  max_cardinality=ROWS)
    warm = 10

    class Clock(pl.Callback):
        start = end = 0.0

        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            if batch_idx == warm:
                self.start = time.perf_counter()

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            self.end = time.perf_counter()

    def with_lightning() -> float:
        dm = CriteoDataModule(train_paths=[str(path)], batch_size=BATCH, num_workers=1)
        torch.manual_seed(0)
        model, clock = build("dlrm"), Clock()
        trainer = pl.Trainer(accelerator="cpu", max_epochs=1, logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False, callbacks=[clock])
        trainer.fit(model, datamodule=dm)
        return (trainer.global_step - warm) * BATCH / (clock.end - clock.start)

    dm = CriteoDataModule(train_paths=[str(path)], batch_size=BATCH, num_workers=1)
    dm.setup("fit")
    batches = list(dm.train_dataloader())

    def plain_loop() -> float:
        torch.manual_seed(0)
        model = build("dlrm")
        dense = torch.optim.Adam(model.dense_parameters(), lr=1e-3)
        for i, batch in enumerate(batches):
            if i == warm:
                start = time.perf_counter()
            loss = F.binary_cross_entropy_with_logits(model(batch), batch.labels)
            dense.zero_grad(set_to_none=True)
            loss.backward()
            dense.step()
        return (len(batches) - warm) * BATCH / (time.perf_counter() - start)

    out = []
    for r in range(rounds):
        if r % 2:
            plain = plain_loop()
            lightning = with_lightning()
        else:
            lightning = with_lightning()
            plain = plain_loop()
        out.append((plain, lightning))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="dlrm,dcnv2,deepfm,wide_deep")
    parser.add_argument("--kinds", default="torchrec,plain,ours")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--lightning-steps", type=int, default=60, help="0 skips the Lightning part")
    parser.add_argument("--lightning-rounds", type=int, default=5,
                        help="pairs of (plain loop, Trainer.fit), alternating which goes first")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)
    for name in ("lightning", "lightning.pytorch", "lightning.pytorch.utilities.rank_zero"):
        logging.getLogger(name).setLevel(logging.ERROR)
    os.environ.setdefault("CTR_LIGHTNING_CACHE", tempfile.mkdtemp(prefix="bench_models_index_"))
    print(f"bench_models: 26 tables x {ROWS} rows x dim {DIM}, MLPs {MLP}, batch {BATCH}, {args.steps} timed "
          f"steps x {args.repeats} interleaved rounds (best), torch threads {torch.get_num_threads()}")
    warmup, batches = zipf_batches(5, seed=1), zipf_batches(args.steps, seed=2)
    kinds, models = args.kinds.split(","), [m for m in args.models.split(",") if m]  # "": the Lightning part alone
    if models:
        print(f"  {'model':10} " + " ".join(f"{k + ' ex/s':>14}" for k in kinds)
              + ("  ours/torchrec  ours/plain" if "ours" in kinds else ""))
    for name in models:
        steps = {kind: implementation(name, kind)[1] for kind in kinds}
        rates = time_interleaved(steps, warmup, batches, args.repeats)
        line = f"  {name:10} " + " ".join(f"{rates[k]:14,.0f}" for k in kinds)
        if "ours" in kinds:
            line += "".join(f"  {rates['ours'] / rates[k]:12.2f}x" for k in ("torchrec", "plain") if k in rates)
        print(line, flush=True)
    if args.lightning_steps:
        with tempfile.TemporaryDirectory(prefix="bench_models_") as tmp:
            pairs = lightning_overhead(args.lightning_steps, tmp, args.lightning_rounds)
        costs = [1 - lightning / plain for plain, lightning in pairs]
        for r, ((plain, lightning), cost) in enumerate(zip(pairs, costs)):
            first = "plain loop" if r % 2 else "Trainer.fit"
            print(f"  round {r + 1} ({first} first): plain loop over batches in memory {plain:,.0f} ex/s; "
                  f"Trainer.fit + CriteoDataModule {lightning:,.0f} ex/s: cost {cost:.1%}")
        print(f"  Lightning and the DataModule cost {statistics.median(costs):.1%} (median of {len(costs)} "
              f"alternated rounds; {min(costs):.1%} to {max(costs):.1%})")


if __name__ == "__main__":
    main()
