"""The adaptive tree budget: how many nodes each step's trees get, for the most tokens per second.

Each step the drafter builds every session's DDTree at its cap (the request's budget, or
the room it has left) and then cuts all of them to one budget b, chosen from the
candidates {0} and the verifier's tree buckets: the verify step pads every tree to the
largest, so a common budget is what the batch's cost depends on. For each candidate

    rate(b) = sum over sessions of (1 + alpha * gain_s(b))  /  (overhead + verify(B, 1 + b))

where gain_s(b) is the sum of the draft's path probabilities of the tree's first b nodes
(`common.tree.expected_gains`: the accepted length if the draft were calibrated), alpha
calibrates that against the acceptance observed, verify(B, T) is the verifier's measured
step time for B sessions of T nodes (its cost table, `InfoResponse.verify_costs`), and
overhead is the rest of a step (draft, tree build, link) as observed. With messages of trees
in flight side by side (pipelined rounds) a step's cost is the time between two replies, not
its own round trip, which also holds the other messages' verifies: counted as overhead, those
would make big trees look cheap. Budget 0 (plain decoding) is always a candidate, so
speculation never plans to be slower than plain batched decoding; while it is chosen, every
`explore_every`-th step uses the smallest non-zero candidate so that alpha keeps being
measured.

With the verifier in the drafter's process the trees stay on the device
(`common.tree.DeviceTrees`), and a step's budget is chosen before its trees reach the host:
gain_s(b) is then that of the session's previous tree (`drafter.build_trees`).

The planner holds no tensors: the scheduler gives it numbers and applies the budget.
"""
from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class BudgetChoice:
    """One step's budget, and what the planner expected of it (for `BudgetPlanner.observe`)."""
    budget: int
    batch: int                # sessions in the step
    nodes: int                # the largest tree's nodes, root included
    predicted_gain: float     # sum over the drafted sessions of gain_s(budget), before calibration


class BudgetPlanner:
    """Chooses each step's tree budget from a verify cost table and observed step times."""

    def __init__(self, verify_costs: Mapping[tuple[int, int], float], *, explore_every: int = 16,
                 smoothing: float = 0.2):
        if not verify_costs:
            raise ValueError("the adaptive budget needs the verifier's cost table")
        if any(b < 1 or t < 1 or not s > 0 for (b, t), s in verify_costs.items()):
            raise ValueError("verify costs need batch >= 1, tokens >= 1 and seconds > 0")
        self.costs = dict(verify_costs)
        self.batches = sorted({b for b, _ in self.costs})
        self.tokens = {b: sorted(t for bb, t in self.costs if bb == b) for b in self.batches}
        self.explore_every, self.smoothing = explore_every, smoothing
        self.alpha = 1.0  # observed accepted drafted tokens / predicted
        self._accepted = self._predicted = 0.0  # smoothed sums behind alpha
        self._overhead: dict[int, float] = {}  # per batch bucket: step time beyond the verify step
        self._since_drafted = 0
        self._last: int | None = None  # the budget chosen last

    # -- the model --------------------------------------------------------------------------

    def verify_time(self, batch: int, tokens: int) -> float:
        """The verify step for `batch` trees of `tokens` nodes: the table's smallest bucket that
        holds it, or past the table's end, its largest entry scaled linearly."""
        i = bisect.bisect_left(self.batches, batch)
        b = self.batches[min(i, len(self.batches) - 1)]
        scale = batch / b if i == len(self.batches) else 1.0
        ts = self.tokens[b]
        j = bisect.bisect_left(ts, tokens)
        t = ts[min(j, len(ts) - 1)]
        if j == len(ts):
            scale *= tokens / t
        return self.costs[(b, t)] * scale

    def overhead(self, batch: int) -> float:
        """The observed rest of a step at this batch size (0 until one is observed)."""
        return self._overhead.get(self._bucket(batch), 0.0)

    def candidates(self, cap: int) -> list[int]:
        """Budgets worth weighing up to `cap`: 0, each tree bucket below it, and the cap itself."""
        return sorted({0, cap} | {t - 1 for ts in self.tokens.values() for t in ts if 0 < t - 1 < cap})

    def build_width(self, cap: int) -> int:
        """How many nodes to select this step (before the cut), at most `cap`: one candidate
        above the last choice, so the budget can climb one bucket per step, and the tree build
        (whose cost grows with its width) never pays for budgets far above what is chosen."""
        if self._last is None:
            return cap
        return next((c for c in self.candidates(cap) if c > self._last), cap)

    # -- per step -----------------------------------------------------------------------------

    def choose(self, gains: Sequence[np.ndarray], caps: Sequence[int], batch: int, *, floor_nodes: int = 1,
               fixed_gain: float = 0.0) -> BudgetChoice:
        """The budget for a step of `batch` sessions: the adapting ones have expected gains
        `gains[s]` (column b: the gain of b nodes, `common.tree.expected_gains`) and caps
        `caps[s]`; the others keep trees of up to `floor_nodes` nodes (root included) with an
        expected gain of `fixed_gain` in all, or emit one token whatever the budget."""
        cap = max(caps, default=0)
        if cap == 0:
            return BudgetChoice(0, batch, floor_nodes, 0.0)

        def gain(b: int) -> float:
            return sum(float(g[min(b, c, g.shape[0] - 1)]) for g, c in zip(gains, caps))

        best, best_rate = 0, -1.0
        for b in self.candidates(cap):
            nodes = max(floor_nodes, 1 + b)
            rate = (batch + self.alpha * (gain(b) + fixed_gain)) / (self.overhead(batch) + self.verify_time(batch, nodes))
            if rate > best_rate * (1 + 1e-9):  # ties: the smaller budget
                best, best_rate = b, rate
        if best == 0:
            self._since_drafted += 1
            if self._since_drafted >= self.explore_every:
                best = self.candidates(cap)[1]
        if best > 0:
            self._since_drafted = 0
        self._last = best
        return BudgetChoice(best, batch, max(floor_nodes, 1 + min(best, cap)), gain(best))

    def observe(self, choice: BudgetChoice, step_s: float, accepted: int) -> None:
        """What the step cost (from drafting to its reply, or pipelined, from the previous reply
        to its own) and how many drafted tokens its sessions got accepted."""
        a = self.smoothing
        bucket = self._bucket(choice.batch)
        rest = max(0.0, step_s - self.verify_time(choice.batch, choice.nodes))
        self._overhead[bucket] = rest if bucket not in self._overhead else (1 - a) * self._overhead[bucket] + a * rest
        if choice.budget > 0:
            self._accepted = (1 - a) * self._accepted + a * accepted
            self._predicted = (1 - a) * self._predicted + a * choice.predicted_gain
            if self._predicted > 1e-9:
                self.alpha = min(100.0, max(0.01, self._accepted / self._predicted))

    def _bucket(self, batch: int) -> int:
        i = bisect.bisect_left(self.batches, batch)
        return self.batches[min(i, len(self.batches) - 1)]
