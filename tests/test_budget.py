"""The adaptive tree budget's planner: its cost model, its choice, its calibration."""
from __future__ import annotations

import numpy as np
import pytest

from drafter_svc.budget import BudgetPlanner

# A verify step of B sessions x T nodes: 4 ms plus 0.02 ms per token (a GPU-like shape).
TABLE = {(b, t): 0.004 + 0.00002 * b * t for b in (1, 8, 32) for t in (1, 9, 17, 33, 65)}


def gains_of(probs: list[float]) -> np.ndarray:
    """Expected gains (column b: the first b nodes) of a tree whose nodes have these path probabilities."""
    return np.concatenate(([0.0], np.cumsum(probs)))


def brute_force(planner: BudgetPlanner, gains, caps, batch) -> int:
    """The candidate of the highest rate, the smaller one on ties."""
    def rate(b):
        gain = sum(g[min(b, c)] for g, c in zip(gains, caps))
        return (batch + planner.alpha * gain) / (planner.overhead(batch) + planner.verify_time(batch, 1 + b))
    cands = planner.candidates(max(caps))
    return max(cands, key=lambda b: (rate(b), -b))


def test_verify_time_looks_up_the_bucket_and_extrapolates_past_the_table():
    planner = BudgetPlanner(TABLE)
    assert planner.verify_time(1, 1) == TABLE[(1, 1)]
    assert planner.verify_time(5, 10) == TABLE[(8, 17)]  # the smallest bucket that holds it
    assert planner.verify_time(32, 130) == pytest.approx(TABLE[(32, 65)] * 130 / 65)
    assert planner.verify_time(64, 17) == pytest.approx(TABLE[(32, 17)] * 2)


def test_candidates_are_zero_the_buckets_below_the_cap_and_the_cap():
    planner = BudgetPlanner(TABLE)
    assert planner.candidates(16) == [0, 8, 16]
    assert planner.candidates(20) == [0, 8, 16, 20]
    assert planner.candidates(100) == [0, 8, 16, 32, 64, 100]


def test_confident_drafts_get_big_trees_and_hopeless_ones_plain_decoding():
    planner = BudgetPlanner(TABLE)
    sure = [gains_of([0.95 ** (i + 1) for i in range(64)])] * 8
    assert planner.choose(sure, [64] * 8, 8).budget > 8
    hopeless = [gains_of([1e-4] * 64)] * 32
    assert planner.choose(hopeless, [64] * 32, 32).budget == 0


@pytest.mark.parametrize("seed", range(20))
def test_choice_maximises_the_modelled_rate(seed):
    rng = np.random.default_rng(seed)
    planner = BudgetPlanner(TABLE, explore_every=10**9)
    planner.alpha = float(rng.uniform(0.2, 3))
    batch = int(rng.choice([1, 5, 8, 20, 32]))
    drafted = int(rng.integers(1, batch + 1))
    caps = [int(c) for c in rng.choice([0, 4, 16, 40, 64], size=drafted)]
    if max(caps) == 0:
        caps[0] = 16
    gains = [gains_of(np.sort(rng.uniform(0, 1, 64) ** rng.uniform(1, 12))[::-1]) for _ in caps]
    choice = planner.choose(gains, caps, batch)
    assert choice.budget == brute_force(planner, gains, caps, batch)
    assert choice.nodes == 1 + min(choice.budget, max(caps))
    assert choice.predicted_gain == pytest.approx(sum(g[min(choice.budget, c)] for g, c in zip(gains, caps)))


def test_sessions_it_may_not_cut_set_a_floor_on_the_nodes():
    planner = BudgetPlanner(TABLE)
    weak = [gains_of([1e-4] * 64)] * 4
    # Alone, plain decoding; beside a fixed 32-node tree the step costs as much anyway.
    assert planner.choose(weak, [32] * 4, 8).budget == 0
    choice = planner.choose(weak, [32] * 4, 8, floor_nodes=33, fixed_gain=3.0)
    assert choice.nodes == 33


def test_plain_decoding_is_interrupted_to_keep_measuring_acceptance():
    planner = BudgetPlanner(TABLE, explore_every=4)
    hopeless = [gains_of([1e-4] * 16)] * 8
    budgets = [planner.choose(hopeless, [16] * 8, 8).budget for _ in range(12)]
    assert budgets == [0, 0, 0, 8] * 3


def test_observation_calibrates_alpha_and_learns_the_overhead():
    planner = BudgetPlanner(TABLE)
    gains = [gains_of([0.5] * 16)] * 8
    for _ in range(60):
        choice = planner.choose(gains, [16] * 8, 8)
        # The sessions get twice what the draft promises; the step takes 3 ms beyond its verify step.
        planner.observe(choice, planner.verify_time(8, choice.nodes) + 0.003, round(2 * choice.predicted_gain))
    assert planner.alpha == pytest.approx(2.0, rel=0.05)
    assert planner.overhead(8) == pytest.approx(0.003, rel=1e-6)
    assert planner.overhead(1) == 0.0  # another batch bucket: nothing observed yet


@pytest.mark.parametrize("table", [{}, {(0, 9): 0.1}, {(1, 0): 0.1}, {(1, 9): 0.0}, {(1, 9): float("nan")}])
def test_bad_cost_tables_are_refused(table):
    with pytest.raises(ValueError):
        BudgetPlanner(table)


def test_build_width_climbs_one_candidate_above_the_last_choice():
    planner = BudgetPlanner(TABLE, explore_every=10**9)
    assert planner.build_width(64) == 64  # nothing chosen yet
    hopeless = [gains_of([1e-4] * 64)] * 32
    assert planner.choose(hopeless, [64] * 32, 32).budget == 0
    assert planner.build_width(64) == 8 and planner.build_width(4) == 4
    sure = [gains_of([0.99] * 8)] * 32  # cut to the width: gains known up to 8 nodes only
    assert planner.choose(sure, [8] * 32, 32).budget == 8
    assert planner.build_width(64) == 16
