"""Maximum-weight assignment of rows to distinct columns (the Hungarian method with potentials,
O(n²m)), vectorised over columns with numpy. Used to map logical bins onto physical servers."""

from __future__ import annotations

import numpy as np


def max_weight_assignment(score: np.ndarray) -> np.ndarray:
    """`score[i, j]` for rows i < n and columns j < m, n <= m. Returns, for each row, its column, such
    that the total score is maximal and no column is used twice."""
    n, m = score.shape
    if n > m:
        raise ValueError(f"cannot assign {n} rows to {m} columns")
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    # Rows with no positive score cannot gain anything: solve the others, then hand them what is left.
    active = np.flatnonzero((score > 0).any(axis=1) | (score < 0).any(axis=1))
    result = np.full(n, -1, dtype=np.int64)
    if active.size:
        result[active] = _hungarian_min(-score[active])
    free = iter(sorted(set(range(m)) - set(result[active].tolist())))
    for row in np.flatnonzero(result < 0):
        result[row] = next(free)
    return result


def _hungarian_min(cost: np.ndarray) -> np.ndarray:
    """Minimum-cost assignment for an n x m matrix, n <= m (1-indexed internally, column 0 a sentinel)."""
    n, m = cost.shape
    row_pot = np.zeros(n + 1)
    col_pot = np.zeros(m + 1)
    owner = np.zeros(m + 1, dtype=np.int64)  # owner[j]: the row matched to column j (0 = none)
    way = np.zeros(m + 1, dtype=np.int64)
    for row in range(1, n + 1):
        owner[0] = row
        col = 0
        min_slack = np.full(m + 1, np.inf)
        used = np.zeros(m + 1, dtype=bool)
        while True:
            used[col] = True
            r = owner[col]
            slack = cost[r - 1] - row_pot[r] - col_pot[1:]
            free = ~used[1:]
            better = free & (slack < min_slack[1:])
            min_slack[1:][better] = slack[better]
            way[1:][better] = col
            candidates = np.where(free, min_slack[1:], np.inf)
            nxt = int(np.argmin(candidates)) + 1
            delta = candidates[nxt - 1]
            row_pot[owner[used]] += delta
            col_pot[used] -= delta
            min_slack[~used] -= delta
            col = nxt
            if owner[col] == 0:
                break
        while col:  # flip the augmenting path
            prev = way[col]
            owner[col] = owner[prev]
            col = prev
    assignment = np.zeros(n, dtype=np.int64)
    for j in range(1, m + 1):
        if owner[j]:
            assignment[owner[j] - 1] = j - 1
    return assignment
