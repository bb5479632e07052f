"""Tables larger than this machine's RAM, trained end to end through the command users run.

Runs ``ctr-lightning fit --config configs/out_of_core.yaml`` (a DLRM, dim 64, Adam, on an
endless stream whose tables keep growing) until the rows on SSD reach ``--target`` (by
default 1.5x the machine's RAM), with a callback that records every step's time, the
process's resident memory and what the tiers hold. Then, side by side on this machine:

- the same config with every row in memory, for as many steps as the first 10% of the
  out-of-core run (it stops long before it would exceed RAM);
- one table alone: a step whose ids are 50% new against one of the same size whose ids all
  exist.

It also checkpoints through TableSnapshots when the run reaches its size (every row),
trains 50 more steps and checkpoints again (incremental), then resumes from that
checkpoint in a new process (``fit --ckpt_path``, other SSD files), and reports each
one's time, bytes written, bytes shared with the SSD files (sealed segments, hard-linked),
the disk space it took and peak resident memory.

It prints one table: memory (resident against the DRAM budget, index bytes per SSD row),
speed (last 10% against first 10%, first 10% against all in memory), disk (SSD files
against live rows, the longest step and where it went) and new rows.

    python benchmarks/bench_out_of_core.py                       # the full run (tens of GB, an hour or more)
    python benchmarks/bench_out_of_core.py --target 4GB          # a quick look
Files go to bench_out/out_of_core (git-ignored) and are deleted at the end (--keep keeps them).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import shlex
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))


def _stats(collections) -> tuple[dict[str, int], dict[str, int]]:
    from ctr_lightning.embedding.counters import sum_counters

    return sum_counters(c.storage_stats() for c in collections), sum_counters(c.tier_stats() for c in collections)


try:  # the recorder is loaded by the CLI (class_path bench_out_of_core.StepRecorder)
    import lightning.pytorch as pl

    from ctr_lightning.callbacks.storage_monitor import resident_bytes
    from ctr_lightning.embedding import TieredEmbeddingBagCollection

    class StepRecorder(pl.Callback):
        """Writes one JSON line a step: its time, resident memory, and every ``every``
        steps what the tiers hold and their cumulative time counters."""

        def __init__(self, path: str, every: int = 10) -> None:
            self.path, self.every = path, every
            self._file = None
            self._start = 0.0
            self._end: float | None = None

        def on_train_start(self, trainer, module):
            self._collections = [m for m in module.modules() if isinstance(m, TieredEmbeddingBagCollection)]
            self._file = open(self.path, "w")

        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            self._start = time.perf_counter()

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            end = time.perf_counter()
            # "seconds": the step (forward, backward, optimizer); "wall": since the last
            # step ended (with the batch's loading and every callback).
            record = {"step": trainer.global_step, "seconds": end - self._start,
                      "wall": end - (self._end or self._start), "rss": resident_bytes()}
            self._end = end
            if trainer.global_step % self.every == 0:
                record["storage"], record["counters"] = _stats(self._collections)
                record["process"] = _process_counters()
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()

        def on_train_end(self, trainer, module):
            self._file.close()

    def _process_counters() -> dict[str, float]:
        """Bytes this process read from the disk (page-cache misses) and its CPU seconds."""
        io = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines() if line)
        cpu = os.times()
        return {"disk_read_bytes": int(io["read_bytes"]), "cpu_s": cpu.user + cpu.system, "system_s": cpu.system}

    def _peak_resident() -> int:
        """The process's peak resident memory since the last :func:`_reset_peak`."""
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
        return 0

    def _reset_peak() -> None:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current resident size

    class CheckpointAtTarget(pl.Callback):
        """When the run reaches its size (StorageMonitor stops it), saves a checkpoint
        (TableSnapshots: every row), trains ``more`` steps, saves again (incremental),
        then lets it stop. Writes what each save took to ``path`` as JSON."""

        def __init__(self, path: str, dirpath: str, more: int = 50) -> None:
            self.path, self.dirpath, self.more = path, Path(dirpath), more
            self.phase, self.results, self.stop_at = "grow", {}, 0

        def _save(self, trainer, name: str) -> None:
            from ctr_lightning.callbacks.tiered_collections import tiered_collections

            collections = tiered_collections(trainer.lightning_module, "bench")
            from ctr_lightning.embedding.snapshots.table_snapshot import SnapshotManifest

            _reset_peak()
            disk_before = shutil.disk_usage(self.dirpath.parent).used
            base, start = resident_bytes(), time.perf_counter()
            trainer.save_checkpoint(self.dirpath / f"{name}.ckpt")
            seconds = time.perf_counter() - start
            manifest = SnapshotManifest.read(collections[0].current_snapshot())
            self.results[name] = {"seconds": seconds, "bytes": sum(f.bytes for f in manifest.files),
                                  "shared": sum(f.shared_bytes for f in manifest.files),
                                  "disk": shutil.disk_usage(self.dirpath.parent).used - disk_before,
                                  "rss_before": base, "rss_peak": _peak_resident(), "step": trainer.global_step,
                                  "storage": _stats(collections)[0]}
            Path(self.path).write_text(json.dumps(self.results))

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if self.phase == "grow" and trainer.should_stop:
                self._save(trainer, "full")
                trainer.should_stop, self.phase = False, "more"
                self.stop_at = trainer.global_step + self.more
            elif self.phase == "more" and trainer.global_step >= self.stop_at:
                self._save(trainer, "incremental")
                trainer.should_stop, self.phase = True, "done"
            elif self.phase == "more":
                trainer.should_stop = False  # StorageMonitor asks again every few steps

    class ResumeTimer(pl.Callback):
        """Time from the process's start to its first training step after a resume, and
        the peak resident memory until then."""

        def __init__(self, path: str, started: float) -> None:
            self.path, self.started = path, started  # time.time() when the command was started

        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            if not Path(self.path).exists():
                Path(self.path).write_text(json.dumps({"seconds": time.time() - self.started,
                                                       "rss_peak": _peak_resident(), "rss": resident_bytes()}))
                trainer.should_stop = True
