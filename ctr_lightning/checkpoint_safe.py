"""Config classes that checkpoints may hold, allowed for ``torch.load(weights_only=True)``.

Lightning stores a module's ``save_hyperparameters()`` in every ``.ckpt`` and loads it
with ``weights_only=True`` (torch >= 2.6), which refuses any class not on torch's list of
safe globals. The project's configs are frozen dataclasses of plain values, so they are
safe to rebuild; each is registered where it is defined, and importing ``ctr_lightning``
imports them all. Those modules import neither Lightning nor TensorBoard, so importing a
light part of the library (``ctr_lightning.embedding``) stays light.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T", bound=type)


def checkpoint_safe(cls: T | None = None, *, formerly: str | None = None) -> T | Callable[[T], T]:
    """Class decorator: instances of this frozen dataclass may live in checkpoints.

    ``formerly``: the module the class was defined in before it moved. Checkpoints name a
    class by its module path, so those written before the move load too; that module must
    still import it, for loads without ``weights_only``.

    Example::

        @checkpoint_safe
        @dataclass(frozen=True)
        class StorageConfig: ...

        @checkpoint_safe(formerly="ctr_lightning.strategies.node_layout")
        @dataclass(frozen=True)
        class NodeLayout: ...
    """
    if cls is None:
        return lambda c: checkpoint_safe(c, formerly=formerly)
    if not (dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen):
        raise TypeError(f"checkpoint_safe: {cls.__name__} must be a frozen dataclass of plain values")
    torch.serialization.add_safe_globals([cls])
    if formerly is not None:
        torch.serialization.add_safe_globals([(cls, f"{formerly}.{cls.__qualname__}")])
    return cls
