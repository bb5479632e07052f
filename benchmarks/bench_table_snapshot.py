"""Saving and loading a table larger than its DRAM budget: the state-dict checkpoint that
gathers every row (the anchor, today's Lightning path) against a streamed table snapshot.

One table (dim 64, Adam: 768-byte rows) is trained on ``--rows`` ids with a 200k-row
DRAM tier, so nearly all of it lies on SSD. Then, in one process, side by side:

- ``state_dict``: ``torch.save(ebc.state_dict())`` and ``load_state_dict`` (every row
  exported into memory, as a Lightning checkpoint does today);
- ``snapshot``: ``ebc.save_tables(dir)`` and ``ebc.load_tables(dir)``;
- ``incremental``: after training on ``--changed`` of the rows again (ids drawn at
  random), ``ebc.save_tables(dir2, incremental=True)``, which writes only the rows
  changed since the snapshot, and loading that chain of two;

each timed, with the growth of resident memory over the process's level before it
(sampled every 5 ms by a thread). Prints one table and the ratios.

    python benchmarks/bench_table_snapshot.py                 # 3M rows, 2.3 GB of rows
    python benchmarks/bench_table_snapshot.py --rows 500000   # a quick look
Files go to bench_out/table_snapshot (git-ignored) and are deleted at the end.
"""

from __future__ import annotations

import argparse
import os
import shutil
import threading
import time
from pathlib import Path

import numpy as np
import torch
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from ctr_lightning.callbacks.storage_monitor import resident_bytes
from ctr_lightning.embedding import SparseAdam, StorageConfig, TieredEmbeddingBagCollection

ROOT = Path(__file__).resolve().parents[1]


class PeakMemory:
    """Highest resident memory while the block runs, above the level at its start."""

    def __enter__(self) -> PeakMemory:
        self.base = self.peak = resident_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()
        self.start = time.perf_counter()
        return self

    def _watch(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, resident_bytes())

    def __exit__(self, *exc) -> None:
        self.seconds = time.perf_counter() - self.start
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, resident_bytes())
        self.growth = self.peak - self.base


def build(work: Path, name: str, rows: int, batch: int) -> TieredEmbeddingBagCollection:
    table = EmbeddingBagConfig(name="ads", embedding_dim=64, num_embeddings=rows, feature_names=["f"])
    return TieredEmbeddingBagCollection([table], optimizer=SparseAdam(lr=0.01), storage=StorageConfig(
        device_rows=200_000, host_rows=0, ssd_dir=str(work / name)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=3_000_000)
    parser.add_argument("--changed", type=float, default=0.05, help="share of rows trained after the snapshot")
    parser.add_argument("--dir", default=str(ROOT / "bench_out" / "table_snapshot"))
    args = parser.parse_args()
    work = Path(args.dir)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    batch = 100_000
    try:
        ebc = build(work, "trained", args.rows, batch)
        for start in range(0, args.rows, batch):
            ids = torch.arange(start, min(start + batch, args.rows))
            kjt = KeyedJaggedTensor.from_lengths_sync(keys=["f"], values=ids, lengths=torch.ones(len(ids),
                                                                                               dtype=torch.int32))
            ebc(kjt).values().sum().backward()
        stats = ebc.storage_stats()
        table_bytes = args.rows * 64 * 3 * 4
        print(f"table: {args.rows:,} rows, {table_bytes / 2**30:.2f} GiB of rows; {stats['ssd_rows']:,} on SSD, "
              f"{stats['memory_rows']:,} in DRAM")
        results = {}
        ebc.checkpoint_to_snapshots(None)  # the anchor: every row in the state dict, asked for
        with PeakMemory() as m:
            torch.save(ebc.state_dict(), work / "state.pt")
        results["state_dict save"] = (m.seconds, m.growth, os.path.getsize(work / "state.pt"))
        loaded = build(work, "loaded_state", args.rows, batch)
        with PeakMemory() as m:
            loaded.load_state_dict(torch.load(work / "state.pt", weights_only=False))
        results["state_dict load"] = (m.seconds, m.growth, 0)
        del loaded
        (work / "state.pt").unlink()
        with PeakMemory() as m:
            manifest = ebc.save_tables(work / "snapshot")
        results["snapshot save"] = (m.seconds, m.growth, sum(f.bytes for f in manifest.files))
        restored = build(work, "loaded_snapshot", args.rows, batch)
        with PeakMemory() as m:
            restored.load_tables(work / "snapshot")
        results["snapshot load"] = (m.seconds, m.growth, 0)
        probe = np.random.default_rng(0).choice(args.rows, 10_000, replace=False)
        assert torch.equal(restored.rows("ads", probe), ebc.rows("ads", probe))
        del restored
        changed = np.random.default_rng(1).choice(args.rows, int(args.changed * args.rows), replace=False)
        for start in range(0, len(changed), batch):
            ids = torch.from_numpy(changed[start : start + batch])
            kjt = KeyedJaggedTensor.from_lengths_sync(keys=["f"], values=ids, lengths=torch.ones(len(ids),
                                                                                               dtype=torch.int32))
            ebc(kjt).values().sum().backward()
        with PeakMemory() as m:
            manifest = ebc.save_tables(work / "incremental", incremental=True)
        assert manifest.parent is not None
        results["incremental save"] = (m.seconds, m.growth, sum(f.bytes for f in manifest.files))
        restored = build(work, "loaded_chain", args.rows, batch)
        with PeakMemory() as m:
            restored.load_tables(work / "incremental")
        results["incremental load"] = (m.seconds, m.growth, 0)
        probe = np.concatenate([probe, changed[:10_000]])
        assert torch.equal(restored.rows("ads", probe), ebc.rows("ads", probe))
        print(f"{'':<16} {'seconds':>8} {'resident memory growth':>24} {'bytes written':>14}")
        for name, (seconds, growth, written) in results.items():
            print(f"{name:<16} {seconds:>8.1f} {growth / 2**30:>20.2f} GiB {written / 2**30:>10.2f} GiB")
        for what in ("save", "load"):
            a, b = results[f"state_dict {what}"], results[f"snapshot {what}"]
            print(f"{what}: snapshot / state_dict: {b[0] / a[0]:.2f}x the time, memory growth "
                  f"{b[1] / 2**20:.0f} MiB vs {a[1] / 2**20:.0f} MiB ({a[1] / max(b[1], 1):.1f}x less)")
        full, delta = results["snapshot save"], results["incremental save"]
        print(f"incremental save after {args.changed:.0%} of the rows changed: {delta[2] / full[2]:.3f}x the bytes "
              f"and {delta[0] / full[0]:.2f}x the time of a full snapshot")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
