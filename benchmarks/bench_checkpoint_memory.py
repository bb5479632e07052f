"""Resident memory a plain Lightning ``ModelCheckpoint`` adds while it saves a model whose
table lies on SSD: the whole-table state dict (the anchor: what every checkpoint did
before, now only when asked for with ``checkpoint_to_snapshots(None)``) against the
default, where the model adds ``TableSnapshots`` by itself and the rows stream to a
snapshot.

A DLRMModule with one table (dim 64, Adam: 768-byte rows) of ``--rows`` ids, trained once
over every id with a 20k-row DRAM tier, so nearly all rows lie on SSD; then
``Trainer(callbacks=[ModelCheckpoint(every_n_train_steps=1)])`` fits one step and saves.
Each way runs in a process of its own (a freed heap would hide the second one's growth);
the growth is the peak resident memory (sampled every 5 ms) from the end of the step,
just before the ModelCheckpoint saves (Lightning runs checkpoint callbacks last), to the
end of fit, over the level there.

    python benchmarks/bench_checkpoint_memory.py                # 250k rows, 183 MiB of rows
    python benchmarks/bench_checkpoint_memory.py --rows 100000  # a quick look
Files go to bench_out/checkpoint_memory (git-ignored) and are deleted at the end.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WAYS = ("state_dict", "default")


def run_one(way: str, rows: int, work: Path) -> dict:
    """Fill the table, fit one step under a plain ModelCheckpoint, and measure the save."""
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch.utils.data import DataLoader
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    sys.path.insert(0, str(Path(__file__).parent))
    from bench_table_snapshot import PeakMemory

    from ctr_lightning import Batch
    from ctr_lightning.callbacks import TableSnapshots
    from ctr_lightning.embedding import StorageConfig
    from ctr_lightning.models import DLRMModule

    def kjt(ids: torch.Tensor) -> KeyedJaggedTensor:
        return KeyedJaggedTensor.from_lengths_sync(keys=["ads"], values=ids,
                                                   lengths=torch.ones(len(ids), dtype=torch.int32))

    pl.seed_everything(0)
    module = DLRMModule(sparse_feature_names=["ads"], num_dense_features=13, embedding_dim=64, num_embeddings=rows,
                        dense_arch_layer_sizes=[64], over_arch_layer_sizes=[64, 1],
                        storage=StorageConfig(device_rows=20_000, host_rows=0, ssd_dir=str(work / "ssd")))
    if way == "state_dict":
        module.embeddings.checkpoint_to_snapshots(None)  # whole rows in the .ckpt, asked for
    for start in range(0, rows, 10_000):  # a batch's rows must fit the 20k-row DRAM tier
        module.embeddings(kjt(torch.arange(start, min(start + 10_000, rows)))).values().sum().backward()
    stats = module.embeddings.storage_stats()

    class SaveMemory(pl.Callback):
        """Starts watching at the end of the step: the ModelCheckpoint saves after it."""

        def __init__(self) -> None:
            self.watch: PeakMemory | None = None

        def on_train_batch_end(self, *args) -> None:
            if self.watch is None:
                self.watch = PeakMemory().__enter__()

    gen = torch.Generator().manual_seed(0)
    batch = Batch(dense=torch.randn(256, 13, generator=gen), sparse=kjt(torch.randint(0, rows, (256,), generator=gen)),
                  labels=torch.randint(0, 2, (256,), generator=gen).float())
    memory = SaveMemory()
    trainer = pl.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=work,
                         callbacks=[ModelCheckpoint(dirpath=work / "ckpt", every_n_train_steps=1), memory])
    trainer.fit(module, DataLoader([batch], batch_size=None))
    memory.watch.__exit__(None, None, None)
    [ckpt] = (work / "ckpt").glob("*.ckpt")
    extra = [v for k, v in torch.load(ckpt, weights_only=True, mmap=True)["state_dict"].items()
             if k.endswith("_extra_state")]
    snapshots = list((work / "ckpt" / "table_snapshots").glob("*/manifest.json"))
    written = ckpt.stat().st_size + sum(p.stat().st_size for s in snapshots for p in s.parent.iterdir()
                                        if p.suffix in (".rows", ".segments"))
    return {"way": way, "ssd_rows": stats["ssd_rows"], "memory_rows": stats["memory_rows"],
            "growth": memory.watch.growth, "seconds": memory.watch.seconds, "ckpt_bytes": ckpt.stat().st_size,
            "written": written, "snapshot": any("snapshot" in e for e in extra),
            "added": [type(c).__name__ for c in trainer.callbacks if isinstance(c, TableSnapshots)]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=250_000)
    parser.add_argument("--dir", default=str(ROOT / "bench_out" / "checkpoint_memory"))
    parser.add_argument("--way", choices=WAYS, help=argparse.SUPPRESS)  # one way, in a process of its own
    args = parser.parse_args()
    work = Path(args.dir)
    if args.way:
        print("RESULT " + json.dumps(run_one(args.way, args.rows, work / args.way)), flush=True)
        return
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    try:
        results = {}
        for way in WAYS:
            start = time.perf_counter()
            out = subprocess.run([sys.executable, __file__, "--way", way, "--rows", str(args.rows), "--dir", str(work)],
                                 cwd=ROOT, capture_output=True, text=True)
            if out.returncode != 0:
                raise SystemExit(f"{way} failed:\n{out.stderr[-4000:]}")
            results[way] = json.loads(next(line for line in out.stdout.splitlines()
                                           if line.startswith("RESULT "))[len("RESULT "):])
            print(f"({way}: {time.perf_counter() - start:.0f} s with the table's filling)")
        table_bytes = args.rows * 64 * 3 * 4
        first = results["state_dict"]
        print(f"table: {args.rows:,} rows, {table_bytes / 2**20:.0f} MiB of rows; {first['ssd_rows']:,} on SSD, "
              f"{first['memory_rows']:,} in DRAM")
        print(f"{'':<12} {'callbacks added':<16} {'save s':>7} {'resident growth':>16} {'.ckpt':>10} "
              f"{'written':>10}")
        for way, r in results.items():
            print(f"{way:<12} {','.join(r['added']) or '-':<16} {r['seconds']:>7.1f} "
                  f"{r['growth'] / 2**20:>12.0f} MiB {r['ckpt_bytes'] / 2**20:>6.1f} MiB "
                  f"{r['written'] / 2**20:>6.0f} MiB")
        assert not first["snapshot"] and results["default"]["snapshot"]
        default = results["default"]
        print(f"default / whole-table state dict: resident growth while saving {default['growth'] / 2**20:.0f} MiB "
              f"vs {first['growth'] / 2**20:.0f} MiB ({first['growth'] / max(default['growth'], 1):.1f}x less; "
              f"the state dict's is {first['growth'] / table_bytes:.2f}x the table)")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
