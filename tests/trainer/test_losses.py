"""Each preference loss against its published formula, on small hand-built tensors.

The expected values are written out per element with ``math`` (not with the functions
under test), so a sign, a missing beta or a swapped term shows up as a mismatch.
"""

from __future__ import annotations

import math

import pytest
import torch

from services.trainer.losses import dpo_loss, kto_kl, kto_loss, kto_weights, orpo_loss, simpo_loss

PC = torch.tensor([-3.0, -5.0, -2.0])  # policy chosen (summed log-probs)
PR = torch.tensor([-4.0, -3.5, -6.0])  # policy rejected
RC = torch.tensor([-3.5, -5.0, -2.5])  # reference chosen
RR = torch.tensor([-3.5, -4.0, -5.0])  # reference rejected


def logsig(x: float) -> float:
    return -math.log1p(math.exp(-x))


def h(i: int) -> float:
    return (float(PC[i]) - float(RC[i])) - (float(PR[i]) - float(RR[i]))


@pytest.mark.parametrize("beta", [0.1, 0.5])
def test_dpo_sigmoid_is_rafailov(beta: float) -> None:
    losses, stats = dpo_loss(PC, PR, RC, RR, beta)
    expected = [-logsig(beta * h(i)) for i in range(3)]
    assert losses.tolist() == pytest.approx(expected, abs=1e-6)
    # hand values: h = [1.0, -0.5, 1.5]
    assert [h(i) for i in range(3)] == [1.0, -0.5, 1.5]
    assert stats["reward_accuracy"] == pytest.approx(2 / 3)
    assert stats["reward_margin"] == pytest.approx(beta * (1.0 - 0.5 + 1.5) / 3, abs=1e-6)


def test_dpo_ipo_is_azar_squared_loss() -> None:
    beta = 0.25  # 1 / (2 beta) = 2
    losses, _ = dpo_loss(PC, PR, RC, RR, beta, "ipo")
    assert losses.tolist() == pytest.approx([(1.0 - 2) ** 2, (-0.5 - 2) ** 2, (1.5 - 2) ** 2], abs=1e-6)


def test_dpo_hinge_is_slic() -> None:
    beta = 2.0
    losses, _ = dpo_loss(PC, PR, RC, RR, beta, "hinge")
    # max(0, 1 - beta h): h = 1 -> 0, h = -0.5 -> 2, h = 1.5 -> 0
    assert losses.tolist() == pytest.approx([0.0, 2.0, 0.0], abs=1e-6)


def test_unknown_loss_type_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown DPO loss_type 'nope'"):
        dpo_loss(PC, PR, RC, RR, 0.1, "nope")


def test_simpo_is_meng_length_normalised_margin() -> None:
    avg_c = torch.tensor([-0.5, -1.0])
    avg_r = torch.tensor([-1.0, -0.8])
    beta, gamma = 2.0, 0.5
    losses, stats = simpo_loss(avg_c, avg_r, beta, gamma)
    expected = [
        -logsig(beta * (-0.5) - beta * (-1.0) - gamma),
        -logsig(beta * (-1.0) - beta * (-0.8) - gamma),
    ]
    assert losses.tolist() == pytest.approx(expected, abs=1e-6)
    assert expected[0] == pytest.approx(-logsig(0.5))  # 2*0.5 - 0.5
    assert stats["chosen_reward"] == pytest.approx(beta * -0.75)
    assert stats["reward_accuracy"] == 0.5


def test_orpo_is_hong_nll_plus_odds_ratio() -> None:
    avg_c = torch.tensor([-0.2, -1.5])
    avg_r = torch.tensor([-1.0, -0.7])
    lam = 0.1

    def log_odds(a: float) -> float:
        p = math.exp(a)
        return math.log(p / (1 - p))

    losses, stats = orpo_loss(avg_c, avg_r, lam)
    expected = []
    for c, r in ((-0.2, -1.0), (-1.5, -0.7)):
        expected.append(-c - lam * logsig(log_odds(c) - log_odds(r)))
    assert losses.tolist() == pytest.approx(expected, abs=1e-5)
    assert stats["nll"] == pytest.approx((0.2 + 1.5) / 2)
    assert math.isfinite(float(orpo_loss(torch.tensor([0.0]), torch.tensor([-1.0]), lam)[0]))


