import itertools

import numpy as np
import pytest

from loraplex.placement.assignment import max_weight_assignment


@pytest.mark.parametrize("seed", range(60))
def test_matches_brute_force(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 6))
    m = int(rng.integers(n, 7))
    score = rng.integers(-3, 6, size=(n, m)).astype(float) * (rng.random((n, m)) < 0.6)
    columns = max_weight_assignment(score)
    assert len(set(columns.tolist())) == n and all(0 <= c < m for c in columns)
    best = max(sum(score[i, p[i]] for i in range(n)) for p in itertools.permutations(range(m), n))
    assert score[np.arange(n), columns].sum() == pytest.approx(best)


def test_identity_is_kept_for_a_diagonal_score():
    perm = np.random.default_rng(0).permutation(50)
    score = np.eye(50)[perm]
    assert (max_weight_assignment(score) == perm).all()


def test_more_rows_than_columns_is_an_error():
    with pytest.raises(ValueError, match="cannot assign"):
        max_weight_assignment(np.zeros((3, 2)))
