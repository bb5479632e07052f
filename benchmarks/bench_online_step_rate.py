"""Step rate of an online run at day 30 against day 7, the two timed side by side (ONE run).

bench_online.py compares the median step of days 29-30 with that of days 6-7, hours apart
in time: on 2 shared cores whatever else runs in between moves the ratio by a third. Here
each configuration trains bench_online's drifting log (the same stream and model) to the end
of day 7 and checkpoints, goes on to the end of day 30 and checkpoints; then both checkpoints
are restored into two modules (each on an SSD directory of its own) and trained alternately,
a step each: the day-7 model on the hours of day 8, the day-30 model on those of day 31, so
load on the machine falls on both alike. Printed per configuration: the median step of each
and their ratio (day 30 / day 7 steps per second), over ``--rounds`` rounds of ``--steps``
steps a side, the order alternating, after ``--warmup`` untimed steps a side.

    (a) no admission, no expiry: tables only grow (3.6x day 7 -> day 30 on the long tail)
    (b) ttl of 3 days
    (c) (b) + admit_after=2 (its counters halved every 3 days, the ttl: Admission's default)
    (d) max_rows per table at (a)'s size at day 7

    python benchmarks/bench_online_step_rate.py [--cohort-size 200000 --configs a,b,c,d]

Files go under bench_out/online_step_rate (git-ignored) and are deleted at the end.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_online import add_stream_arguments, log_data, table_rows  # noqa: E402  (the same stream as bench_online)

from ctr_lightning.callbacks import TableSnapshots  # noqa: E402
from ctr_lightning.datamodules import CriteoDataModule  # noqa: E402
from ctr_lightning.datamodules.drifting_log import DriftingLog  # noqa: E402
from ctr_lightning.embedding import Admission, Expiry, StorageConfig  # noqa: E402
from ctr_lightning.models import DLRMModule  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def model(args, work: Path, name: str, expiry, admission) -> DLRMModule:
    # bench_online's model
    return DLRMModule(embedding_dim=16, num_embeddings=100_000, dense_arch_layer_sizes=[64],
                      over_arch_layer_sizes=[64, 1], learning_rate=1e-3, sparse_learning_rate=0.02,
                      expiry=expiry, admission=admission,
                      storage=StorageConfig(device_rows=args.device_rows, host_rows=0, ssd_dir=str(work / name),
                                            ssd_segment_bytes=64 << 20))


class SaveAt(pl.Callback):
    """A checkpoint after the last step of day 7, and the rows stored per table then."""

    def __init__(self, step: int, path: Path) -> None:
        self.step, self.path = step, path
        self.rows: dict[str, int] = {}

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)
            self.rows = table_rows(module.embeddings)


def train(name: str, args, work: Path, expiry, admission) -> tuple[Path, Path, dict[str, int]]:
    """30 days online; returns the checkpoints at the end of day 7 and day 30, and the rows per table at day 7."""
    pl.seed_everything(0)
    h = args.hours_per_day
    day7, day30 = work / f"{name}-day7.ckpt", work / f"{name}-day30.ckpt"
    save = SaveAt(7 * h, day7)
    trainer = pl.Trainer(accelerator="cpu", max_epochs=-1, reload_dataloaders_every_n_epochs=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, callbacks=[save, TableSnapshots(root=str(work / f"{name}-snapshots"))])
    trainer.fit(model(args, work, f"ssd_{name}", expiry, admission), datamodule=log_data(args, work))
    trainer.save_checkpoint(day30)
    return day7, day30, save.rows


def restored(args, work: Path, name: str, ckpt: Path, expiry, admission) -> tuple[DLRMModule, torch.optim.Optimizer]:
    module = model(args, work, name, expiry, admission)
    saved = torch.load(ckpt, map_location="cpu", weights_only=False)
    module.load_state_dict(saved["state_dict"])
    optimizer = module.configure_optimizers()
    optimizer.load_state_dict(saved["optimizer_states"][0])
    module.train()
    return module, optimizer


def hours(args, work: Path, day: int) -> list:
    """The batches of ``day``'s hours (one an hour), read as the online run reads them."""
    log = DriftingLog(seed=0, rows_per_hour=args.rows_per_hour, cohort_size=args.cohort_size)
    out = []
    for hour in range(args.hours_per_day):
        data = CriteoDataModule(train_paths=str(log.write_hour(work / "replay", day, hour) / "part-00000.tsv"),
                                batch_size=args.rows_per_hour, partition_time=True)
        data.setup("fit")
        out.extend(data.train_dataloader())
    return out


