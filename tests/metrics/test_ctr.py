import math

import torch

from ctr_lightning.metrics import Calibration, LogLoss, NormalizedEntropy


def test_logloss_and_normalized_entropy_match_their_definitions():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(1000, generator=gen)
    labels = (torch.rand(1000, generator=gen) < 0.3).float()
    ll, ne = LogLoss(), NormalizedEntropy()
    for part in range(4):  # streamed in pieces, as validation batches are
        s = slice(part * 250, (part + 1) * 250)
        ll.update(logits[s], labels[s])
        ne.update(logits[s], labels[s])
    p = torch.sigmoid(logits.double())
    want = -(labels * p.log() + (1 - labels) * (1 - p).log()).mean()
    assert math.isclose(ll.compute().item(), want.item(), rel_tol=1e-6)
    rate = labels.mean().item()
    base = -(rate * math.log(rate) + (1 - rate) * math.log(1 - rate))
    assert math.isclose(ne.compute().item(), want.item() / base, rel_tol=1e-6)


def test_predicting_the_base_rate_has_normalized_entropy_one():
    labels = torch.tensor([1.0, 0, 0, 0])
    logit = math.log(0.25 / 0.75)
    ne = NormalizedEntropy()
    ne.update(torch.full((4,), logit), labels)
    assert math.isclose(ne.compute().item(), 1.0, rel_tol=1e-6)


def test_calibration_is_mean_predicted_over_mean_observed_click_rate():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(1000, generator=gen) - 1.0
    labels = (torch.rand(1000, generator=gen) < 0.2).float()
    m = Calibration()
    for part in range(4):
        s = slice(part * 250, (part + 1) * 250)
        m.update(logits[s], labels[s])
    want = torch.sigmoid(logits.double()).mean() / labels.double().mean()
    assert math.isclose(m.compute().item(), want.item(), rel_tol=1e-6)
    # Predicting every example's observed rate exactly is calibrated.
    exact = Calibration()
    exact.update(torch.full((4,), math.log(0.25 / 0.75)), torch.tensor([1.0, 0, 0, 0]))
    assert math.isclose(exact.compute().item(), 1.0, rel_tol=1e-6)
    assert math.isnan(Calibration().compute().item())  # no click seen yet
