"""torchrec's ``EmbeddingBagCollection`` state dict, both ways: per table
``{prefix}embedding_bags.<table>.weight``, float32 ``[num_embeddings, dim]``, row ``i`` the
weights of id ``i``. torchrec's weight has no optimizer state: rows loaded from it start
with none.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch
from torchrec.modules.embedding_configs import EmbeddingBagConfig

from ctr_lightning.embedding.engine import TableEngine, TableState
from ctr_lightning.embedding.local_tables import LocalTables
from ctr_lightning.embedding.lifecycle.row_expiry import stamp_words
from ctr_lightning.embedding.table_setup import TableSetup, available_memory_bytes


def torchrec_weights(engine: TableEngine, tables: Sequence[EmbeddingBagConfig], setup: TableSetup,
                     prefix: str = "", chunk_rows: int = 1 << 16) -> dict[str, torch.Tensor]:
    """torchrec's weights of every table (see
    :meth:`TieredEmbeddingBagCollection.torchrec_state_dict`), read ``chunk_rows`` ids at a
    time; refused before anything is gathered when they cannot be made.

    Example::

        torchrec_ebc.load_state_dict(torchrec_weights(engine, tables, setup))
    """
    name = setup.module_name
    if not isinstance(engine, LocalTables):
        raise RuntimeError(
            f"{name}: torchrec_state_dict() of a collection sharded over ranks is not supported "
            f"(each rank holds only its shard); save_tables(directory) here, then load_tables(directory) into a "
            f"{name} of the same tables in one process and call torchrec_state_dict() there")
    need = sum(t.num_embeddings * t.embedding_dim * 4 for t in tables)
    available = available_memory_bytes()
    if need > available:
        raise MemoryError(
            f"{name}: torchrec's weights of tables {[t.name for t in tables]} "
            f"(num_embeddings x embedding_dim float32) take {need / 2**30:.2f} GiB, more than the "
            f"{available / 2**30:.2f} GiB of memory available; save_tables(directory) streams the rows instead")
    outside = _stored_outside(engine, setup)
    if outside:
        raise ValueError(
            f"{name}: tables store rows of hashed ids >= num_embeddings, which torchrec's weight "
            f"(ids 0 .. num_embeddings - 1) has no place for: {outside} (table: such rows); rows() reads "
            f"any id, save_tables(directory) saves every row")
    out = {}
    for t in tables:
        weight = torch.empty(t.num_embeddings, t.embedding_dim)
        for start in range(0, t.num_embeddings, chunk_rows):
            stop = min(start + chunk_rows, t.num_embeddings)
            weight[start:stop] = engine.rows(t.name, torch.arange(start, stop))
        out[f"{prefix}embedding_bags.{t.name}.weight"] = weight
    return out


def _stored_outside(engine: LocalTables, setup: TableSetup) -> dict[str, int]:
    """Per table of hashed ids, how many stored rows have ids ``>= num_embeddings``
    (tables with none left out): a pass over every stored row, a chunk at a time."""
    counts: dict[str, int] = {}
    for group in engine.groups:
        hashed = [setup.id_space[name] == "hashed" for name in group.names]
        if not any(hashed):
            continue  # bounded ids never reach num_embeddings: refused when looked up
        limits = np.array([t.num_embeddings for t in group.tables], dtype=np.int64)
        for tables, ids, _ in group.export_chunks():
            beyond = np.bincount(tables[ids >= limits[tables]], minlength=len(group.names))
            for name, n in zip(group.names, beyond):
                if n:
                    counts[name] = counts.get(name, 0) + int(n)
    return counts


def rows_from_torchrec(state_dict: Mapping[str, torch.Tensor], tables: Sequence[EmbeddingBagConfig],
                       setup: TableSetup, prefix: str = "", strict: bool = True) -> dict[str, TableState]:
    """Every table's rows from torchrec's weights, in :meth:`TableEngine.export`'s form:
    ids ``0 .. num_embeddings - 1``, zero optimizer state, step counts of 0 (see
    :meth:`TieredEmbeddingBagCollection.load_torchrec_state_dict`). Keys outside
    ``{prefix}embedding_bags.`` are ignored; with ``strict``, one there that names no table
    is an error.

    Example::

        engine.load(rows_from_torchrec(torchrec_ebc.state_dict(), tables, setup))
    """
    name = setup.module_name
    keys = {f"{prefix}embedding_bags.{t.name}.weight": t for t in tables}
    missing = sorted(k for k in keys if k not in state_dict)
    if missing:
        raise KeyError(f"{name}: the state dict lacks torchrec's weights {missing}; every table's "
                       f"is needed (a load replaces every row)")
    unknown = sorted(k for k in state_dict if k.startswith(f"{prefix}embedding_bags.") and k not in keys)
    if strict and unknown:
        raise KeyError(f"{name}: the state dict has weights {unknown} of no table of this "
                       f"collection (tables {[t.name for t in tables]})")
    need = 0
    for key, t in keys.items():
        shape = tuple(state_dict[key].shape)
        if shape != (t.num_embeddings, t.embedding_dim):
            raise ValueError(f"{name}: table {t.name!r}: {key} has shape {list(shape)}, the table "
                             f"is [num_embeddings, embedding_dim] = [{t.num_embeddings}, {t.embedding_dim}]")
        need += t.num_embeddings * setup.row_width(t.embedding_dim, [t.name]) * 4
    available = available_memory_bytes()
    if need > available:
        raise MemoryError(f"{name}: loading torchrec's weights takes {need / 2**30:.2f} GiB of rows "
                          f"(weights and optimizer state), more than the {available / 2**30:.2f} GiB of memory "
                          f"available")
    out = {}
    for key, t in keys.items():
        rows = torch.zeros(t.num_embeddings, setup.row_width(t.embedding_dim, [t.name]))
        rows[:, : t.embedding_dim] = state_dict[key].detach().to("cpu", torch.float32)
        if t.name in setup.expiry:  # loaded rows count as looked up at step 0, not as expired
            rows[:, setup.core_width(t.embedding_dim):] = torch.from_numpy(stamp_words(0))
        out[t.name] = {"ids": torch.arange(t.num_embeddings), "rows": rows, "steps": 0}
    return out