def test_kto_kl_is_clamped_detached_mean_of_mismatched_log_ratios() -> None:
    pol = torch.tensor([-3.0, -2.0, -5.0], requires_grad=True)
    ref = torch.tensor([-3.5, -2.5, -4.0])
    kl = kto_kl(pol, ref)
    assert float(kl) == pytest.approx((0.5 + 0.5 - 1.0) / 3 + 0.0, abs=1e-7)  # mean is 0
    assert not kl.requires_grad
    assert float(kto_kl(torch.tensor([-4.0]), torch.tensor([-3.0]))) == 0.0  # negative mean -> 0
    assert float(kto_kl(torch.tensor([-2.0, -1.0]), torch.tensor([-3.0, -3.0]))) == pytest.approx(1.5)


def test_kto_is_ethayarajh_with_weights() -> None:
    pol = torch.tensor([-3.0, -5.0, -2.0, -4.0])
    ref = torch.tensor([-3.5, -4.0, -2.0, -4.5])
    label = torch.tensor([True, True, False, False])
    beta, kl, wd, wu = 0.5, torch.tensor(0.2), 1.5, 0.7
    losses, stats = kto_loss(pol, ref, label, kl, beta, wd, wu)

    def sig(x: float) -> float:
        return 1 / (1 + math.exp(-x))

    r = [0.5, -1.0, 0.0, 0.5]  # pol - ref
    expected = [
        wd * (1 - sig(beta * (r[0] - 0.2))),
        wd * (1 - sig(beta * (r[1] - 0.2))),
        wu * (1 - sig(beta * (0.2 - r[2]))),
        wu * (1 - sig(beta * (0.2 - r[3]))),
    ]
    assert losses.tolist() == pytest.approx(expected, abs=1e-6)
    # rewards beta*r = [0.25, -0.5, 0, 0.25]: sign matches the label for row 0 only
    assert stats["reward_accuracy"] == pytest.approx(0.25)
    assert stats["reward_margin"] == pytest.approx((0.25 - 0.5) / 2 - (0.0 + 0.25) / 2)
    assert stats["kl"] == pytest.approx(0.2)


@pytest.mark.parametrize(
    ("n_d", "n_u", "given", "expected"),
    [
        # mostly thumbs down and a few corrections: the desirable rows are weighted up to ratio 1
        (31, 70, (None, None), (70 / 31, 1.0)),
        # mostly thumbs up: the undesirable rows are weighted up to ratio 4/3
        (139, 20, (None, None), (1.0, 139 / (20 * 4 / 3))),
        (100, 90, (None, None), (1.0, 1.0)),  # already in [1, 4/3]
        (31, 70, (1.0, 1.0), (1.0, 1.0)),  # both given: kept as given
        (31, 70, (None, 2.0), (140 / 31, 2.0)),  # one given: the other balances against it
        (0, 70, (None, None), (1.0, 1.0)),  # one label only: nothing to balance
        (1, 10_000, (None, None), (100.0, 1.0)),  # capped at the largest weight a job accepts
    ],
)
def test_kto_weights_balance_the_counts_into_the_papers_range(
    n_d: int, n_u: int, given: tuple[float | None, float | None], expected: tuple[float, float]
) -> None:
    w_d, w_u = kto_weights(n_d, n_u, *given)
    assert (w_d, w_u) == pytest.approx(expected)
    if given == (None, None) and n_d and w_d < 100:
        assert 1.0 - 1e-9 <= w_d * n_d / (w_u * n_u) <= 4 / 3 + 1e-9


def test_kto_gradient_pushes_desirable_up_and_undesirable_down() -> None:
    pol = torch.tensor([-3.0, -3.0], requires_grad=True)
    losses, _ = kto_loss(pol, torch.tensor([-3.0, -3.0]), torch.tensor([True, False]), torch.tensor(0.0), 0.1)
    losses.sum().backward()
    assert pol.grad is not None
    assert float(pol.grad[0]) < 0 < float(pol.grad[1])  # descent raises row 0's log-prob, lowers row 1's
