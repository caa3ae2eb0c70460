"""``harness.compare_greedy``: the oracle the MLA and hybrid end-to-end tests use.

Pure logic on hand-written distributions, in the default suite: the rules
that make it fail (distributions apart, a divergence that is no near tie)
are pinned here, since in real vLLM the runs it compares are usually equal.
"""

from __future__ import annotations

import math

import pytest

from kvbridge.integrations.vllm.harness import Completion, HarnessError, compare_greedy

TOL = 0.05


def run(*steps: tuple[int, dict[int, float]]) -> Completion:
    return Completion(token_ids=tuple(t for t, _ in steps), kv_transfer_params=None,
                      latency_s=0.0, top_logprobs=tuple(d for _, d in steps))


def test_equal_runs_are_zero_apart() -> None:
    a = run((5, {5: -0.1, 6: -2.0}), (7, {7: -0.5, 8: -1.0}))
    result = compare_greedy(a, a, TOL)
    assert result.max_apart == 0.0 and result.diverged_at is None and result.within(TOL)


def test_small_rounding_is_within_and_large_differences_are_not() -> None:
    a = run((5, {5: -0.1, 6: -2.0}), (7, {7: -0.5, 8: -1.0}))
    b = run((5, {5: -0.11, 6: -2.0}), (7, {7: -0.5, 8: -1.3}))
    assert compare_greedy(a, b, TOL).max_apart == pytest.approx(0.3)
    assert not compare_greedy(a, b, TOL).within(TOL)
    c = run((5, {5: -0.12, 6: -2.0}), (7, {7: -0.5, 8: -1.0}))
    assert compare_greedy(a, c, TOL).within(TOL)


def test_a_divergence_at_a_near_tie_of_both_runs_is_allowed_and_ends_the_comparison() -> None:
    a = run((5, {5: -0.70, 6: -0.72}), (9, {9: -0.1}))
    b = run((6, {5: -0.71, 6: -0.70}), (1, {1: -0.1}))
    result = compare_greedy(a, b, TOL)
    assert result.diverged_at == 0 and result.within(TOL)


def test_a_divergence_that_is_no_tie_is_infinitely_apart() -> None:
    a = run((5, {5: -0.1, 6: -2.0}),)
    b = run((6, {5: -2.0, 6: -0.1}),)
    result = compare_greedy(a, b, TOL)
    assert result.diverged_at == 0 and result.max_apart == math.inf


def test_a_divergence_to_a_token_the_other_run_does_not_list_is_infinitely_apart() -> None:
    a = run((5, {5: -0.70, 6: -0.71}),)
    b = run((6, {6: -0.70, 7: -0.72}),)
    assert compare_greedy(a, b, TOL).max_apart == math.inf


def test_distributions_sharing_no_token_are_infinitely_apart() -> None:
    a = run((5, {5: -0.1}),)
    b = Completion(token_ids=(5,), kv_transfer_params=None, latency_s=0.0,
                   top_logprobs=({4: -0.1},))
    assert compare_greedy(a, b, TOL).max_apart == math.inf


def test_runs_without_logprobs_are_refused() -> None:
    bare = Completion(token_ids=(1, 2), kv_transfer_params=None, latency_s=0.0)
    with pytest.raises(HarnessError, match="logprobs"):
        compare_greedy(bare, bare, TOL)
