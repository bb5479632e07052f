"""One rank of bench_kstep.sh: a dense CTR-sized MLP trained with one strategy; rank 0
prints steps/s and the bytes it sent.

The model is the over-arch of configs/criteo.yaml (about 2.1M parameters) on random
features, or on 26 row-wise sharded tables (dim 16, Zipf ids) whose sync is per step
(all-to-alls of ids and pooled rows) or every 16 steps (replicas, deltas to owners).

    MASTER_ADDR=... MASTER_PORT=... WORLD_SIZE=2 NODE_RANK=r LOCAL_RANK=0 \
        python benchmarks/bench_kstep.py --config k16 --steps 48
"""

from __future__ import annotations

import argparse
import json
import os
import time

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ctr_lightning.strategies import KStepAdamStrategy

SIZES = [512, 1024, 1024, 512, 256, 1]


class OverArch(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for a, b in zip(SIZES[:-1], SIZES[1:]):
            layers += [nn.Linear(a, b), nn.ReLU()]
        self.net = nn.Sequential(*layers[:-1])

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.binary_cross_entropy_with_logits(self.net(x).squeeze(-1), y)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


class WithTables(OverArch):
    """The over-arch on 26 sharded embedding tables (dim 16), to compare sparse sync modes."""

    def __init__(self, sparse_sync: str, state_dtype: str = "bfloat16") -> None:
        super().__init__()
        from torchrec.modules.embedding_configs import EmbeddingBagConfig

        from ctr_lightning.embedding import SparseAdam, TieredEmbeddingBagCollection

        self.ebc = TieredEmbeddingBagCollection(
            [EmbeddingBagConfig(name=f"t{i}", embedding_dim=16, num_embeddings=100_000, feature_names=[f"f{i}"])
             for i in range(26)], optimizer=SparseAdam(lr=1e-3), sparse_sync=sparse_sync, sync_every=16,
            sync_state_dtype=state_dtype)
        self.project = nn.Linear(26 * 16, SIZES[0])

    def training_step(self, batch, batch_idx):
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

        ids, y = batch
        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=[f"f{i}" for i in range(26)], values=ids.T.reshape(-1),
            lengths=torch.ones(ids.numel(), dtype=torch.int32))
        x = self.project(self.ebc(kjt).values())
        return F.binary_cross_entropy_with_logits(self.net(x).squeeze(-1), y)


def link_bytes() -> tuple[int, int] | None:
    """Bytes sent and received so far by the interface gloo uses (``GLOO_SOCKET_IFNAME``):
    the veth end of this rank's namespace, as the kernel counts them (TCP/IP headers
    included). None outside bench_kstep.sh's namespaces."""
    name = os.environ.get("GLOO_SOCKET_IFNAME")
    if not name:
        return None
    stats = f"/sys/class/net/{name}/statistics"
    try:
        with open(f"{stats}/tx_bytes") as tx, open(f"{stats}/rx_bytes") as rx:
            return int(tx.read()), int(rx.read())
    except OSError:
        return None


class Clock(pl.Callback):
    """Times the steps after the first few (connection set-up, allocator warm-up), and
    reads the link's byte counters over the same steps."""

    def __init__(self, skip: int = 4) -> None:
        self.skip, self.start, self.steps = skip, 0.0, 0
        self.link_start = self.link_end = None

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if batch_idx + 1 == self.skip:
            self.start = time.perf_counter()
            self.link_start = link_bytes()
        elif batch_idx + 1 > self.skip:
            self.steps += 1
            self.link_end = link_bytes()

    def link_per_step(self) -> tuple[float, float] | None:
        """Bytes sent and received on the link per timed step, measured."""
        if self.link_start is None or self.link_end is None or not self.steps:
            return None
        return tuple((end - start) / self.steps for start, end in zip(self.link_start, self.link_end))


