"""Config classes that checkpoints may hold, allowed for ``torch.load(weights_only=True)``.

Lightning stores a module's ``save_hyperparameters()`` in every ``.ckpt`` and loads it
with ``weights_only=True`` (torch >= 2.6), which refuses any class not on torch's list of
safe globals. The project's configs are frozen dataclasses of plain values, so they are
safe to rebuild; each is registered where it is defined, and importing ``ctr_lightning``
imports them all.
"""

from __future__ import annotations

import dataclasses
from typing import TypeVar

import torch

T = TypeVar("T", bound=type)


def checkpoint_safe(cls: T) -> T:
    """Class decorator: instances of this frozen dataclass may live in checkpoints.

    Example::

        @checkpoint_safe
        @dataclass(frozen=True)
        class StorageConfig: ...
    """
    if not (dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen):
        raise TypeError(f"checkpoint_safe: {cls.__name__} must be a frozen dataclass of plain values")
    torch.serialization.add_safe_globals([cls])
    return cls
