"""The settings of a synthetic Criteo world (the generator is
:class:`ctr_lightning.datamodules.synthetic_criteo.SyntheticCriteo`)."""

from __future__ import annotations

from dataclasses import dataclass

from ctr_lightning.checkpoint_safe import checkpoint_safe


@checkpoint_safe(formerly="ctr_lightning.datamodules.synthetic_criteo")
@dataclass(frozen=True)
class SyntheticCriteoSpec:
    """The planted world behind a synthetic Criteo log.

    Args:
        seed: everything (values, effects, rows) is a function of the seed.
        max_cardinality: cap on each feature's Criteo Kaggle cardinality.
        zipf_exponent: frequency of the value of rank r is proportional to r^-s.
        click_rate: the bias is calibrated so the mean click probability is this.
        value_effect_scale: scale of the per-(feature, value) logit effects.
        num_interactions: number of planted pairwise feature interactions.
        interaction_rank: rank of each planted interaction.

    Example::

        spec = SyntheticCriteoSpec(seed=1, max_cardinality=100_000)
        SyntheticCriteo(spec).write("data/day_0.tsv", rows=100_000)
    """

    seed: int = 0
    max_cardinality: int = 1_000_000
    zipf_exponent: float = 1.1
    click_rate: float = 0.25
    value_effect_scale: float = 0.7
    num_interactions: int = 6
    interaction_rank: int = 4

    def __post_init__(self) -> None:
        if self.max_cardinality < 1:
            raise ValueError(f"max_cardinality must be >= 1, got {self.max_cardinality}")
        if self.zipf_exponent <= 0:
            raise ValueError(f"zipf_exponent must be > 0, got {self.zipf_exponent}")
        if not 0.0 < self.click_rate < 1.0:
            raise ValueError(f"click_rate must be in (0, 1), got {self.click_rate}")