except ImportError:  # pragma: no cover
    pass


def run_fit(work: Path, name: str, extra: list[str], env: dict[str, str | None] | None = None) -> float:
    """Time ``ctr-lightning fit`` of the out-of-core config; ``env`` sets (None: removes) variables."""
    env = {k: v for k, v in dict(os.environ, PYTHONPATH=str(ROOT / "benchmarks"), PYTHONWARNINGS="ignore",
                                 **(env or {})).items() if v is not None}
    command = [sys.executable, "-m", "ctr_lightning.cli", "fit", "--config", str(ROOT / "configs/out_of_core.yaml"),
               "--trainer.logger.init_args.save_dir", str(work / "runs"), "--trainer.logger.init_args.name", name,
               "--trainer.enable_progress_bar", "false",
               # The config's ModelCheckpoint goes with its callbacks list, which each run
               # replaces: without this Lightning would add its own, and the in-memory run
               # would gather whole tables into a .ckpt. The saves measured are CheckpointAtTarget's.
               "--trainer.enable_checkpointing", "false", *extra]
    start = time.perf_counter()
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"{name} run failed:\n{result.stderr[-4000:]}")
    return time.perf_counter() - start


def load(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()]


def new_row_steps(work: Path, rows: int, batch: int, steps: int) -> tuple[float, float]:
    """Steps/s of one table (dim 64, Adam, a 200k-row device tier over SSD) with ids 50% new
    against ids all stored, interleaved; the best of ``steps`` each."""
    import torch
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from ctr_lightning.embedding import SparseAdam, StorageConfig, TieredEmbeddingBagCollection

    table = EmbeddingBagConfig(name="t", embedding_dim=64, num_embeddings=rows * 4, feature_names=["f"])
    ebc = TieredEmbeddingBagCollection([table], optimizer=SparseAdam(lr=0.01), storage=StorageConfig(
        device_rows=200_000, host_rows=0, ssd_dir=str(work / "new_rows_ssd")))
    rng = np.random.default_rng(0)

    def step(ids: np.ndarray) -> float:
        kjt = KeyedJaggedTensor.from_lengths_sync(keys=["f"], values=torch.from_numpy(ids),
                                                  lengths=torch.ones(len(ids), dtype=torch.int32))
        start = time.perf_counter()
        ebc(kjt).values().sum().backward()
        return time.perf_counter() - start

    for start in range(0, rows, batch):  # rows stored first: most on SSD, 200k in memory
        step(np.arange(start, min(start + batch, rows), dtype=np.int64))
    fresh = rows
    best_new = best_old = float("inf")
    for _ in range(steps):
        old = rng.choice(rows, size=batch, replace=False).astype(np.int64)
        best_old = min(best_old, step(old))
        half = rng.choice(rows, size=batch // 2, replace=False).astype(np.int64)
        ids = np.concatenate([half, np.arange(fresh, fresh + batch - batch // 2, dtype=np.int64)])
        fresh += batch - batch // 2
        best_new = min(best_new, step(rng.permutation(ids)))
    return 1 / best_new, 1 / best_old


def report_checkpoints(saves: Path, resume: Path, budget: int) -> None:
    """Save and resume at the largest size: time, bytes written, resident memory."""
    done, resumed = json.loads(saves.read_text()), json.loads(resume.read_text())
    live = done["full"]["storage"]["ssd_live_bytes"]
    print(f"\ncheckpoints at the largest size ({live / 2**30:.1f} GiB of live rows on SSD; DRAM budget "
          f"{budget / 2**30:.2f} GiB):")
    for name, r in done.items():
        print(f"  {name} save at step {r['step']}: {r['seconds']:.1f} s, {r['bytes'] / 2**30:.2f} GiB written "
              f"({r['bytes'] / live:.3f}x the live rows), {r.get('shared', 0) / 2**30:.2f} GiB of SSD segments "
              f"shared by hard link, disk used +{r.get('disk', 0) / 2**30:.2f} GiB, peak resident "
              f"{r['rss_peak'] / 2**30:.2f} GiB (before {r['rss_before'] / 2**30:.2f} GiB)")
    print(f"  resume (fit --ckpt_path: command start to first step, the chain of 2 loaded): "
          f"{resumed['seconds']:.1f} s, peak resident {resumed['rss_peak'] / 2**30:.2f} GiB")


def rate(seconds: np.ndarray) -> float:
    """Steps/s over a stretch of steps: their number over their wall time (slow steps count,
    as they do in a run)."""
    return len(seconds) / seconds.sum()


def _stretches(steps: list[dict], seconds: np.ndarray, snapshots: list[dict],
               warm: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """Step times of the first 10% (after ``warm`` steps), the last 10%, and the first 10%
    from the step the memory tier is full and rows start leaving for the SSD (that step)."""
    tenth = max(1, (len(steps) - warm) // 10)
    full = next((s["step"] for s in snapshots if s["storage"]["ssd_rows"] > 0), steps[warm]["step"])
    start = next(i for i, s in enumerate(steps) if s["step"] >= full)
    return (seconds[warm : warm + tenth], seconds[-tenth:],
            seconds[start : start + max(1, (len(steps) - start) // 10)], full)


def _run_log(log: Path, exclude: set[int] = frozenset()) -> tuple[list[dict], np.ndarray, int, list[dict]]:
    """A run's steps (less ``exclude``), their wall times, the warm-up steps left out of
    the first 10%, and the steps that carry tier snapshots."""
    steps = [s for s in load(log) if s["step"] not in exclude]
    # A step's wall time: from the end of the step before (loading, reads ahead, callbacks).
    seconds = np.array([s["wall"] for s in steps])
    return steps, seconds, min(20, len(steps) // 10), [s for s in steps if "storage" in s]


def _per_100_steps(steps: list[dict], snapshots: list[dict], part: list[dict]) -> dict[str, float] | None:
    """Per 100 steps of ``part``, between the first and last snapshots inside it: wall and
    CPU seconds, the tiers' time counters in seconds, and MiB a step read from the disk;
    None with fewer than two snapshots inside."""
    inside = [s for s in snapshots if "process" in s and part[0]["step"] <= s["step"] <= part[-1]["step"]]
    if len(inside) < 2:
        return None
    a, b = inside[0], inside[-1]
    n = b["step"] - a["step"]
    out = {"wall": sum(s["wall"] for s in steps if a["step"] < s["step"] <= b["step"]) * 100 / n}
    out.update({k: (b["process"][k] - a["process"][k]) * 100 / n for k in ("cpu_s", "system_s")})
    out.update({k: (b["counters"].get(k, 0) - a["counters"].get(k, 0)) / 1e6 * 100 / n
                for k in ("ssd_wait_us", "evict_us", "ssd_stall_us", "ssd_write_us", "ssd_clean_us")})
    out["disk_mib"] = (b["process"]["disk_read_bytes"] - a["process"]["disk_read_bytes"]) / n / 2**20
    return out


def compare_spinning(passive: Path, spinning: Path, minutes: tuple[float, float]) -> None:
    """The same out-of-core run with OpenMP threads passive (the package default) and
    spinning (libgomp's default, GOMP_SPINCOUNT=300000), side by side."""
    print("\nOpenMP threads passive (default) vs spinning (GOMP_SPINCOUNT=300000), the same run twice:")
    got = {}
    for name, log, took in (("passive", passive, minutes[0]), ("spinning", spinning, minutes[1])):
        steps, seconds, warm, snapshots = _run_log(log)
        first, last, settled, _ = _stretches(steps, seconds, snapshots, warm)
        cpu = (_per_100_steps(steps, snapshots, steps[-len(last):]) or {"cpu_s": float("nan")})["cpu_s"]
        got[name] = rate(last)
        print(f"  {name:<8} {took:5.1f} min, {len(steps)} steps; last 10% {rate(last):.2f} steps/s, "
              f"{cpu:.1f} CPU s per 100 steps; last / first 10% {rate(last) / rate(first):.2f}x, "
              f"from DRAM full {rate(last) / rate(settled):.2f}x")
    print(f"  last 10%, passive / spinning: {got['passive'] / got['spinning']:.2f}x steps/s; whole run "
          f"{minutes[1] / minutes[0]:.2f}x")


def report(out_log: Path, mem_log: Path | None, new_rows: tuple[float, float] | None, budget: int,
           exclude: set[int] = frozenset()) -> None:
    # ``exclude``: steps whose time holds a checkpoint the benchmark itself took.
    steps, seconds, warm, snapshots = _run_log(out_log, exclude)
    final = snapshots[-1]["storage"]
    rss = np.array([s["rss"] for s in steps])
    print(f"\nout-of-core run: {len(steps)} steps, {final['ssd_rows'] / 1e6:.1f}M rows on SSD "
          f"({final['ssd_live_bytes'] / 2**30:.1f} GiB live), {final['memory_rows'] / 1e6:.2f}M in DRAM")
    rows = []
    base = rss[warm]
    rows.append(("memory: max resident / DRAM budget + overhead",
                 f"{rss.max() / 2**30:.2f} GiB; budget {budget / 2**30:.2f} GiB; overhead "
                 f"{(rss.max() - budget) / 2**30:.2f} GiB (at step {warm}: {base / 2**30:.2f} GiB)"))
    grown = [s["storage"] for s in snapshots if s["storage"]["ssd_rows"] >= 100_000] or [final]
    per_row = max(s["ssd_index_bytes"] / s["ssd_rows"] for s in grown)
    rows.append(("memory: SSD index bytes per SSD row (max once 100k rows are there; target <= 16)",
                 f"{per_row:.1f} (at the end {final['ssd_index_bytes'] / max(final['ssd_rows'], 1):.1f})"))
    first, last, settled, full = _stretches(steps, seconds, snapshots, warm)
    rows.append(("speed: steps/s last 10% / first 10% (target >= 0.7)",
                 f"{rate(last) / rate(first):.2f}x ({rate(last):.2f} vs {rate(first):.2f} steps/s; "
                 f"medians {np.median(first) / np.median(last):.2f}x)"))
    rows.append((f"speed: steps/s last 10% / first 10% once DRAM is full (step {full} on)",
                 f"{rate(last) / rate(settled):.2f}x ({rate(last):.2f} vs {rate(settled):.2f} steps/s; "
                 f"medians {np.median(settled) / np.median(last):.2f}x)"))
    # Where the time of the first and the last 10% went, per 100 steps.
    for name, part in (("first 10%", steps[warm : warm + len(first)]), ("last 10%", steps[-len(last):])):
        per = _per_100_steps(steps, snapshots, part)
        if per is None:
            continue
        rows.append((f"  {name}, s per 100 steps: wall; CPU (of it system); waiting on the SSD writer, evicting, "
                     "SSD reads in the step; the writer's writes, cleaning; disk MiB read a step",
                     f"{per['wall']:.1f}; {per['cpu_s']:.1f} ({per['system_s']:.1f}); "
                     + ", ".join(f"{per[k]:.1f}" for k in ("ssd_wait_us", "evict_us", "ssd_stall_us", "ssd_write_us",
                                                          "ssd_clean_us")) + f"; {per['disk_mib']:.1f}"))
    if mem_log is not None:
        memory = np.array([s["wall"] for s in load(mem_log)])[warm:]
        rows.append(("speed: first 10% / all rows in memory (target >= 0.7)",
                     f"{rate(first) / rate(memory):.2f}x ({rate(first):.2f} vs {rate(memory):.2f} steps/s; "
                     f"medians {np.median(memory) / np.median(first):.2f}x)"))
        rows.append((f"speed: first 10% once DRAM is full (step {full} on) / all rows in memory",
                     f"{rate(settled) / rate(memory):.2f}x (medians {np.median(memory) / np.median(settled):.2f}x)"))
    disk = max(s["ssd_bytes"] / s["ssd_live_bytes"] for s in grown)
    rows.append(("disk: SSD files / live rows (max over the run; target <= 1.5)", f"{disk:.2f}x"))
    worst = int(np.argmax(seconds[warm:])) + warm
    # The snapshots either side of the longest step: their counters' difference holds it.
    before = [s for s in snapshots if s["step"] < steps[worst]["step"]][-1:]
    after = [s for s in snapshots if s["step"] >= steps[worst]["step"]][:1]
    around = before + after
    rows.append(("disk: longest step / median (target <= 5)",
                 f"{seconds[worst] / np.median(seconds[warm:]):.1f}x: {seconds[worst]:.2f} s at step "
                 f"{steps[worst]['step']} (median {np.median(seconds[warm:]):.2f} s)"))
    if len(around) >= 2:
        a, b = around[-2]["counters"], around[-1]["counters"]
        parts = {k: (b.get(k, 0) - a.get(k, 0)) / 1e6 for k in ("ssd_stall_us", "evict_us", "ssd_wait_us",
                                                                 "ssd_write_us", "ssd_clean_us", "index_grow_us")}
        span = sum(s["wall"] for s in steps if a_step < s["step"] <= b_step) if (
            a_step := around[0]["step"]) < (b_step := around[1]["step"]) else 0.0
        rows.append((f"  steps {a_step + 1}-{b_step} ({span:.2f} s): s waiting on SSD reads, evicting, waiting "
                     "on SSD writes; the SSD writer's writes, cleaning, index growth", ", ".join(f"{k[:-3]} {v:.2f}" for k, v in parts.items())))
    if new_rows is not None:
        rows.append(("new rows: 50%-new step / all-stored step (target >= 0.8)",
                     f"{new_rows[0] / new_rows[1]:.2f}x ({new_rows[0]:.1f} vs {new_rows[1]:.1f} steps/s)"))
    width = max(len(r[0]) for r in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", default="1.5xRAM", help="rows on SSD to stop at (bytes, '36GB', '1.5xRAM')")
    parser.add_argument("--device-bytes", type=int, default=80_000_000, help="DRAM device tier per table (26 tables)")
    parser.add_argument("--dir", default=str(ROOT / "bench_out" / "out_of_core"))
    parser.add_argument("--new-rows-rows", type=int, default=2_000_000)
    parser.add_argument("--keep", action="store_true", help="keep the SSD files and logs")
    parser.add_argument("--skip", default="", help="comma list of parts to skip: memory,new_rows,checkpoint")
    parser.add_argument("--compare-spinning", action="store_true",
                        help="run the out-of-core fit again with OpenMP threads spinning (libgomp's default)")
    parser.add_argument("--fit-args", default="", help="more overrides for every fit, e.g. a smaller stream for "
                                                       "a scaled run: '--data.init_args.head_size=250000'")
    args = parser.parse_args()
    if args.compare_spinning and "checkpoint" not in args.skip.split(","):
        parser.error("--compare-spinning needs --skip checkpoint: the second run takes no checkpoints")
    work = Path(args.dir)
    more = shlex.split(args.fit_args)
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    skip = set(filter(None, args.skip.split(",")))
    try:
        out_log = work / "out_of_core.jsonl"
        callbacks = _callbacks(args.target, out_log)
        if "checkpoint" not in skip:
            callbacks += [{"class_path": "ctr_lightning.callbacks.TableSnapshots",
                           "init_args": {"root": str(work / "snapshots")}},
                          {"class_path": "bench_out_of_core.CheckpointAtTarget",
                           "init_args": {"path": str(work / "saves.json"), "dirpath": str(work / "ckpt")}}]
        seconds = run_fit(work, "out_of_core", [
            f"--model.storage.device_bytes={args.device_bytes}", f"--model.storage.ssd_dir={work / 'ssd'}",
            f"--trainer.callbacks={json.dumps(callbacks)}", *more])
        print(f"out-of-core run: {seconds / 60:.1f} min")
        shutil.rmtree(work / "ssd", ignore_errors=True)
        spinning = None
        if args.compare_spinning:
            spin_log = work / "spinning.jsonl"
            spun = run_fit(work, "spinning", [
                f"--model.storage.device_bytes={args.device_bytes}", f"--model.storage.ssd_dir={work / 'ssd'}",
                f"--trainer.callbacks={json.dumps(_callbacks(args.target, spin_log))}", *more],
                env={"GOMP_SPINCOUNT": "300000", "OMP_WAIT_POLICY": None})  # this process set PASSIVE
            shutil.rmtree(work / "ssd", ignore_errors=True)
            spinning = (spin_log, spun)
        if "checkpoint" not in skip:
            resume = work / "resume.json"
            steps_done = json.loads((work / "saves.json").read_text())["incremental"]["step"]
            timer = {"class_path": "bench_out_of_core.ResumeTimer",
                     "init_args": {"path": str(resume), "started": time.time()}}
            run_fit(work, "resumed", [
                f"--model.storage.device_bytes={args.device_bytes}", f"--model.storage.ssd_dir={work / 'ssd_resumed'}",
                f"--ckpt_path={work / 'ckpt' / 'incremental.ckpt'}", f"--trainer.max_steps={steps_done + 5}",
                f"--trainer.callbacks={json.dumps([timer])}", *more])
            report_checkpoints(work / "saves.json", resume, budget=26 * args.device_bytes)
            print("(the steps that took them are left out of the figures below)")
            shutil.rmtree(work / "ssd_resumed", ignore_errors=True)
            shutil.rmtree(work / "snapshots", ignore_errors=True)
        steps = len(load(out_log))
        mem_log = None
        if "memory" not in skip:
            mem_log = work / "in_memory.jsonl"
            tenth = max(1, (steps - min(20, steps // 10)) // 10) + min(20, steps // 10)
            run_fit(work, "in_memory", ["--model.storage.device_bytes=null", "--model.storage.host_rows=null",
                                        "--model.storage.ssd_dir=null", f"--trainer.max_steps={tenth}",
                                        f"--trainer.callbacks={json.dumps(_callbacks(None, mem_log, prefetch=False))}",
                                        *more])
        new_rows = None if "new_rows" in skip else new_row_steps(work, args.new_rows_rows, 100_000, 5)
        saves = work / "saves.json"
        exclude = {r["step"] + 1 for r in json.loads(saves.read_text()).values()} if saves.exists() else set()
        report(out_log, mem_log, new_rows, budget=26 * args.device_bytes, exclude=exclude)
        if spinning is not None:
            compare_spinning(out_log, spinning[0], (seconds / 60, spinning[1] / 60))
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


def _callbacks(target: str | None, log: Path, prefetch: bool = True) -> list[dict]:
    # As configs/out_of_core.yaml; the all-in-memory run has no SSD to read ahead from.
    return [{"class_path": "ctr_lightning.callbacks.ExamplesPerSecond", "init_args": {"window": 20}},
            *([{"class_path": "ctr_lightning.callbacks.WorkingSetPrefetch", "init_args": {"lookahead": 4}}]
              if prefetch else []),
            {"class_path": "ctr_lightning.callbacks.StorageMonitor",
             "init_args": {"every_n_steps": 20, "stop_at_ssd_bytes": target}},
            {"class_path": "bench_out_of_core.StepRecorder", "init_args": {"path": str(log)}}]


if __name__ == "__main__":
    main()
