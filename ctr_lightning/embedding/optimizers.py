"""Sparse optimizer configurations: frozen dataclasses, applied inside the embedding module.

The embedding module updates only the rows a batch touched, during backward, so
Lightning's dense optimizer never sees table parameters.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SparseSGD:
    """Plain SGD on the touched rows.

    Example::

        FusedEmbeddingBagCollection(tables, optimizer=SparseSGD(lr=0.1))
    """

    lr: float = 0.01

    def __post_init__(self) -> None:
        if self.lr <= 0:
            raise ValueError(f"{type(self).__name__}: lr must be > 0, got {self.lr}")


@dataclass(frozen=True)
class SparseAdagrad(SparseSGD):
    """Adagrad with one accumulator per element.

    Example::

        SparseAdagrad(lr=0.05, eps=1e-8)
    """

    lr: float = 0.05
    eps: float = 1e-8


@dataclass(frozen=True)
class RowWiseAdagrad(SparseAdagrad):
    """Adagrad with one accumulator per row (the mean of the squared gradient).

    Example::

        RowWiseAdagrad(lr=0.05)
    """


@dataclass(frozen=True)
class SparseAdam(SparseSGD):
    """Lazy Adam: per-element moments, bias-corrected, updated only for touched rows.

    Example::

        SparseAdam(lr=1e-3, betas=(0.9, 0.999))
    """

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8


SparseOptimizer = SparseSGD | SparseAdagrad | RowWiseAdagrad | SparseAdam
