"""The random ops under `ops.use_kernels()` (ops/sampling.py) keep PyTorch's contract: `torch.manual_seed(s)`
(or a `generator=` seeded alike) makes a draw reproducible and the next draw different, and the numbers
have their distribution's mean, variance and shape (the Kolmogorov-Smirnov statistic against the exact
distribution function, under the 1% critical value; checked against scipy's where scipy is installed)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import ops
from ops.aten import calls
from tests.ops.conftest import DEVICE

N = 20000
N_PICKS = 2000  # multinomial's draws: each is a row of the arg-max kernel, slow under the interpreter


def ks_1pct(n: int) -> float:
    """The Kolmogorov-Smirnov statistic's 1% critical value for n draws."""
    return 1.63 / math.sqrt(n)


# Each op's draw of N numbers from a generator (None: the default one), and the ATen op it reaches.
DRAWS = {
    "randn": ("normal_", lambda g: torch.randn(N, generator=g, device=DEVICE)),
    "uniform_": ("uniform_", lambda g: torch.empty(N, device=DEVICE).uniform_(-1, 3, generator=g)),
    "normal_": ("normal_", lambda g: torch.empty(N, device=DEVICE).normal_(2, 0.5, generator=g)),
    "exponential_": ("exponential_", lambda g: torch.empty(N, device=DEVICE).exponential_(2.0, generator=g)),
    "bernoulli_": ("bernoulli_.float", lambda g: torch.empty(N, device=DEVICE).bernoulli_(0.3, generator=g)),
    "multinomial": ("multinomial", lambda g: torch.multinomial(
        torch.tensor([0.1, 0.0, 0.6, 0.3], device=DEVICE), N_PICKS, replacement=True, generator=g)),
}


def _drawn(name: str, generator) -> torch.Tensor:
    aten, draw = DRAWS[name]
    before = calls[aten]
    with ops.use_kernels(include=[aten]):
        out = draw(generator)
    assert calls[aten] > before, f"{name}: the call did not reach our kernel"
    return out


@pytest.mark.parametrize("with_generator", [False, True], ids=["default", "generator"])
@pytest.mark.parametrize("name", list(DRAWS))
def test_a_seed_makes_every_draw_reproducible_and_the_next_draw_differ(name, with_generator):
    def seeded(seed):
        if with_generator:
            return torch.Generator(device=DEVICE).manual_seed(seed)
        torch.manual_seed(seed)
        return None

    gen = seeded(7)
    first, second = _drawn(name, gen), _drawn(name, gen)
    gen = seeded(7)
    assert torch.equal(_drawn(name, gen), first)
    assert torch.equal(_drawn(name, gen), second)
    assert not torch.equal(first, second)
    assert not torch.equal(_drawn(name, seeded(8)), first)


def test_a_generator_is_advanced_and_the_default_one_left_alone():
    gen = torch.Generator(device=DEVICE).manual_seed(3)
    state = gen.get_state()
    torch.manual_seed(5)
    default = torch.default_generator.get_state()
    _drawn("uniform_", gen)
    assert not torch.equal(gen.get_state(), state)
    assert torch.equal(torch.default_generator.get_state(), default)


def test_dropout_is_reproducible_under_a_seed():
    x = torch.ones(4000, device=DEVICE)

    def dropped():
        with ops.use_kernels(include=["native_dropout", "bernoulli_"]):
            return F.dropout(x, 0.3, training=True)

    torch.manual_seed(11)
    first, second = dropped(), dropped()
    torch.manual_seed(11)
    assert torch.equal(dropped(), first) and not torch.equal(first, second)
    kept = first != 0
    assert abs(kept.float().mean().item() - 0.7) < 3 * math.sqrt(0.21 / 4000)
    torch.testing.assert_close(first[kept], torch.full_like(first[kept], 1 / 0.7))


def ks_statistic(samples: torch.Tensor, cdf) -> float:
    """sup |F_n(x) - F(x)| over the sorted samples (both sides of each step)."""
    x = samples.double().sort().values.cpu()
    f = cdf(x)
    n = x.numel()
    above = torch.arange(1, n + 1, dtype=torch.float64) / n - f
    below = f - torch.arange(0, n, dtype=torch.float64) / n
    return max(above.max().item(), below.max().item())


