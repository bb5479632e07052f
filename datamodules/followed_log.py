"""A log still being written: its time slices found as they land, each taken once complete."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from typing import Any, Literal

import torch.distributed as dist
from fsspec.core import url_to_fs

from ctr_lightning.datamodules.sources import expand_paths, slice_name, time_slices

log = logging.getLogger(__name__)

Readiness = Literal["auto", "marker", "stable"]
MARKER = "_SUCCESS"


class FollowedLog:
    """The time slices of a growing log (files, a directory, a glob, or Hive partitions
    ``dt=.../hour=...``), in partition order; slice k is taken once complete and is the
    k-th trained.

    A slice is complete when its partition directory holds a ``_SUCCESS`` marker, or when
    the sizes of its files stayed the same over two polls. ``ready="marker"`` asks for the
    marker, ``"stable"`` for stable sizes; ``"auto"`` takes markers once any partition has
    one, stable sizes until then. A slice that lands after a later one was taken is logged
    and skipped (the slices taken keep their order, so a checkpoint's epochs keep their slices).

    Example::

        followed = FollowedLog("logs/")
        new = followed.poll()        # slices complete since the last poll, in order
        followed.slices              # every slice taken so far: slice k is epoch k
    """

    def __init__(self, paths: str | Sequence[str], ready: Readiness = "auto") -> None:
        if ready not in ("auto", "marker", "stable"):
            raise ValueError(f"ready must be 'auto', 'marker' or 'stable', got {ready!r}")
        self.paths = paths
        self.ready = ready
        self.slices: list[list[str]] = []
        self.skipped: list[str] = []  # slices that landed after a later one was taken
        self._last_sizes: dict[str, list[int]] = {}  # per slice not taken: its files' sizes at the last poll

    def poll(self) -> list[list[str]]:
        """Look again: the slices complete now and not taken before, taken in order."""
        candidates = self._candidates()
        markers = {key for key, files in candidates.items() if self._has_marker(files)}
        use_markers = self.ready == "marker" or (self.ready == "auto" and bool(markers))
        taken = {slice_name(s) for s in self.slices}
        last = slice_name(self.slices[-1]) if self.slices else None
        new: list[list[str]] = []
        for key in sorted(candidates):
            files = candidates[key]
            if key in taken or key in self.skipped:
                continue
            sizes = self._sizes(files)
            complete = key in markers if use_markers else self._last_sizes.get(key) == sizes
            self._last_sizes[key] = sizes
            if last is not None and key < last:
                if complete:
                    self.skipped.append(key)
                    self._last_sizes.pop(key, None)
                    log.warning("follow: time slice %s landed after %s was taken; it is skipped", key, last)
                continue
            if not complete:
                break  # slices are taken in order: a later one waits for this one
            new.append(files)
            self._last_sizes.pop(key, None)
            last = key
        self.slices.extend(new)
        return new

    def wait_for(self, count: int, poll_seconds: float, idle_timeout: float | None = None,
                 stop_file: str | None = None, process_group: Any = None) -> bool:
        """Block until ``count`` slices are taken; False where the run should end first: a
        ``stop_file`` exists, or no slice completed within ``idle_timeout`` seconds. With a
        ``process_group``, collective: rank 0 looks and every rank takes its answer, one
        collective a poll, so no rank waits in a collective longer than ``poll_seconds``."""
        started = time.monotonic()
        while len(self.slices) < count:
            rank0 = process_group is None or dist.get_rank(process_group) == 0
            answer: list[Any] = [None]
            if rank0:
                stop = stop_file is not None and os.path.exists(stop_file)
                if not stop:
                    self.poll()
                idle = idle_timeout is not None and time.monotonic() - started >= idle_timeout
                answer = [(self.state(), stop, idle)]
            if process_group is not None:
                dist.broadcast_object_list(answer, src=dist.get_global_rank(process_group, 0), group=process_group)
            state, stop, idle = answer[0]
            self.load(state)
            if stop:
                log.info("follow: the stop file %s is there: no further time slice is taken", stop_file)
                return False
            if len(self.slices) >= count:
                return True
            if idle:
                log.info("follow: no time slice completed under %s in %s s (idle_timeout)", self.paths, idle_timeout)
                return False
            time.sleep(poll_seconds)
        return True

    def _candidates(self) -> dict[str, list[str]]:
        try:
            files = expand_paths(self.paths, what="train_paths")
        except FileNotFoundError:
            return {}  # nothing has landed yet
        data = [f for f in files if not os.path.basename(f).startswith(("_", "."))]
        return {slice_name(s): s for s in time_slices(data)} if data else {}

    @staticmethod
    def _has_marker(files: list[str]) -> bool:
        key = slice_name(files)
        if key == files[0]:
            return False  # a slice of one file outside any partition: no directory to mark
        fs, root = url_to_fs(key)
        return fs.exists(f"{root}/{MARKER}")

    @staticmethod
    def _sizes(files: list[str]) -> list[int]:
        fs, _ = url_to_fs(files[0])
        return [int(fs.size(url_to_fs(f)[1])) for f in files]

    def state(self) -> dict[str, Any]:
        return {"slices": [list(s) for s in self.slices], "skipped": list(self.skipped)}

    def load(self, state: dict[str, Any]) -> None:
        """Continue after the slices a checkpoint had taken (their order is the epochs')."""
        self.slices = [list(s) for s in state.get("slices", [])]
        self.skipped = list(state.get("skipped", []))
