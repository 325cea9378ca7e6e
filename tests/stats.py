"""Chi-square tests shared by the statistical tests (the survival function of the
chi-square distribution is the regularised upper incomplete gamma)."""

import torch


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """P-value of observed counts against expected probabilities (cells with p > 0)."""
    counts, probs = counts.double().flatten(), probs.double().flatten()
    keep = probs > 0
    expected = probs[keep] / probs[keep].sum() * counts.sum()
    stat = ((counts[keep] - expected) ** 2 / expected).sum()
    return _survival(stat.item(), int(keep.sum()) - 1)


def homogeneity_pvalue(a: dict, b: dict) -> float:
    """P-value that two samples (outcome -> count) come from one distribution."""
    keys = sorted(set(a) | set(b))
    na, nb = sum(a.values()), sum(b.values())
    stat = 0.0
    for key in keys:
        total = a.get(key, 0) + b.get(key, 0)
        for count, n in ((a.get(key, 0), na), (b.get(key, 0), nb)):
            expected = total * n / (na + nb)
            stat += (count - expected) ** 2 / expected
    return _survival(stat, len(keys) - 1)


def _survival(stat: float, dof: int) -> float:
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))
