"""The tables of one tier stack as its tiers see them: row layout, id spaces, first rows."""

from __future__ import annotations

import numpy as np
import torch
from torchrec.modules.embedding_configs import EmbeddingBagConfig

from ctr_lightning.embedding.initializer import initial_rows, initialize_slots, range_bounds, table_key
from ctr_lightning.embedding.table_setup import TableSetup


class GroupTables:
    """Tables that share a row layout, ``[weights | optimizer state]``: ``width`` floats a
    row, the first ``dim`` of them the weights. Says which ids each table may hold and the
    row each id starts from (a counter-based generator of seed, table and id), so a row
    stored nowhere needs no storage.

    Example::

        tables = GroupTables(configs, setup)
        tables.check_ids(table_of_each_id, ids)        # ValueError naming the first bad id
        weights = tables.initial(table_of_each_id, ids)  # [n, dim] initial weights
    """

    def __init__(self, tables: list[EmbeddingBagConfig], setup: TableSetup) -> None:
        self.names = [t.name for t in tables]
        self.dim = tables[0].embedding_dim
        self.width = setup.row_width(self.dim, self.names)
        self.seed = setup.seed
        self.table_keys = np.array([table_key(t.name) for t in tables], dtype=np.int64)
        self.num_embeddings = np.array([t.num_embeddings for t in tables], dtype=np.int64)
        self.bounded = np.array([setup.id_space[t.name] == "bounded" for t in tables], dtype=bool)
        # Per table, the half width and middle of the uniform range its rows start in.
        self.init_bounds, self.init_centers = range_bounds(*np.array([setup.init_range[t.name] for t in tables]).T)
        # Per table, whether it admits ids selectively: there a row stored nowhere was never
        # admitted, and reads zeros.
        self.admits = np.array([t.name in setup.admission for t in tables], dtype=bool)

    def check_ids(self, tables: np.ndarray, ids: np.ndarray) -> None:
        """An error naming the table and id of the first id its table cannot hold."""
        if not self.bounded.any() and (not len(ids) or ids.min() >= 0):
            return  # the common case, hashed ids: only the sign to check
        bad = ids < 0
        bad |= self.bounded[tables] & (ids >= self.num_embeddings[tables])
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            t = int(tables[i])
            why = "negative" if ids[i] < 0 else f"outside [0, {int(self.num_embeddings[t])})"
            raise ValueError(f"table {self.names[t]!r}: id {int(ids[i])} is {why}")

    def initial(self, tables: np.ndarray, ids: np.ndarray) -> np.ndarray:
        """The initial weights ``[n, dim]`` of these rows."""
        return initial_rows(self.seed, self.table_keys[tables], ids, self.dim, self.init_bounds[tables],
                            self.init_centers[tables])

    def unstored(self, tables: np.ndarray, ids: np.ndarray) -> np.ndarray:
        """The weights ``[n, dim]`` rows stored nowhere read: their initial ones, zeros in
        tables that admit ids selectively."""
        weights = self.initial(tables, ids)
        if self.admits.any():
            weights[self.admits[tables]] = 0.0
        return weights

    def initialize(self, values: torch.Tensor, slots: np.ndarray, tables: np.ndarray, ids: np.ndarray) -> None:
        """``values[slots]`` := initial weights and zero optimizer state, in place."""
        if values.device.type == "cpu":
            initialize_slots(self.seed, self.table_keys[tables], ids, self.dim, self.init_bounds[tables],
                             values.numpy(), slots, self.init_centers[tables])
            return
        rows = torch.zeros(len(ids), self.width)
        rows[:, : self.dim] = torch.from_numpy(self.initial(tables, ids))
        values[torch.from_numpy(slots).to(values.device)] = rows.to(values.device)
