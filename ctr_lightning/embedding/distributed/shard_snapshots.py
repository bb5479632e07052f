"""Table snapshots of sharded engines: every rank streams the rows it owns to its own files,
rank 0 writes the manifest once all of them are there.

The snapshot directory must be one every rank sees (a shared file system on several
nodes, as Lightning's checkpoint directory is). Loading needs no collective: each rank
reads every file and keeps the rows it owns under its own plan, so a snapshot saved by W
ranks loads into W' ranks, another sharding, or one process.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from contextlib import ExitStack

import torch.distributed as dist

from ctr_lightning.embedding.distributed.collectives import gather_objects
from ctr_lightning.embedding.local_tables import LocalTables
from ctr_lightning.embedding.sharding_plan import TableSharding
from ctr_lightning.embedding.snapshots.table_snapshot import (
    ShardFiles,
    SnapshotManifest,
    SnapshotRef,
    join_shards,
    write_manifest,
    write_shard,
    writing,
)


def save_shards(local: LocalTables, directory: str | os.PathLike, process_group: dist.ProcessGroup,
                plan: Mapping[str, TableSharding], steps: dict[str, int] | None = None,
                parent: SnapshotRef | None = None, chunk_rows: int = 1 << 16,
                replicas: LocalTables | None = None) -> SnapshotManifest:
    """Collective: this rank writes ``local``'s rows (``rank{r}-group{g}.rows``), the ranks
    exchange what they wrote (names, sizes, checksums: a few bytes, never rows), and rank 0
    writes the manifest. A failure on any rank (a full disk, say) raises on every rank,
    naming the rank and the cause, and no manifest is written, so the snapshot stays
    incomplete and the previous one is what a resume finds. With ``parent`` (the last
    snapshot, saved or loaded, on every rank) each rank writes only its rows changed since.
    ``replicas``: data-parallel tables, equal on every rank: rank 0 writes them
    (``replicas-group<g>`` files)."""
    rank = dist.get_rank(process_group)
    part, failure = None, None
    # Each rank marks the directory as its own until the manifest is there, so a resumed
    # run deletes the snapshot only once every writer is gone (table_snapshot.abandoned).
    with ExitStack() as marked:
        try:
            directory = marked.enter_context(writing(directory, f"rank{rank}"))
            part = write_shard(local, directory, rank, chunk_rows, steps, changed_only=parent is not None)
            if replicas is not None and rank == 0:
                more = write_shard(replicas, directory, rank, chunk_rows, steps, changed_only=parent is not None,
                                   prefix="replicas")
                part = ShardFiles(part.files + more.files, {**part.steps, **more.steps},
                                  {**part.tables, **more.tables})
        except Exception as e:  # noqa: BLE001 - every rank must learn of it, or the others wait forever
            failure = e
        parts = gather_objects((part, _describe(rank, failure)), process_group)
        _raise_any(directory, failure, [error for _, error in parts])
        shards: list[ShardFiles] = [p for p, _ in parts]
        manifest = join_shards(shards, {t: {"kind": s.kind, "owner": s.owner} for t, s in sorted(plan.items())},
                               parent)
        if rank == 0:
            try:
                write_manifest(directory, manifest)
            except Exception as e:  # noqa: BLE001
                failure = e
        _raise_any(directory, failure, gather_objects(_describe(rank, failure), process_group))
    local.mark_saved()
    if replicas is not None:
        replicas.mark_saved()  # every rank's: they are equal, rank 0's are saved
    return manifest


def _describe(rank: int, failure: BaseException | None) -> str | None:
    return None if failure is None else f"rank {rank}: {type(failure).__name__}: {failure}"


def _raise_any(directory: str | os.PathLike, own: BaseException | None, errors: list[str | None]) -> None:
    if own is not None:
        raise own  # this rank's own error, with its traceback
    errors = [e for e in errors if e]
    if errors:
        raise RuntimeError(f"table snapshot {directory}: not saved, another rank failed: {'; '.join(errors)}")