def step(module: DLRMModule, optimizer: torch.optim.Optimizer, batch) -> float:
    """One training step as CTRModule.training_step takes it (the tables update in backward); its seconds."""
    start = time.perf_counter()
    module.embeddings.observe_labels(batch.labels)
    module.embeddings.observe_event_time(float(batch.event_time.max()))
    loss = F.binary_cross_entropy_with_logits(module(batch), batch.labels)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return time.perf_counter() - start


def compare(name: str, args, work: Path, ckpts: tuple[Path, Path], expiry, admission) -> dict[str, float]:
    early, late = (restored(args, work, f"replay_{name}_{d}", c, expiry, admission) for d, c in zip((7, 30), ckpts))
    batches = {7: hours(args, work, 7), 30: hours(args, work, 30)}  # days 8 and 31
    # First both train --warmup steps untimed: a restored SSD log first deletes the records of
    # rows gone that its snapshot kept (the day-30 model's cleaner drops 3x the day-7 model's
    # records in its first 40 steps, and steps 20% slower then; until it is done).
    for k in range(args.warmup):
        for d in ((7, 30) if k % 2 == 0 else (30, 7)):
            step(*(early if d == 7 else late), batches[d][k % len(batches[d])])
    times: dict[int, list[float]] = {7: [], 30: []}
    for r in range(args.rounds):
        for k in range(args.steps):
            i = (args.warmup + r * args.steps + k) % len(batches[7])
            order = (7, 30) if (r + k) % 2 == 0 else (30, 7)
            for d in order:
                module, optimizer = early if d == 7 else late
                times[d].append(step(module, optimizer, batches[d][i]))
    med = {d: float(np.median(t)) for d, t in times.items()}
    return {"config": name, "step_s_day7": med[7], "step_s_day30": med[30], "ratio": med[7] / med[30]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_stream_arguments(parser)
    parser.add_argument("--configs", default="a,b,c,d")
    parser.add_argument("--steps", type=int, default=24, help="timed steps a side per round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=48, help="untimed steps a side first")
    parser.add_argument("--work", default=str(ROOT / "bench_out" / "online_step_rate"))
    args = parser.parse_args()
    args.criteo = None
    work = Path(args.work)
    print(f"free disk: {shutil.disk_usage(work.parent if work.parent.exists() else ROOT).free / 2**30:.1f} GiB",
          flush=True)
    work.mkdir(parents=True, exist_ok=True)
    log_data(args, work).prepare_data()
    ttl = Expiry(ttl=3 * args.hours_per_day)
    settings = {"a": (None, None), "b": (ttl, None), "c": (ttl, Admission(admit_after=2))}
    results = []
    try:
        wanted = args.configs.split(",")
        for name in [c for c in ("a", "b", "c", "d") if c in wanted or (c == "a" and "d" in wanted)]:
            if name == "d":
                settings["d"] = ({n: Expiry(max_rows=max(rows, args.rows_per_hour)) for n, rows in caps.items()}, None)
            day7, day30, rows = train(name, args, work, *settings[name])
            if name == "a":
                caps = rows
            result = compare(name, args, work, (day7, day30), *settings[name])
            print(result, flush=True)
            results.append(result)
            for pattern in (f"{name}-*", f"ssd_{name}", f"replay_{name}_*"):  # the disk is shared
                for path in work.glob(pattern):
                    shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"\nconfig  median step day 7 / day 30 (s)  steps/s day 30 / day 7  ({args.rounds} rounds of "
          f"{args.steps} steps a side, alternating)")
    for r in results:
        print(f"  ({r['config']})   {r['step_s_day7']:.3f} / {r['step_s_day30']:.3f}   {r['ratio']:.2f}")


if __name__ == "__main__":
    main()
