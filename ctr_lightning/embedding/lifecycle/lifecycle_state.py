"""What admission and expiry keep beside the rows in a checkpoint."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from ctr_lightning.embedding.engine import TableEngine
from ctr_lightning.embedding.table_setup import TableSetup


class LifecycleState:
    """The checkpoint entries of a collection's row lifecycle: admission's sighting counters
    (``"sightings"``, the tables admission counts for), expiry's floors (``"expiry"``, the
    stamped tables) and, where a ttl counts in data time, the event times it needs
    (``"expiry_clock"``), so a resumed run admits and keeps what an uninterrupted one would.
    Entries read from a checkpoint wait (:meth:`take`) until the rows are loaded, and are
    handed to the engine then (:meth:`restore`).

    Example::

        lifecycle = LifecycleState(setup)
        extra_state.update(lifecycle.saved(engine))   # collective when sharded
        lifecycle.take(extra_state)                    # a checkpoint's
        lifecycle.restore(engine)                      # once its rows are in
    """

    KEYS = ("sightings", "expiry", "expiry_clock")

    def __init__(self, setup: TableSetup) -> None:
        self.setup = setup
        self.pending: dict[str, Mapping[str, Any]] = {}

    def saved(self, engine: Callable[[], TableEngine]) -> dict[str, Any]:
        """The entries of the current state (none where neither is on). Collective when sharded."""
        out: dict[str, Any] = {}
        counts = engine().sightings() if self.setup.admission else {}
        if counts:
            out["sightings"] = {name: torch.from_numpy(c) for name, c in counts.items()}
        if self.setup.expiry:
            out["expiry"] = engine().expiry_floors()
        if self.setup.scored_tables:  # for readers of the file alone (export): their floors rank scores
            out["expiry_scored"] = list(self.setup.scored_tables)
        if self.setup.timed_tables:
            clock = engine().expiry_clock()
            if clock:
                out["expiry_clock"] = {"newest": clock["newest"], "tables": {
                    name: {"base": e["base"], "times": torch.from_numpy(e["times"])} for name, e in clock["tables"].items()}}
        return out

    def take(self, state: Mapping[str, Any]) -> None:
        """A checkpoint's entries; the last checkpoint taken wins. Where these tables expire
        rows, the floors always load (none saved: every floor starts at none gone), so a
        collection that trained before the load keeps none of its own."""
        self.pending = {key: state[key] for key in self.KEYS if key in state}
        if self.setup.expiry:
            self.pending.setdefault("expiry", {})

    def restore(self, engine: TableEngine) -> None:
        pending, self.pending = self.pending, {}
        if "expiry" in pending:  # which of the restored rows are gone
            engine.load_expiry_floors({name: int(floor) for name, floor in pending["expiry"].items()})
        if self.setup.timed_tables:
            clock = pending.get("expiry_clock")
            saved = [name for name in self.setup.timed_tables if name in pending.get("expiry", {})]
            if clock is None and saved:
                raise KeyError(f"tables {saved} have a ttl in data time but the checkpoint holds no event times "
                               f"(saved with a ttl in steps?)")
            if clock is not None:
                engine.load_expiry_clock({"newest": clock["newest"], "tables": {
                    name: {"base": int(e["base"]), "times": np.asarray(e["times"])} for name, e in clock["tables"].items()}})
        if "sightings" in pending:
            engine.load_sightings({name: np.asarray(counts) for name, counts in pending["sightings"].items()})
