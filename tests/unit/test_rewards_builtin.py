"""The built-in rewards users bring from verl: DAPO's "Answer:" convention (against verl's own
math_dapo from its wheel), DAPO's overlong penalty (against the paper's formula), and rewards
routed by a record field (verl's data_source)."""

import json
import random

import pytest

from bapo_megatron.rewards.functions import load_reward, reward_spec, score
from tests.helpers import verl_module

CASES = [
    ("So the total is 34.\nAnswer: 34", "34"),
    ("Answer: $\\frac{1}{2}$", "\\frac{1}{2}"),
    ("Answer: \\frac12", "\\frac{1}{2}"),
    ("Answer: \\boxed{5}", "5"),
    ("The answer is 34", "34"),
    ("Answer: 1,000", "1000"),
    ("Answer: 12 degrees", "12"),
    ("answer: x = 7", "7"),
    ("Answer: 3\nAnswer: 4", "4"),
    ("Answer: 3\nAnswer: 4", "3"),
    ("Answer: \\text{(B)}", "(B)"),
    ("Answer: 90^\\circ", "90"),
    ("Answer: \\sqrt2", "\\sqrt{2}"),
    ("Answer: 5" + " padding" * 60, "5"),
    ("Answer: 5\n" + "more reasoning " * 30, "5"),
    ("Answer:", "0"),
    ("Answer: $2$ and $3$", "2"),
    ("ANSWER : -3.5", "-3.5"),
]


def test_dapo_scores_as_verls_own_math_dapo():
    verl = verl_module("verl/utils/reward_score/math_dapo.py")
    dapo = load_reward("dapo")
    rng = random.Random(0)
    tokens = ["Answer:", "answer :", "$", "\\frac", "12", "3", "{", "}", "=", " ", "\n", "degrees", "\\boxed{", "x"]
    noise = ["".join(rng.choice(tokens) for _ in range(rng.randint(1, 40))) for _ in range(300)]
    cases = CASES + [(text, rng.choice(["12", "3", "\\frac{1}{2}", "x=3"])) for text in noise]
    for text, truth in cases:
        expected = verl.compute_score(text, truth)["score"]
        assert dapo(text, [], {"answer": truth}) == expected, (text, truth)
    assert {dapo(t, [], {"answer": a}) for t, a in CASES} == {1.0, -1.0}


def test_dapos_overlong_penalty_follows_the_papers_formula():
    """DAPO (Yu et al. 2025, eq. 13): 0 up to L_max - L_cache tokens, then falling linearly to -1
    (times the factor) at L_max; added to the score."""
    spec = reward_spec("dapo", overlong_buffer=4, overlong_factor=0.5, max_new_tokens=10)
    reward = load_reward(spec)
    right = {"answer": "7"}
    for length, penalty in [(3, 0.0), (6, 0.0), (7, -0.125), (8, -0.25), (10, -0.5)]:
        assert reward("Answer: 7", [0] * length, right) == pytest.approx(1.0 + penalty), length
    assert reward("Answer: 8", [0] * 10, right) == pytest.approx(-1.5)
    assert reward_spec("dapo") == "dapo"  # nothing composite: the plain name travels


def test_rewards_routed_by_a_record_field(tmp_path):
    (tmp_path / "mine.py").write_text("def length(text, ids, record):\n    return float(len(ids))\n")
    table = {"math_dapo": "dapo", "repeat": "exact", "mine": f"{tmp_path / 'mine.py'}:length"}
    spec = reward_spec("math", by="data_source", table=table)
    assert json.loads(spec)["table"] == table
    assert score(spec, "Answer: 4", [1], {"data_source": "math_dapo", "answer": "4"}) == (1.0, None)
    assert score(spec, "373737", [1], {"data_source": "repeat", "answer": "373737"}) == (1.0, None)
    assert score(spec, "x", [1, 2, 3], {"data_source": "mine"}) == (3.0, None)
    value, error = score(spec, "x", [1], {"data_source": "aime"})
    assert value == 0.0 and "data_source='aime' has no reward in reward.table" in error
    nested = reward_spec("math", by="extra.kind", table={"a": "exact"})
    assert score(nested, "1", [], {"extra": {"kind": "a"}, "answer": "1"}) == (1.0, None)
    with pytest.raises(ValueError, match="unknown reward 'nope'"):
        load_reward(reward_spec("math", by="data_source", table={"x": "nope"}))


GSM8K_CASES = [
    ("12+30=42\n#### 42", "42"),
    ("#### 42", "41"),
    ("The answer is 42", "42"),
    ("####42", "42"),
    ("#### 1,000", "1000"),
    ("#### -3", "-3"),
    ("#### 3.50", "3.5"),
    ("#### 7\n#### 8", "8"),
    ("#### 7\n#### 8", "7"),
    ("#### 7" + " and so on" * 40, "7"),
    ("#### 7" + "." * 300, "7"),
    ("so 5 apples, then 6.", "6."),
    ("so 5 apples, then 6.", "6"),
    ("...", "."),
    (". then .", "."),
    ("a.", "."),
    ("no number", "0"),
    ("", "0"),
    ("#### $5", "5"),
]


def test_gsm8k_scores_as_verls_own_gsm8k():
    """Strict ("#### " then a number, the last one in the response's last 300 characters) and
    flexible (the last number), with verl's format and correct scores, against verl's own
    compute_score from its wheel on hand-picked cases and random noise."""
    from bapo_megatron.rewards.functions import gsm8k_score

    verl = verl_module("verl/utils/reward_score/gsm8k.py")
    rng = random.Random(0)
    tokens = ["####", "#### ", "#", " ", "-", ".", ",", "$", "1", "2", "7", "42", "\n", "x"]
    noise = ["".join(rng.choice(tokens) for _ in range(rng.randint(0, 60))) for _ in range(500)]
    cases = GSM8K_CASES + [(text, rng.choice(["1", "2", "7", "42", "-1", "1.2", "."])) for text in noise]
    strict, flexible = load_reward("gsm8k"), load_reward("gsm8k_flexible")
    for text, truth in cases:
        assert strict(text, [], {"answer": truth}) == verl.compute_score(text, truth), (text, truth)
        assert flexible(text, [], {"answer": truth}) == verl.compute_score(text, truth, "flexible"), (text, truth)
        for method in ("strict", "flexible"):
            expected = verl.compute_score(text, truth, method, format_score=0.1, score=2.0)
            assert gsm8k_score(text, truth, method == "flexible", 0.1, 2.0) == expected, (text, truth, method)
    assert {strict(t, [], {"answer": a}) for t, a in GSM8K_CASES} == {0.0, 1.0}
    assert score("gsm8k", "#### 72", [], {"answer": 72}) == (1.0, None)  # a number from parquet: compared as text