def _check_ks(samples: torch.Tensor, cdf, scipy_dist: str, args: tuple) -> None:
    d = ks_statistic(samples, cdf)
    assert d < ks_1pct(samples.numel()), d
    try:
        from scipy import stats
    except ImportError:
        return
    result = stats.kstest(samples.double().cpu().numpy(), scipy_dist, args=args)
    assert abs(result.statistic - d) < 1e-9 and result.pvalue > 0.01


def test_uniform_normal_and_exponential_have_their_distributions():
    torch.manual_seed(0)
    u = _drawn("uniform_", None)
    assert u.min() >= -1 and u.max() < 3
    assert abs(u.mean().item() - 1) < 4 * math.sqrt(16 / 12 / N) and abs(u.var().item() - 16 / 12) < 0.05
    _check_ks(u, lambda x: ((x + 1) / 4).clamp(0, 1), "uniform", (-1, 4))
    n = _drawn("normal_", None)
    assert abs(n.mean().item() - 2) < 4 * 0.5 / math.sqrt(N) and abs(n.var().item() - 0.25) < 0.01
    _check_ks(n, lambda x: 0.5 * (1 + torch.erf((x - 2) / (0.5 * math.sqrt(2)))), "norm", (2, 0.5))
    e = _drawn("exponential_", None)
    assert e.min() >= 0 and abs(e.mean().item() - 0.5) < 4 * 0.5 / math.sqrt(N)
    assert abs(e.var().item() - 0.25) < 0.02
    _check_ks(e, lambda x: 1 - torch.exp(-2 * x), "expon", (0, 0.5))


def test_bernoulli_and_multinomial_have_their_distributions():
    torch.manual_seed(1)
    b = _drawn("bernoulli_", None)
    assert set(b.unique().tolist()) <= {0.0, 1.0}
    assert abs(b.mean().item() - 0.3) < 4 * math.sqrt(0.21 / N) and abs(b.var().item() - 0.21) < 0.01
    m = _drawn("multinomial", None)
    share = torch.bincount(m.cpu(), minlength=4).double() / N_PICKS
    expected = torch.tensor([0.1, 0.0, 0.6, 0.3], dtype=torch.float64)
    assert share[1] == 0
    # The KS statistic of a categorical draw: the largest gap between its running share and the probabilities'.
    d = (share.cumsum(0) - expected.cumsum(0)).abs().max().item()
    assert d < ks_1pct(N_PICKS), (d, share)
    without = _drawn_without_replacement(torch.tensor([[0.1, 0.0, 0.6, 0.3]] * 400, device=DEVICE))
    assert all(sorted(row) == [0, 2, 3] for row in without.tolist())  # distinct, never the zero category
    first = torch.bincount(without[:, 0].cpu(), minlength=4).double() / 400
    assert abs(first[2].item() - 0.6) < 4 * math.sqrt(0.24 / 400)


def _drawn_without_replacement(probs):
    with ops.use_kernels(include=["multinomial"]):
        return torch.multinomial(probs, 3)


def test_multinomial_takes_the_zero_categories_last_without_replacement():
    with ops.use_kernels(include=["multinomial"]):
        picks = torch.multinomial(torch.tensor([0.5, 0.0, 0.5], device=DEVICE), 3)
    assert sorted(picks[:2].tolist()) == [0, 2] and picks[2].item() == 1


def test_multinomial_refuses_what_pytorch_refuses():
    cases = [(torch.tensor([0.5, -0.1, 0.6]), 1, False), (torch.tensor([0.0, 0.0]), 1, True),
             (torch.tensor([1.0, float("nan")]), 1, True), (torch.ones(2, 2, 2), 1, True),
             (torch.tensor([0.5, 0.5]), 3, False)]
    for probs, n, replacement in cases:
        with pytest.raises(RuntimeError) as theirs:
            torch.multinomial(probs.to(DEVICE), n, replacement)
        with ops.use_kernels(include=["multinomial"]), pytest.raises(RuntimeError) as ours:
            torch.multinomial(probs.to(DEVICE), n, replacement)
        assert str(ours.value).split("(")[0].strip() in str(theirs.value), (str(ours.value), str(theirs.value))
