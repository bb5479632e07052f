"""An online run over simulated days, five ways, on the same drifting hourly log (ONE run):

    (a) no admission, no expiry (the anchor: tables only grow)
    (b) ttl of 3 days
    (c) (b) + admit_after=2 (its counters halved every 3 days, the ttl: Admission's default)
    (d) max_rows per table at (a)'s size at day 7
    (e) (c) with counters that are never halved (Admission(halve_every=0))

The log (datamodules/drifting_log.py): each day 20% of the lookups are ids born that day,
older ids fade (popularity_decay a day) and 10% of the ids take a new click rate a day.
Each day's new ids come from a cohort of 200,000 a feature (--cohort-size), so most of them
are seen once, as in real logs; --cohort-size 20000 makes most of them recur.
Each hour is one file and one training step, followed in partition order (follow mode),
scored before it trains (progressive validation). Per configuration it prints rows stored
and SSD bytes at days 7 and 30 and their ratio, the median step rate of days 29-30 against
days 6-7 (by wall time, and by the process's CPU time, which other processes on shared cores
barely move), the progressive AUC over days 8-30, rows stored against (b), and the longest step
after the first day (which compiles the kernels) against the median. Then, on (b)'s tables at day 20, delta exports after 1, 2, 4, 8 steps against a full
export: the share of rows changed and the bytes written.

    python benchmarks/bench_online.py [--days 30 --rows-per-hour 8192 --cohort-size 200000 --configs a,b,c,d,e]

Files go under bench_out/online (git-ignored) and are deleted at the end (--keep keeps them).
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import torch
from torchmetrics.classification import BinaryAUROC

from ctr_lightning.callbacks import TableSnapshots
from ctr_lightning.datamodules import CriteoDataModule, DriftingLogDataModule
from ctr_lightning.datamodules.drifting_log import partition
from ctr_lightning.embedding import Admission, Expiry, StorageConfig
from ctr_lightning.models import DLRMModule
from ctr_lightning.serving_export import export_for_serving

ROOT = Path(__file__).resolve().parents[1]


class Probe(pl.Callback):
    """Per step its wall time and the forward's logits and labels (before the update: the
    progressive score); at the end of each day the rows and SSD bytes stored."""

    def __init__(self, hours_per_day: int, export_at: int | None, work: Path) -> None:
        self.hours, self.export_at, self.work = hours_per_day, export_at, work
        self.step_seconds: list[float] = []
        self.step_cpu_seconds: list[float] = []
        self.scores: list[tuple[np.ndarray, np.ndarray]] = []
        self.days: list[dict[str, float]] = []
        self.table_rows_day7: dict[str, int] = {}
        self.exports: list[dict[str, float]] = []
        self._logits = None

    def on_fit_start(self, trainer, module):
        module.register_forward_hook(lambda m, a, out: setattr(self, "_logits", out.detach()) if m.training else None)

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self._start, self._start_cpu = time.perf_counter(), time.process_time()

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.step_seconds.append(time.perf_counter() - self._start)
        self.step_cpu_seconds.append(time.process_time() - self._start_cpu)
        self.scores.append((self._logits.float().reshape(-1).numpy().copy(), batch.labels.numpy().copy()))
        step = trainer.global_step
        if step % self.hours == 0:
            ebc = module.embeddings
            storage = ebc.storage_stats()
            counts = ebc.expiry_counts()
            rows = (sum(c["rows"] for c in counts.values()) if counts
                    else storage["ssd_rows"] + storage["memory_rows"])
            self.days.append({"day": step // self.hours, "rows": rows, "ssd_bytes": storage["ssd_bytes"]})
            if step // self.hours == 7:
                self.table_rows_day7 = table_rows(ebc)
        if self.export_at is not None and step in [self.export_at + k for k in (0, 1, 2, 4, 8)]:
            self.exports.append(export(trainer, self.work, step, self.export_at))


def log_data(args, work: Path) -> CriteoDataModule:
    if args.criteo:
        return CriteoDataModule(train_paths=str(work / "criteo_slices"), batch_size=args.rows_per_hour, follow=True,
                                poll_seconds=0.05, idle_timeout=0.5)
    return DriftingLogDataModule(data_dir=str(work / "log"), days=args.days, hours_per_day=args.hours_per_day,
                                 rows_per_hour=args.rows_per_hour, cohort_size=args.cohort_size,
                                 batch_size=args.rows_per_hour, poll_seconds=0.05, idle_timeout=0.5)


def cut_criteo(path: Path, work: Path, slices: int) -> int:
    """The real Criteo sample cut, in its own order, into ``slices`` hourly partitions;
    returns the rows a slice."""
    lines = path.read_bytes().splitlines(keepends=True)
    per = len(lines) // slices
    for k in range(slices):
        part = work / "criteo_slices" / partition(k, 0)
        part.mkdir(parents=True, exist_ok=True)
        (part / "part-00000.tsv").write_bytes(b"".join(lines[k * per : (k + 1) * per]))
        (part / "_SUCCESS").touch()
    return per


def table_rows(ebc) -> dict[str, int]:
    """Rows stored per table now (a scan of every tier)."""
    out: dict[str, int] = {}
    for group in ebc._built().groups:
        counts = np.zeros(len(group.names), dtype=np.int64)
        for tables, _, _ in group.export_chunks():
            counts += np.bincount(tables, minlength=len(group.names))
        out.update({name: int(c) for name, c in zip(group.names, counts)})
    return out


def export(trainer, work: Path, step: int, base_step: int) -> dict[str, float]:
    ckpt = work / f"export-{step}.ckpt"
    trainer.save_checkpoint(ckpt)
    out = work / "exports" / str(step)
    since = None if step == base_step else work / "exports" / str(base_step)
    described = export_for_serving(ckpt, out, since=since)
    ckpt.unlink()
    size = sum(f.stat().st_size for f in (out / "tables").rglob("*.parquet"))
    return {"step": step, "rows": sum(t["rows"] for t in described["tables"].values()), "bytes": size}


def run(name: str, args, work: Path, expiry, admission, export_at: int | None = None) -> dict:
    pl.seed_everything(0)
    data = log_data(args, work)  # a DataModule of its own: follow mode keeps the hours it took
    model = DLRMModule(embedding_dim=16, num_embeddings=100_000, dense_arch_layer_sizes=[64],
                       over_arch_layer_sizes=[64, 1], learning_rate=1e-3, sparse_learning_rate=0.02,
                       expiry=expiry, admission=admission,
                       storage=StorageConfig(device_rows=args.device_rows, host_rows=0,
                                             ssd_dir=str(work / f"ssd_{name}"), ssd_segment_bytes=64 << 20))
    probe = Probe(args.hours_per_day, export_at, work)
    trainer = pl.Trainer(accelerator="cpu", max_epochs=-1, reload_dataloaders_every_n_epochs=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0,
                         callbacks=[probe, *([TableSnapshots(root=str(work / "snapshots"))] if export_at else [])])
    start = time.perf_counter()
    trainer.fit(model, datamodule=data)
    seconds = np.array(probe.step_seconds)
    cpu = np.array(probe.step_cpu_seconds)
    h = args.hours_per_day
    day = {d["day"]: d for d in probe.days}
    auc = BinaryAUROC()
    late = probe.scores[8 * h:]
    logits = torch.from_numpy(np.concatenate([s for s, _ in late]))
    labels = torch.from_numpy(np.concatenate([y for _, y in late])).long()
    result = {
        "config": name, "wall_s": time.perf_counter() - start, "steps": len(seconds),
        "rows_day7": day[7]["rows"], "rows_last": day[args.days]["rows"],
        "ssd_day7": day[7]["ssd_bytes"], "ssd_last": day[args.days]["ssd_bytes"],
        # Medians over two days: one day of a shared 2-core machine swings by a third.
        "steps_per_s_day7": 1.0 / float(np.median(seconds[5 * h : 7 * h])),
        "steps_per_s_last": 1.0 / float(np.median(seconds[(args.days - 2) * h : args.days * h])),
        # The process's CPU seconds a step (every thread's: the SSD writer and cleaner too):
        # what other processes on the shared cores do barely moves it.
        "steps_per_cpu_s_day7": 1.0 / float(np.median(cpu[5 * h : 7 * h])),
        "steps_per_cpu_s_last": 1.0 / float(np.median(cpu[(args.days - 2) * h : args.days * h])),
        "auc_days_8_on": float(auc(logits, labels)),
        # The first day holds the JIT compilation of the kernels (numba): a warm-up.
        "longest_over_median": float(seconds[h:].max() / np.median(seconds[h:])),
        "longest_step": h + int(seconds[h:].argmax()) + 1,
        "first_step_over_median": float(seconds[0] / np.median(seconds[h:])),
        "table_rows_day7": probe.table_rows_day7, "exports": probe.exports,
    }
    print(json.dumps({k: v for k, v in result.items() if k != "table_rows_day7"}), flush=True)
    return result


def add_stream_arguments(parser: argparse.ArgumentParser) -> None:
    """The drifting log's and the model's settings, shared with bench_online_step_rate."""
    parser.add_argument("--days", type=int, default=30)
    parser.add_argument("--hours-per-day", type=int, default=24)
    parser.add_argument("--rows-per-hour", type=int, default=8192)
    parser.add_argument("--cohort-size", type=int, default=200000)
    parser.add_argument("--device-rows", type=int, default=20000, help="device-tier rows per table")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_stream_arguments(parser)
    parser.add_argument("--configs", default="a,b,c,d,e")
    parser.add_argument("--work", default=str(ROOT / "bench_out" / "online"))
    parser.add_argument("--keep", action="store_true")
    parser.add_argument("--criteo", default=None,
                        help="a real Criteo file (e.g. ../shared/data/criteo_kaggle_sample/train_head1999.tsv), cut "
                             "in its order into --days slices of one step each, instead of the drifting log")
    args = parser.parse_args()
    work = Path(args.work)
    free = shutil.disk_usage(work.parent if work.parent.exists() else ROOT).free
    print(f"free disk: {free / 2**30:.1f} GiB", flush=True)
    work.mkdir(parents=True, exist_ok=True)
    if args.criteo:  # a slice is a "day" of one step
        args.hours_per_day, args.rows_per_hour = 1, cut_criteo(Path(args.criteo), work, args.days)
        args.device_rows = min(args.device_rows, 4 * args.rows_per_hour)
    else:
        log_data(args, work).prepare_data()
    ttl = Expiry(ttl=3 * args.hours_per_day)
    results = {}
    try:
        wanted = args.configs.split(",")
        if "a" in wanted or "d" in wanted:
            results["a"] = run("a", args, work, None, None)
        if "b" in wanted:
            results["b"] = run("b", args, work, ttl, None, export_at=min(20, args.days - 1) * args.hours_per_day)
        if "c" in wanted:
            results["c"] = run("c", args, work, ttl, Admission(admit_after=2))
        if "e" in wanted:  # (c) with counters that only grow
            results["e"] = run("e", args, work, ttl, Admission(admit_after=2, halve_every=0))
        if "d" in wanted:
            caps = {name: Expiry(max_rows=max(rows, args.rows_per_hour)) for name, rows in
                    results["a"]["table_rows_day7"].items()}
            results["d"] = run("d", args, work, caps, None)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print(f"\nconfig  rows d{args.days}/d7  ssd d{args.days}/d7  steps/s d{args.days}/d7  (per CPU s)  "
          f"AUC d8-{args.days}  rows vs (b)  longest/median after day 1 (step)")
    for name, r in results.items():
        vs_b = r["rows_last"] / results["b"]["rows_last"] if "b" in results else float("nan")
        print(f"  ({name})   {r['rows_last'] / r['rows_day7']:9.2f}  {r['ssd_last'] / max(r['ssd_day7'], 1):10.2f}  "
              f"{r['steps_per_s_last'] / r['steps_per_s_day7']:14.2f}  "
              f"{r['steps_per_cpu_s_last'] / r['steps_per_cpu_s_day7']:11.2f}  {r['auc_days_8_on']:9.4f}  "
              f"{vs_b:11.2f}  {r['longest_over_median']:8.1f} ({r['longest_step']})")
    if "a" in results:
        for name, r in results.items():
            print(f"  AUC ({name}) - (a): {r['auc_days_8_on'] - results['a']['auc_days_8_on']:+.4f}")
    if "b" in results and results["b"]["exports"]:
        full = results["b"]["exports"][0]
        print(f"\ndelta exports on (b) after day {full['step'] // args.hours_per_day} (full: {full['rows']:,} rows, "
              f"{full['bytes'] / 2**20:.1f} MiB):")
        for e in results["b"]["exports"][1:]:
            print(f"  after {e['step'] - full['step']} steps: {e['rows'] / full['rows']:.1%} of the rows changed, "
                  f"{e['bytes'] / full['bytes']:.3f}x the bytes")


if __name__ == "__main__":
    main()
