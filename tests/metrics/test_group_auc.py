import math

import pytest
import torch

from ctr_lightning.metrics import GroupAUC, group_auc


def pairwise_auc(scores, labels):
    """AUC by counting pairs: a positive above a negative counts 1, a tie 1/2."""
    pos = [s for s, y in zip(scores, labels) if y]
    neg = [s for s, y in zip(scores, labels) if not y]
    wins = sum((p > n) + 0.5 * (p == n) for p in pos for n in neg)
    return wins / (len(pos) * len(neg))


def reference_gauc(scores, labels, groups):
    total, weight = 0.0, 0
    for g in sorted(set(groups)):
        s = [x for x, gg in zip(scores, groups) if gg == g]
        y = [x for x, gg in zip(labels, groups) if gg == g]
        if 0 < sum(y) < len(y):
            total += pairwise_auc(s, y) * len(y)
            weight += len(y)
    return total / weight


def test_matches_pair_counting_with_ties_and_skips_one_class_groups():
    g = torch.Generator().manual_seed(0)
    n = 400
    scores = torch.randint(0, 12, (n,), generator=g).double() / 4  # many ties
    labels = torch.rand(n, generator=g) < 0.3
    groups = torch.randint(0, 30, (n,), generator=g) * 7919  # sparse group ids
    groups[:5] = 10**12  # a group of all ... whatever its labels: counted only with both classes
    labels[:5] = True
    got = group_auc(scores, labels, groups).item()
    assert got == pytest.approx(reference_gauc(scores.tolist(), labels.tolist(), groups.tolist()), abs=1e-6)


def test_metric_accumulates_batches_and_is_nan_without_a_mixed_group():
    metric = GroupAUC()
    metric.update(torch.tensor([0.1, 0.9]), torch.tensor([1.0, 1.0]), torch.tensor([1, 1]))
    assert math.isnan(metric.compute().item())
    metric.update(torch.tensor([2.0, -1.0, 0.5]), torch.tensor([1.0, 0.0, 0.0]), torch.tensor([2, 2, 2]))
    metric.update(torch.tensor([0.0]), torch.tensor([1.0]), torch.tensor([2]))
    # group 1: one class, skipped; group 2: positives at 2.0 and 0.0, negatives at -1.0 and 0.5 -> 3 of 4 pairs
    assert metric.compute().item() == pytest.approx(0.75)
    with pytest.raises(ValueError, match="shape"):
        metric.update(torch.zeros(3), torch.zeros(3), torch.zeros(2, dtype=torch.long))
