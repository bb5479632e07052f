"""The LightningDataModule shared by every ad-log format."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
import torch

from ctr_lightning.datamodules.bad_lines import BadFilePolicy, BadLinePolicy, UnreadableFileError
from ctr_lightning.datamodules.event_time_slices import EventTimeSlice, cut_event_time_slices
from ctr_lightning.datamodules.row_index import FileIndex, default_index_dir
from ctr_lightning.embedding.expiry_config import parse_duration
from ctr_lightning.datamodules.sources import expand_paths, slice_event_time, slice_name, time_slices
from ctr_lightning.datamodules.batch_loader import BatchDataLoader
from ctr_lightning.datamodules.followed_log import FollowedLog, Readiness
from ctr_lightning.datamodules.log_format import LogFormat
from ctr_lightning.datamodules.stream_dataset import LogStreamDataset, index_log_files

_STAGES = {"fit": ("train", "val"), "validate": ("val",), "test": ("test",), "predict": ("predict",)}


class LogDataModule(pl.LightningDataModule):
    """Train/val/test/predict streams of one log format, split by file.

    A subclass builds its :class:`LogFormat` from its own arguments and passes it in.

    Args:
        log_format: how the files are read and decoded.
        train_paths: files, directories or globs for training, read in name order.
        val_paths: held-out files (train and validation are split by file).
        test_paths: files for ``trainer.test``.
        predict_paths: files for ``trainer.predict``.
        batch_size: examples per batch.
        num_workers: DataLoader worker processes per rank.
        bad_lines: ``"skip"`` (count and log) or ``"raise"`` (stop with file:line).
        bad_files: a file that cannot be read to its end (a truncated or corrupt compressed
            stream, a damaged Parquet page, an I/O error): ``"fail"`` (default) stops the
            run naming the file and the first record that could not be read; ``"skip"``
            uses the records before the break, logs the file and counts it in
            ``unreadable_files``.
        online: time-ordered training: ``train_paths`` are successive time slices (one
            file per day in name order, or Hive-style partitions such as
            ``logs/dt=2026-12-01/part-*.parquet``, one partition a day, in date order);
            epoch k trains on slice k and validates on slice k + 1 (progressive
            validation). Needs ``Trainer(reload_dataloaders_every_n_epochs=1)`` and no
            ``val_paths``. With ``slice_every``, the slices are windows of event time instead.
        slice_every: in ``online`` mode, cut the training records into time slices of this
            much event time (``"1h"``, ``"1d"``, ``"30m"``; windows aligned to UTC), by each
            record's event time (the reader's ``event_time_column``, or ``partition_time``),
            whatever the files: one big file, or files that each span many hours. Records
            keep their read order (files in name order, lines in file order); a slice starts
            at the first record whose event time reaches its window, so a late record trains
            in the slice it is read in. Costs one read of the training files at set-up; the
            cuts are cached with the record counts (``index_dir``). Slices are named by their
            start (``2026-12-01T05:00:00Z``) and timed by it in ``ProgressiveValidation``.
        follow: train on a log as it lands: epoch k trains the k-th complete time slice
            of ``train_paths`` (a directory, glob or Hive partitions, in partition order;
            see :class:`FollowedLog`: a ``_SUCCESS`` marker, or sizes stable over two polls).
            At the end of a slice it waits for the next, polling every ``poll_seconds``;
            the run ends at ``max_steps``, when no slice completes within ``idle_timeout``
            seconds (None: wait for ever), or at the slice boundary after ``stop_file``
            appears. Checkpoints hold the slices taken and the position in the current
            one. Needs ``Trainer(reload_dataloaders_every_n_epochs=1)``; ``val_paths``
            optional (a fixed set); pair it with the ``ProgressiveValidation`` callback.
        poll_seconds: in ``follow`` mode, how often the log is looked at for a new slice.
        idle_timeout: in ``follow`` mode, seconds without a new complete slice after which
            the run ends (None: wait for ever).
        stop_file: in ``follow`` mode, a path whose appearance ends the run at the next
            slice boundary.
        ready: in ``follow`` mode, when a slice counts as complete: ``"marker"`` (a
            ``_SUCCESS`` file), ``"stable"`` (sizes unchanged over two polls) or ``"auto"``
            (a marker where the log has them, else stable sizes).
        partition_time: each training record's event time (``Batch.event_time``, what an
            ``Expiry(ttl="7d")`` counts in) is its file's Hive partition time: a date
            (``dt=``, ``date=``, ``day=`` or ``ds=``) and an optional ``hour=``. A training
            file without a date partition is refused by name.
        max_bad_fraction: a file whose share of bad lines is larger (beyond a stray few)
            stops the run, naming the file and its first bad lines; None: no limit.
        shuffle_shards: deal the pieces of the data to the ranks in another order every
            epoch (seeded by ``shuffle_seed`` and the epoch), so no rank reads the same
            piece every epoch.
        shuffle_seed: the seed of ``shuffle_shards``' order.
        index_dir: where the files' record counts are cached (default
            ``$CTR_LIGHTNING_CACHE/row_index``, ``~/.cache/ctr-lightning/row_index``).

    Example::

        class MyLogs(LogDataModule):
            def __init__(self, train_paths=None, val_paths=None, batch_size: int = 4096, my_option: int = 3):
                super().__init__(MyFormat(my_option), train_paths=train_paths, val_paths=val_paths,
                                 batch_size=batch_size)
    """

    def __init__(
        self,
        log_format: LogFormat,
        train_paths: Sequence[str] | str | None = None,
        val_paths: Sequence[str] | str | None = None,
        test_paths: Sequence[str] | str | None = None,
        predict_paths: Sequence[str] | str | None = None,
        batch_size: int = 4096,
        num_workers: int = 0,
        bad_lines: BadLinePolicy = "skip",
        bad_files: BadFilePolicy = "fail",
        online: bool = False,
        max_bad_fraction: float | None = 0.001,
        shuffle_shards: bool = False,
        shuffle_seed: int = 0,
        index_dir: str | None = None,
        follow: bool = False,
        poll_seconds: float = 30.0,
        idle_timeout: float | None = None,
        stop_file: str | None = None,
        ready: Readiness = "auto",
        partition_time: bool = False,
        slice_every: str | None = None,
    ) -> None:
        super().__init__()
        self.slice_seconds = _slice_seconds(slice_every, online, follow)
        self.slice_every = slice_every
        if follow and (online or not train_paths):
            raise ValueError("follow mode trains the slices of train_paths as they land: give train_paths, and not "
                             "online (follow is the online mode of a log still being written)")
        if follow:
            _check_time_order(train_paths, shuffle_shards)
        if poll_seconds <= 0 or (idle_timeout is not None and idle_timeout < 0):
            raise ValueError(f"poll_seconds must be > 0 and idle_timeout >= 0 or None, got {poll_seconds}, "
                             f"{idle_timeout}")
        if online and val_paths:
            raise ValueError("online mode validates each day on the next one: give train_paths only, not val_paths")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {num_workers}")
        if bad_lines not in ("skip", "raise"):
            raise ValueError(f"bad_lines must be 'skip' or 'raise', got {bad_lines!r}")
        if bad_files not in ("fail", "skip"):
            raise ValueError(f"bad_files must be 'fail' or 'skip', got {bad_files!r}")
        if max_bad_fraction is not None and not 0.0 <= max_bad_fraction <= 1.0:
            raise ValueError(f"max_bad_fraction must be in [0, 1] or None, got {max_bad_fraction}")
        # The subclass's own arguments describe the format; an object in the hyper-parameters
        # would not load with torch.load(weights_only=True).
        self.save_hyperparameters(ignore=["log_format"])
        self.format = log_format
        self.paths = {"train": train_paths, "val": val_paths, "test": test_paths, "predict": predict_paths}
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.bad_lines = bad_lines
        self.bad_files = bad_files
        self.online = online
        self.followed: FollowedLog | None = FollowedLog(train_paths, ready) if follow else None
        self._follow_wait = (poll_seconds, idle_timeout, stop_file)
        self.max_bad_fraction = max_bad_fraction
        self.partition_time = partition_time
        self.shuffle_shards, self.shuffle_seed = shuffle_shards, shuffle_seed
        self.index_dir = index_dir if index_dir is not None else default_index_dir()
        self.files: dict[str, list[str]] = {}
        self._indexes: dict[str, FileIndex] = {}  # per path: its record count, from the cache or counted
        self.epoch_files: dict[str, list[str]] = {}  # what each split's latest loader reads
        # Each split's latest slice of data: its name and event time (online mode, for ProgressiveValidation).
        self.epoch_slices: dict[str, tuple[str, float | None]] = {}
        self.event_time_slices: list[EventTimeSlice] | None = None  # online mode with slice_every
        self._train_loader: BatchDataLoader | None = None
        self._sync_process_group: Any = None  # set up in a distributed fit, to keep ranks' batch counts equal
        self._resume: dict[str, Any] | None = None  # a checkpoint's position, until used
        # (epoch, batches trained before, batches per shard skipped) of a resumed pass
        self._resumed: tuple[int, int, dict[int, int]] | None = None
        # The epoch the data is in, at least: a checkpoint taken once its epoch had trained
        # resumes into the next one, while Lightning still reports the old epoch when it
        # builds (and starts reading) the loader.
        self._epoch_floor = 0

    @property
    def sparse_feature_names(self) -> list[str]:
        return list(self.format.sparse_feature_names)

    @property
    def num_dense_features(self) -> int:
        return self.format.num_dense_features

    def prepare_data(self) -> None:
        # Once per node (Lightning's local rank 0): count the records of every file into
        # the cache, so that the other ranks read the counts in setup().
        for split, paths in self.paths.items():
            if paths and not (split == "train" and self.followed is not None):  # still landing
                self._index(expand_paths(paths, what=f"{split}_paths"))
        if self.slice_seconds is not None:
            self._cut_event_time_slices(expand_paths(self.paths["train"], what="train_paths"))

    def setup(self, stage: str) -> None:
        for split in _STAGES[stage]:
            paths = self.paths[split]
            if paths is None or len(paths) == 0:
                if split == "val":
                    continue  # fitting without validation is allowed
                raise ValueError(f"{type(self).__name__}: stage {stage!r} needs {split}_paths")
            if split == "train" and self.followed is not None:
                self.files[split] = []  # slices are taken as they land (followed_files)
                continue
            self.files[split] = expand_paths(paths, what=f"{split}_paths")
            self._index(self.files[split])
        if (self.online or self.followed is not None) and stage == "fit":
            self.setup_online()
        trainer = self.trainer
        if (self._sync_process_group is None and trainer is not None and trainer.world_size > 1
                and torch.distributed.is_available() and torch.distributed.is_initialized()):
            # A CPU (gloo) group of its own: the default group may be NCCL.
            self._sync_process_group = torch.distributed.new_group(backend="gloo")

    def _index(self, paths: list[str]) -> None:
        new = [p for p in paths if p not in self._indexes]
        for index in index_log_files(new, self.format, self.index_dir):
            self._indexes[index.path] = index

    def setup_online(self) -> None:
        """Check that the Trainer reloads loaders every epoch and that enough slices exist."""
        trainer = self.trainer
        if trainer is not None and trainer.reload_dataloaders_every_n_epochs != 1:
            raise ValueError("online mode needs Trainer(reload_dataloaders_every_n_epochs=1), got "
                             f"{trainer.reload_dataloaders_every_n_epochs}")
        if self.followed is not None:
            return
        if self.slice_seconds is not None:
            slices = self._cut_event_time_slices(self.files["train"])
            if len(slices) < 2:
                raise ValueError(f"online mode needs at least two time slices: the records of train_paths "
                                 f"{self.paths['train']!r} span {len(slices)} window of slice_every "
                                 f"{self.slice_every!r}")
            return
        days = time_slices(self.files["train"])
        if len(days) < 2:
            raise ValueError(f"online mode needs at least two time slices in train_paths, got {days}")

    def _cut_event_time_slices(self, files: list[str]) -> list[EventTimeSlice]:
        if self.event_time_slices is None:
            self._index(files)
            indexes = [self._indexes[f] for f in files]
            broken = [i for i in indexes if i.unreadable is not None]
            if broken and self.bad_files == "fail":  # at set-up, not at the slice holding the break
                raise UnreadableFileError(broken[0].path, broken[0].records + 1, broken[0].unreadable)
            # What decides which lines are accepted and what time they hold keys the cached cuts:
            # the DataModule's arguments and the format's plain settings.
            settings = {k: v for k, v in self.hparams.items() if k not in ("batch_size", "num_workers")}
            plain = {k: v for k, v in getattr(self.format, "__dict__", {}).items()
                     if isinstance(v, (str, int, float, bool, type(None), list, tuple, dict))}
            self.event_time_slices = cut_event_time_slices(
                indexes, self.format, int(self.slice_seconds),
                json.dumps([type(self).__name__, type(self.format).__name__, settings, plain], sort_keys=True,
                           default=str),
                partition_time=self.partition_time, cache_dir=self.index_dir)
        return self.event_time_slices

    def _online_slice(self, split: str) -> tuple[tuple[str, float | None], list[FileIndex], list[str]]:
        """This epoch's slice (slice k trains, slice k + 1 validates): its name and start, the
        parts of files it reads, and how a checkpoint names them."""
        epoch = self._current_epoch()
        day = epoch + (1 if split == "val" else 0)
        if self.slice_seconds is not None:
            slices = self._cut_event_time_slices(self.files["train"])
            if day >= len(slices):
                raise ValueError(f"online mode: epoch {epoch} needs time slice {day}, but train_paths' event times "
                                 f"span {len(slices)} windows of {self.slice_every} ({slices[0].name} .. "
                                 f"{slices[-1].name}); use max_epochs <= {len(slices) - 1}")
            chosen = slices[day]
            return (chosen.name, float(chosen.start)), list(chosen.parts), chosen.describe()
        days = time_slices(self.files["train"])
        if day >= len(days):
            raise ValueError(f"online mode: epoch {epoch} needs time slice {day}, but train_paths has "
                             f"{len(days)} ({days[0][0]} .. {days[-1][-1]}); use max_epochs <= {len(days) - 1}")
        files = days[day]
        return (slice_name(files), slice_event_time(files)), [self._indexes[f] for f in files], files

    def _dataloader(self, split: str) -> BatchDataLoader:
        if split not in self.files and not (self.online and split == "val"):
            self.setup({"train": "fit", "val": "validate"}.get(split, split))
        if self.online:
            named, parts, files = self._online_slice(split)
        else:
            files = self.followed_files() if split == "train" and self.followed is not None else self.files[split]
            named = (slice_name(files), slice_event_time(files)) if files else ("", None)
            parts = [self._indexes[f] for f in files]
        trainer = self.trainer
        rank, world = (trainer.global_rank, trainer.world_size) if trainer is not None else (0, 1)
        self.epoch_files[split], self.epoch_slices[split] = files, named
        skip = self._take_resume(files, rank, world) if split == "train" else None
        if skip:
            # The batches of this epoch trained before the resume: the new loader's log of
            # batches starts after them, so later checkpoints add them back.
            done = trainer.fit_loop.epoch_loop.batch_progress.current.processed if trainer is not None else 0
            self._resumed = (self._current_epoch(), done, skip)
        elif split == "train":
            self._resumed = None
        dataset = LogStreamDataset(
            list(dict.fromkeys(p.path for p in parts)), self.format, batch_size=self.batch_size, rank=rank,
            world_size=world, bad_lines=self.bad_lines, skip_batches=skip, epoch=self._current_epoch(),
            max_bad_fraction=self.max_bad_fraction, files=parts, bad_files=self.bad_files,
            seed=self.shuffle_seed, rotate=self.shuffle_shards and split == "train", numbered=split == "predict",
            partition_time=self.partition_time and split == "train",
        )
        # Every split takes equal steps on all ranks: a sharded embedding collection runs
        # collectives in evaluation too, so a rank that stopped early would hang the rest.
        loader = BatchDataLoader(dataset, process_group=self._sync_process_group, num_workers=self.num_workers,
                                 require_examples=split == "train", epoch_of=self._current_epoch,
                                 pad_ranks=split != "train",  # evaluation and predict see every example
                                 on_exhausted=self._after_slice if split == "train" and self.followed else None)
        if split == "train":
            self._train_loader = loader
        return loader

    def followed_files(self) -> list[str]:
        """Follow mode: this epoch's slice, waited for until it is complete."""
        epoch = self._current_epoch()
        if not self.followed.wait_for(epoch + 1, *self._follow_wait, process_group=self._sync_process_group):
            raise FileNotFoundError(f"follow: no complete time slice under {self.paths['train']!r} for epoch {epoch} "
                                    f"(idle_timeout {self._follow_wait[1]} s, stop_file {self._follow_wait[2]!r})")
        files = self.followed.slices[epoch]
        self._index(files)
        return files

    def _after_slice(self) -> None:
        """Follow mode, a slice read to its end: wait for the next one, or end the run at
        this slice's end (Lightning's epoch then trains the batch it holds and stops)."""
        trainer = self.trainer
        if trainer is None:
            return
        if trainer.max_steps >= 0 and trainer.global_step + 1 >= trainer.max_steps:
            return  # the batch in hand is the run's last
        poll, idle, stop = self._follow_wait
        if not self.followed.wait_for(self._current_epoch() + 2, poll, idle, stop, self._sync_process_group):
            trainer.should_stop = True

    def _current_epoch(self) -> int:
        return max(self.trainer.current_epoch if self.trainer is not None else 0, self._epoch_floor)

    @property
    def bad_line_counts(self) -> dict[str, int]:
        """Lines skipped so far in this pass over the training data, per file (all workers)."""
        return dict(self._train_loader.bad_line_counts) if self._train_loader is not None else {}

    @property
    def unreadable_files(self) -> dict[str, int]:
        """Training files of this pass cut short under ``bad_files="skip"``, each with the
        first record (1-based) that could not be read."""
        return dict(self._train_loader.unreadable_files) if self._train_loader is not None else {}

    # -- exact resume ------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Where training stands in this epoch's data: batches delivered per shard.

        Counts only batches whose training step ran (Lightning reads one batch ahead), so a
        run resumed from this checkpoint sees exactly the examples not yet trained on.
        """
        trainer, loader = self.trainer, self._train_loader
        if trainer is None or loader is None:
            return {}
        done = trainer.fit_loop.epoch_loop.batch_progress.current.processed
        before, skipped = 0, {}
        if self._resumed is not None and self._resumed[0] == trainer.current_epoch:
            _, before, skipped = self._resumed  # this epoch began in an earlier run
        shard_batches = loader.position(done - before)
        for shard, n in skipped.items():  # every rank's shards, as the checkpoint had them
            shard_batches[shard] = shard_batches.get(shard, 0) + n
        if torch.distributed.is_available() and torch.distributed.is_initialized() and trainer.world_size > 1:
            # Every rank builds the checkpoint; rank 0 writes it, so it must hold all shards.
            # A shard's count only grows, and only its reader knows the new one: take the largest.
            parts: list[dict[int, int]] = [{} for _ in range(trainer.world_size)]
            torch.distributed.all_gather_object(parts, shard_batches)
            shard_batches = {}
            for part in parts:
                for k, v in part.items():
                    shard_batches[k] = max(shard_batches.get(k, 0), v)
        return {
            **({"followed": self.followed.state()} if self.followed is not None else {}),
            "epoch": trainer.current_epoch,
            "epoch_done": _epoch_trained(trainer),
            "files": self.epoch_files.get("train", []),
            "rank": trainer.global_rank,
            "world_size": trainer.world_size,
            "num_workers": self.num_workers,
            "batch_size": self.batch_size,
            "shuffle": [self.shuffle_shards, self.shuffle_seed],
            "shard_batches": shard_batches,
            **({"slice_every": self.slice_every} if self.online else {}),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._resume = dict(state_dict) or None
        if self.followed is not None and "followed" in state_dict:
            self.followed.load(state_dict["followed"])  # epoch k trains the slice it trained before

    def _take_resume(self, files: list[str], rank: int, world: int) -> dict[int, int] | None:
        state, self._resume = self._resume, None
        if not state:
            return None
        epoch = self.trainer.current_epoch if self.trainer is not None else 0
        if self.online and "slice_every" in state and state["slice_every"] != self.slice_every:
            # Epoch k is the k-th slice: cut otherwise, it would be another stretch of the log.
            raise ValueError(f"cannot resume this online run: the checkpoint's time slices were cut with slice_every="
                             f"{state['slice_every']!r}, this run's with {self.slice_every!r}; resume with the same "
                             f"slice_every")
        if state.get("epoch_done") or (state.get("epoch_done") is None and self.trainer is not None
                                       and _epoch_trained(self.trainer)):
            # Saved once its epoch had trained (epoch end, validation after the last batch,
            # or older checkpoints whose loop says so): the next pass is a whole new epoch.
            self._epoch_floor = state["epoch"] + 1
            return None
        if state["epoch"] != epoch:
            return None  # the checkpoint closed its epoch; this one starts fresh
        layout = (state["files"], state["world_size"], state["num_workers"], state["batch_size"],
                  state.get("shuffle", [False, 0]))
        now = (files, world, self.num_workers, self.batch_size, [self.shuffle_shards, self.shuffle_seed])
        if layout != now:
            raise ValueError(
                "cannot resume mid-epoch: the checkpoint read files/world_size/num_workers/batch_size/"
                f"[shuffle_shards, shuffle_seed] {layout}, this run {now}; resume with the same layout or from "
                "an end-of-epoch checkpoint")
        return {int(k): v for k, v in state["shard_batches"].items()}

    def train_dataloader(self) -> BatchDataLoader:
        return self._dataloader("train")

    def val_dataloader(self) -> BatchDataLoader | list:
        return self._dataloader("val") if self.paths["val"] or self.online else []

    def test_dataloader(self) -> BatchDataLoader:
        return self._dataloader("test")

    def predict_dataloader(self) -> BatchDataLoader:
        return self._dataloader("predict")


def _slice_seconds(slice_every: str | None, online: bool, follow: bool) -> float | None:
    """``slice_every`` in seconds; refused outside online mode, where nothing is sliced."""
    if slice_every is None:
        return None
    if not online or follow:
        raise ValueError(f"slice_every={slice_every!r} cuts online mode's time slices by event time: set online "
                         f"true (follow mode takes each landing file or partition as a slice)")
    try:
        seconds = parse_duration(slice_every)
    except ValueError:
        raise ValueError(f"slice_every {slice_every!r} is not a duration of event time such as '1d', '1h', '30m' "
                         f"or '90s'") from None
    if seconds != int(seconds):
        raise ValueError(f"slice_every {slice_every!r} is not a whole number of seconds")
    return seconds


def _check_time_order(paths: Sequence[str] | str, shuffle: bool) -> None:
    """Follow mode trains slices in time order, as they land: refuse what has none."""
    if shuffle:
        raise ValueError("follow mode trains each time slice in order as it lands; shuffle_shards would deal its "
                         "pieces in another order: set shuffle_shards false")
    listed = [paths] if isinstance(paths, str) else list(paths)
    fixed = [p for p in listed if not (set("*?[") & set(p)) and os.path.isfile(p)]
    if fixed:
        raise ValueError(f"follow mode needs train_paths where new files land in time order (a directory, a glob, "
                         f"or Hive partitions such as logs/dt=*/hour=*): {fixed} name fixed files, which never grow "
                         f"into new slices")


def _epoch_trained(trainer: pl.Trainer) -> bool:
    """Whether the Trainer's current epoch has trained every batch it will: a checkpoint
    taken now resumes into the next epoch (Lightning's own loops decide the same way)."""
    loop = trainer.fit_loop
    if loop.epoch_progress.current.processed > trainer.current_epoch:
        return True  # on_train_epoch_end
    batches = loop.epoch_loop.batch_progress
    return batches.current.processed == batches.current.ready and (
        batches.is_last_batch or batches.current.ready >= trainer.num_training_batches)