# With tables: (dense k, sparse_sync, the tables' sync_state_dtype). Fully synchronous
# training is emb_sync; emb_k16_fp32 shows what bfloat16 state on the wire saves.
TABLE_CONFIGS = {"emb_sync": (1, "step", "bfloat16"), "emb_step": (16, "step", "bfloat16"),
                 "emb_sparse16": (1, "k_step", "bfloat16"), "emb_k16": (16, "k_step", "bfloat16"),
                 "emb_k16_fp32": (16, "k_step", "float32")}


def strategy(name: str):
    if name == "k1":
        return KStepAdamStrategy(k=1, mode="all")
    if name == "k16":
        return KStepAdamStrategy(k=16, mode="all")
    if name == "k16_fp32":
        return KStepAdamStrategy(k=16, mode="all", moment_dtype="float32")
    if name == "k16_overlap":
        return KStepAdamStrategy(k=16, mode="all", overlap=True)
    if name == "ddp_avg16":
        # Lightning's own periodic model averaging (post-local SGD). On CPU, Lightning registers
        # the post-local-SGD communication hook only for CUDA, so DDP still all-reduces every step.
        from lightning.pytorch.strategies import DDPStrategy
        from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook as post_localSGD

        return DDPStrategy(model_averaging_period=16, ddp_comm_state=post_localSGD.PostLocalSGDState(
            process_group=None, subgroup=None, start_localSGD_iter=8), ddp_comm_hook=post_localSGD.post_localSGD_hook)
    if name in TABLE_CONFIGS:
        return KStepAdamStrategy(k=TABLE_CONFIGS[name][0], mode="all")
    raise ValueError(f"unknown configuration {name!r}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, choices=["k1", "k16", "k16_fp32", "k16_overlap", "ddp_avg16", *TABLE_CONFIGS])
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--batch", type=int, default=256)
    args = parser.parse_args()
    # Two "nodes" share this machine's cores: each gets its share, as on its own machine.
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    torch.manual_seed(0)
    x = torch.randn(args.steps * args.batch * 2, SIZES[0])
    data = TensorDataset(x, (x[:, 0] > 0).float())
    if args.config.startswith("emb"):
        u = torch.rand(args.steps * args.batch * 2, 26, dtype=torch.float64)
        ids = ((((100_001 ** -0.1) - 1) * u + 1) ** (1 / -0.1)).long() - 1  # Zipf s=1.1 over 100k ids
        data = TensorDataset(ids, (ids[:, 0] % 2).float())
    clock = Clock()
    chosen = strategy(args.config)
    trainer = pl.Trainer(accelerator="cpu", devices=1, num_nodes=2, strategy=chosen, max_steps=args.steps,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[clock])
    module = WithTables(*TABLE_CONFIGS[args.config][1:]) if args.config in TABLE_CONFIGS else OverArch()
    trainer.fit(module, DataLoader(data, batch_size=args.batch))
    seconds = time.perf_counter() - clock.start
    params = sum(p.numel() for p in module.parameters())
    tables_sent = module.ebc.comm_bytes() / args.steps if isinstance(module, WithTables) else 0.0
    # The model of the bytes, kept as a cross-check of the measured ones.
    if isinstance(chosen, KStepAdamStrategy):
        modelled = chosen.comm_bytes()[1] / args.steps + tables_sent  # the tables' all-to-alls cross the link too
    else:  # a ring all-reduce of the gradients every step (plus the periodic averages)
        modelled = 2 * (2 - 1) * params * 4 / 2 * (1 + 1 / 16)
    measured = clock.link_per_step()
    if trainer.global_rank == 0:
        print("RESULT " + json.dumps({"config": args.config, "steps_per_s": clock.steps / seconds,
                                      "sent_per_step": measured[0] if measured else None,
                                      "received_per_step": measured[1] if measured else None,
                                      "modelled_per_step": modelled, "table_bytes_per_step": tables_sent,
                                      "params": params}), flush=True)
    if torch.distributed.is_initialized():  # an orderly shutdown of the gloo threads
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
