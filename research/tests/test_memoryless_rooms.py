"""research/memoryless_rooms.py: the exact success of a policy of the observation alone on rooms without the hint."""

from __future__ import annotations

import numpy as np
import pytest

def test_the_memoryless_success_is_exact_and_no_memoryless_policy_found_wins_more_than_half():
    from research.memoryless_rooms import best_memoryless, memoryless_success

    # 3 rooms, 3 steps, uniform: half win at once; the others reach the far end, come back (1/4) and go on (1/8).
    assert memoryless_success(np.full(3, 0.5), 3) == pytest.approx(0.5 + 0.5 * 0.5 * 0.5)
    assert memoryless_success(np.ones(9), 14) == 0.5  # always west: exactly the west tasks
    assert memoryless_success(np.full(9, 0.5), 14) == pytest.approx(0.30188, abs=1e-5)
    best, policy = best_memoryless(9, 14, restarts=2)
    assert 0.5 <= best < 0.51 and len(policy) == 9
