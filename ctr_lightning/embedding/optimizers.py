"""Sparse optimizer configurations: frozen dataclasses, applied inside the embedding module.

The embedding module updates only the rows a batch touched, during backward, so
Lightning's dense optimizer never sees table parameters.
"""

from __future__ import annotations

from dataclasses import dataclass

from ctr_lightning.checkpoint_safe import checkpoint_safe


@checkpoint_safe
@dataclass(frozen=True)
class SparseSGD:
    """Plain SGD on the touched rows.

    Example::

        TieredEmbeddingBagCollection(tables, optimizer=SparseSGD(lr=0.1))
    """

    lr: float = 0.01

    def __post_init__(self) -> None:
        if self.lr <= 0:
            raise ValueError(f"{type(self).__name__}: lr must be > 0, got {self.lr}")


@checkpoint_safe
@dataclass(frozen=True)
class SparseAdagrad(SparseSGD):
    """Adagrad with one accumulator per element.

    Example::

        SparseAdagrad(lr=0.05, eps=1e-8)
    """

    lr: float = 0.05
    eps: float = 1e-8

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_eps(self)


@checkpoint_safe
@dataclass(frozen=True)
class RowWiseAdagrad(SparseAdagrad):
    """Adagrad with one accumulator per row (the mean of the squared gradient).

    Example::

        RowWiseAdagrad(lr=0.05)
    """


@checkpoint_safe
@dataclass(frozen=True)
class SparseAdam(SparseSGD):
    """Lazy Adam: per-element moments, bias-corrected, updated only for touched rows.

    Example::

        SparseAdam(lr=1e-3, betas=(0.9, 0.999))
    """

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_eps(self)
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"SparseAdam: betas must be two numbers in [0, 1), got {self.betas}")


def _check_eps(optimizer: SparseSGD) -> None:
    # The fused kernels divide by sqrt(state) + eps: with eps = 0 an untouched element
    # would turn its weight into NaN.
    if not optimizer.eps > 0:
        raise ValueError(f"{type(optimizer).__name__}: eps must be > 0, got {optimizer.eps}")


SparseOptimizer = SparseSGD | SparseAdagrad | RowWiseAdagrad | SparseAdam

SPARSE_OPTIMIZERS: dict[str, type[SparseOptimizer]] = {
    "adam": SparseAdam, "adagrad": SparseAdagrad, "rowwise_adagrad": RowWiseAdagrad, "sgd": SparseSGD}
"""The sparse optimizers by the name a model's ``sparse_optimizer`` argument gives."""
