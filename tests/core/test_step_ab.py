# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""bench.step_ab's pairing without vLLM: a step's work counts the tokens that close a
compressor window; a pair is two consecutive steps of the same work on opposite sides,
each step in one pair at most, the ratio is vLLM / plugin whichever side ran first,
steps of other sizes or work and parts a step lacks are skipped (the real engine run is
tests/vllm/test_step_ab_engine.py)."""

import pytest

from vllm_dsv4_backend.bench import step_ab as S


def _s(side: str, tokens: int, step: float, **parts: float) -> dict:
    return {"side": side, "tokens": tokens, "step": step, **parts}


def _w(side: str, work: tuple[int, ...], step: float) -> dict:
    return {"side": side, "tokens": work[0], "work": work, "step": step}


def test_step_work_counts_tokens_closing_each_window() -> None:
    # Position p closes a window of r when (p + 1) % r == 0.
    assert S.step_work([(2, 1)], [4, 128]) == (1, 0, 0)       # p = 2
    assert S.step_work([(3, 1)], [4, 128]) == (1, 1, 0)       # p = 3
    assert S.step_work([(127, 1)], [4, 128]) == (1, 1, 1)     # p = 127
    assert S.step_work([(0, 1024)], [4, 128]) == (1024, 256, 8)
    assert S.step_work([(1, 6)], [4]) == (6, 1)               # p = 1..6: only 3
    assert S.step_work([(3, 1), (4, 1), (7, 1)], [4]) == (3, 2)
    assert S.step_work([], [4, 128]) == (0, 0, 0)


def test_pairs_only_steps_of_the_same_work() -> None:
    # Batch-1 decode at positions 16.., C4: every 4th step closes a window. Alternating
    # within each kind of work pairs open steps with open steps and closing with closing.
    steps = [_w("plugin", (1, 0), 1.0), _w("vllm", (1, 0), 1.1), _w("plugin", (1, 0), 1.0),
             _w("plugin", (1, 1), 2.0),
             _w("vllm", (1, 0), 1.2), _w("plugin", (1, 0), 1.0), _w("vllm", (1, 0), 1.3),
             _w("vllm", (1, 1), 3.0)]
    assert S.pair_ratios(steps, "step", 1) == [
        pytest.approx(1.1), pytest.approx(1.2), 1.5, pytest.approx(1.3)]
    row = S.summarize(steps, 1)
    assert row["closing_steps"] == {"plugin": 1, "vllm": 1}
    assert row["step"]["pairs"] == 4


def test_pairs_adjacent_opposite_sides_in_either_order() -> None:
    steps = [_s("plugin", 1, 2.0), _s("vllm", 1, 3.0),   # 1.5
             _s("vllm", 1, 4.0), _s("plugin", 1, 2.0),   # 2.0 (vLLM first)
             _s("plugin", 1, 1.0)]                       # unpaired tail
    assert S.pair_ratios(steps, "step", 1) == [1.5, 2.0]


def test_same_side_neighbours_and_other_sizes_do_not_pair() -> None:
    steps = [_s("plugin", 1, 2.0), _s("plugin", 1, 5.0), _s("vllm", 8, 9.0),
             _s("vllm", 1, 10.0), _s("plugin", 16, 1.0)]
    # plugin(2.0) has a plugin neighbour; plugin(5.0) pairs with the next size-1 step.
    assert S.pair_ratios(steps, "step", 1) == [2.0]
    assert S.pair_ratios(steps, "step", 8) == []


def test_parts_missing_from_a_step_are_left_out() -> None:
    steps = [_s("plugin", 4, 2.0, build=0.5), _s("vllm", 4, 2.2),
             _s("vllm", 4, 2.0, build=1.0), _s("plugin", 4, 1.0, build=0.25)]
    assert S.pair_ratios(steps, "build", 4) == [4.0]
    assert S.pair_ratios(steps, "step", 4) == [pytest.approx(1.1), 2.0]


def test_summary_verdicts_follow_the_interval() -> None:
    steps = []
    for i in range(40):
        steps += [_s("plugin", 1, 1.0, build=1.0, forward=1.0),
                  _s("vllm", 1, 1.2 + 0.001 * i, build=1.0, forward=0.9 - 0.001 * i)]
    row = S.summarize(steps, 1)
    assert row["step"]["pairs"] == 40 and row["step"]["verdict"] == "plugin"
    assert row["build"]["verdict"] == "tie" and row["build"]["ratio_median"] == 1.0
    assert row["forward"]["verdict"] == "vllm"
    assert row["step"]["plugin_ms_median"] == pytest.approx(1000.0)
    assert S.summarize(steps, 2)["step"] == {
        "pairs": 0, "ratio_median": None, "ratio_ci95_lo": None, "ratio_ci95_hi": None,
        "verdict": "n/a", "plugin_ms_median": None, "vllm_ms_median": None}
