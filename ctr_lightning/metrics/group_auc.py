"""GAUC: the impression-weighted mean of per-group AUCs (per user, per query)."""

from __future__ import annotations

import torch
from torchmetrics import Metric
from torchmetrics.utilities.data import dim_zero_cat


class GroupAUC(Metric):
    """AUC within each group (a user, a query), averaged with each group's impressions as its
    weight; groups whose examples are all clicks or all non-clicks are skipped, as in
    Zhou et al. (2018, Alibaba DIN) and Baidu's reports. Ties in score count one half. NaN
    while no group has both classes. Synced over ranks (a group may span ranks).

    Example::

        m = GroupAUC()
        m.update(logits, labels, groups)     # groups: [B] integer user or query ids
        m.compute()
    """

    is_differentiable = False
    higher_is_better = True
    full_state_update = False

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)
        self.add_state("scores", default=[], dist_reduce_fx="cat")
        self.add_state("labels", default=[], dist_reduce_fx="cat")
        self.add_state("groups", default=[], dist_reduce_fx="cat")

    def update(self, logits: torch.Tensor, labels: torch.Tensor, groups: torch.Tensor) -> None:
        if not logits.shape == labels.shape == groups.shape:
            raise ValueError(f"GroupAUC: logits, labels and groups differ in shape: {tuple(logits.shape)}, "
                             f"{tuple(labels.shape)}, {tuple(groups.shape)}")
        # Logits rank as their probabilities do; the AUC needs only the order.
        self.scores.append(logits.detach().double())
        self.labels.append(labels.detach().bool())
        self.groups.append(groups.detach().long())

    def compute(self) -> torch.Tensor:
        if isinstance(self.scores, list) and not self.scores:  # synced over ranks, the states are tensors
            return torch.tensor(float("nan"))
        return group_auc(dim_zero_cat(self.scores), dim_zero_cat(self.labels), dim_zero_cat(self.groups))


def group_auc(scores: torch.Tensor, labels: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """GAUC of flat ``scores``, boolean ``labels`` and integer ``groups``; see :class:`GroupAUC`."""
    scores, labels, groups = scores.cpu(), labels.cpu(), groups.cpu()  # sorting and counting on the host
    order = torch.argsort(scores, stable=True)
    order = order[torch.argsort(groups[order], stable=True)]  # by group, then by score
    s, y, g = scores[order], labels[order].double(), groups[order]
    n = len(s)
    new_group = torch.ones(n, dtype=torch.bool)
    new_group[1:] = g[1:] != g[:-1]
    group_of = torch.cumsum(new_group.long(), 0) - 1
    starts = torch.nonzero(new_group).squeeze(1)
    rank = torch.arange(n, dtype=torch.float64) - starts[group_of].double() + 1  # 1-based, within the group
    # Tied scores in a group share the mean of their ranks.
    new_run = new_group.clone()
    new_run[1:] |= s[1:] != s[:-1]
    run_of = torch.cumsum(new_run.long(), 0) - 1
    runs = int(run_of[-1]) + 1 if n else 0
    run_rank = torch.zeros(runs, dtype=torch.float64).index_add_(0, run_of, rank)
    run_size = torch.zeros(runs, dtype=torch.float64).index_add_(0, run_of, torch.ones(n, dtype=torch.float64))
    rank = (run_rank / run_size)[run_of]
    num_groups = len(starts)
    positives = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, group_of, y)
    size = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, group_of, torch.ones(n, dtype=torch.float64))
    negatives = size - positives
    positive_ranks = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, group_of, rank * y)
    both = (positives > 0) & (negatives > 0)
    if not bool(both.any()):
        return torch.tensor(float("nan"))
    auc = (positive_ranks[both] - positives[both] * (positives[both] + 1) / 2) / (positives[both] * negatives[both])
    return ((auc * size[both]).sum() / size[both].sum()).float()
