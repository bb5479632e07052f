"""Copies of a collection (``copy.deepcopy``, pickle, ``torch.save`` of the module): made of
collections whose rows all live in this process's memory, refused where a copy would share
an SSD tier's files or stand for rows that live in other processes.

A collection under storage auto plans its tiers at its first use, so a copy made before
then plans them too, on this machine alike: copies of one lineage must not both get an SSD
tier in one directory (:func:`claim_planned_ssd`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

# Per lineage of storage-auto collections copied before their tiers were planned: the SSD
# directories planned for them in this process, and for which collection (its id).
_PLANNED_SSD: dict[str, dict[str, int]] = {}


def refuse_copy(module_name: str, tables: Sequence[str], ssd_dirs: Sequence[str], sharded: bool) -> None:
    """Raise TypeError, naming the way out, if a collection of ``tables`` cannot be copied:
    it has an SSD tier in ``ssd_dirs``, or it is ``sharded`` over ranks.

    Example::

        refuse_copy("TieredEmbeddingBagCollection", ["t0"], ["/nvme/run1"], sharded=False)   # TypeError
    """
    if ssd_dirs:
        raise TypeError(
            f"{module_name} of tables {list(tables)} cannot be copied (deepcopy, "
            f"pickle, torch.save of the module): it has an SSD tier in {list(ssd_dirs)}, whose files a copy would "
            f"share and corrupt. Save its rows with save_tables(directory) and "
            f"load them with load_tables(directory) into a new {module_name} whose StorageConfig.ssd_dir "
            f"is another directory; Lightning checkpoints stream them through "
            f"ctr_lightning.callbacks.TableSnapshots. Callbacks that deep-copy the model "
            f"(StochasticWeightAveraging, EMA) need a collection held in memory")
    if sharded:
        raise TypeError(
            f"{module_name} of tables {list(tables)} cannot be copied (deepcopy, "
            f"pickle, torch.save of the module): it is sharded over ranks, and its rows live in other "
            f"processes; save_tables(directory) / load_tables(directory) move them to another collection")


def claim_planned_ssd(lineage: str, ssd_dirs: Iterable[str], owner: object, module_name: str,
                      tables: Sequence[str]) -> None:
    """Storage auto planned an SSD tier in ``ssd_dirs`` for ``owner``, a collection of copy
    ``lineage``: refused (TypeError) where another collection of that lineage planned one
    in this process first.

    Example::

        claim_planned_ssd(lineage, {"/nvme"}, ebc, "TieredEmbeddingBagCollection", ["t0"])
    """
    planned = _PLANNED_SSD.setdefault(lineage, {})
    shared = sorted(d for d in ssd_dirs if planned.setdefault(d, id(owner)) != id(owner))
    if shared:
        raise TypeError(
            f"{module_name} of tables {list(tables)}: storage 'auto' planned an SSD "
            f"tier in {shared}, where a copy of this collection (deepcopy, pickle, made before the tiers were "
            f"planned) or the collection it copies has its SSD tier: both would use and corrupt the same "
            f"files. Copy collections whose rows are in memory, or move rows with save_tables / load_tables "
            f"into a collection with another SSD directory")
