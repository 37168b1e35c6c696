"""The draft allotment priced by measured step costs (ruvllm.speculative.step_cost): drafts only where
their expected gain beats what their rows cost at the step's load."""

from __future__ import annotations

from ruvllm.speculative import StepCosts
from ruvllm.speculative.step_cost import EXPLORE_EVERY, FRESH_STEPS


def measured(cost, rows: range, position_cost: float = 0.2) -> StepCosts:
    costs = StepCosts(position_cost)
    for r in rows:
        costs.observe(r, 1000 * cost(r))  # a row count's first step may have compiled: not learnt
        costs.observe(r, cost(r))
    return costs


def test_before_any_step_is_measured_every_draft_stands() -> None:
    assert StepCosts(0.2).allot(3, [0.7, 0.7, 0.1], [4, 2, 1]) == [4, 2, 1]


def test_an_unmeasured_plain_step_is_run_plain_first() -> None:
    costs = measured(lambda r: 5.0 + r, range(8, 12))
    assert costs.allot(3, [0.9], [4]) == [0]
    costs.observe(3, 8.0)
    assert not costs.measured(3)
    costs.observe(3, 8.0)
    assert costs.allot(3, [0.9], [4]) == [4]


def test_memory_bound_single_stream_drafts_what_pays() -> None:
    # A row costs 0.15 of a one-row step: a draft kept 70% of the time pays for four tokens.
    costs = measured(lambda r: 5.0 + 0.75 * r, range(1, 6))
    assert costs.allot(1, [0.7], [4]) == [4]
    # Kept 10% of the time it does not.
    assert costs.allot(1, [0.1], [4]) == [0]


def test_compute_bound_steps_draft_nothing() -> None:
    # Every row costs what the others do: no draft (gain < 1 token a row) pays for its row.
    costs = measured(lambda r: 2.0 * r, range(1, 33))
    assert costs.allot(12, [0.8] * 12, [4] * 12) == [0] * 12


def test_rows_padded_to_a_compiled_shape_are_drafted_into() -> None:
    # A backend padding rows to powers of two: up to 32 rows cost what 20 do, past it twice that.
    costs = measured(lambda r: 40.0 if r <= 32 else 80.0, range(16, 65))
    keep = costs.allot(20, [0.7] * 20, [4] * 20)
    assert sum(keep) == 12
    assert max(keep) == 1  # the first token of each sequence is the most likely kept


def test_unmeasured_larger_steps_are_priced_by_the_prior_and_explored_now_and_then() -> None:
    # Only the plain step measured: a row beyond it costs position_cost of a one-row step's scale.
    costs = measured(lambda r: 30.0, [16])
    cut = [costs.allot(16, [0.5] * 16, [4] * 16) for _ in range(EXPLORE_EVERY)]
    assert all(sum(k) < 64 for k in cut[:-1])
    assert cut[-1] == [4] * 16  # one step in EXPLORE_EVERY measures what all of it costs


def test_delays_are_not_learnt_and_old_measurements_are_forgotten() -> None:
    costs = measured(lambda r: 10.0, [4])
    costs.observe(4, 1000.0)  # a compile, a paused process: the least recent time stands
    assert costs.estimate(4) == 10.0
    for _ in range(FRESH_STEPS + 1):
        costs.observe(8, 12.0)
    assert not costs.measured(4)
    assert costs.estimate(16) > costs.estimate(8) == 12.0
