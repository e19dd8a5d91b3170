"""The generated arithmetic task: determinism, disjoint splits, strict checking."""

from __future__ import annotations

import json

import pytest

from together_train_cookbook.tasks import (
    ArithmeticExample,
    ArithmeticTask,
    accuracy,
    check,
    parse_answer,
)


def test_deterministic_with_seed():
    task = ArithmeticTask(min_digits=2, max_digits=3)
    assert task.splits(50, 20, seed=1) == task.splits(50, 20, seed=1)
    assert task.splits(50, 20, seed=1) != task.splits(50, 20, seed=2)


def test_test_split_independent_of_train_size():
    task = ArithmeticTask()
    assert task.splits(10, 30, seed=0)[1] == task.splits(500, 30, seed=0)[1]


def test_splits_disjoint_and_distinct():
    task = ArithmeticTask(min_digits=2, max_digits=2)
    train, test = task.splits(3000, 500, seed=0)
    assert len(train) == 3000 and len(test) == 500
    assert len(set(train)) == 3000 and len(set(test)) == 500
    assert not set(train) & set(test)
    for ex in train + test:
        assert 10 <= ex.a <= 99 and 10 <= ex.b <= 99


def test_digit_range_and_capacity():
    task = ArithmeticTask(min_digits=1, max_digits=1)
    assert task.num_problems == 100
    train, test = task.splits(90, 10)
    assert {(e.a, e.b) for e in train + test} == {(a, b) for a in range(10) for b in range(10)}
    with pytest.raises(ValueError, match="only 100 exist"):
        task.splits(91, 10)
    with pytest.raises(ValueError):
        ArithmeticTask(min_digits=3, max_digits=2)
    with pytest.raises(ValueError):
        ArithmeticTask(op="/")
    t3 = ArithmeticTask(min_digits=2, max_digits=3)
    digits = {len(str(e.a)) for e in t3.splits(200, 0)[0]}
    assert digits == {2, 3}


def test_example_messages_and_format():
    ex = ArithmeticExample(47, 85)
    assert ex.answer == 132
    assert ex.prompt_messages() == [{"role": "user", "content": "What is 47 + 85?"}]
    assert ex.messages()[-1] == {"role": "assistant", "content": "132"}
    assert ex.messages("Be brief.")[0] == {"role": "system", "content": "Be brief."}
    assert json.loads(json.dumps(ex.to_json())) == {"messages": ex.messages()}
    assert check(ex.reference_response(), ex)
    assert ArithmeticExample(5, 9, "-").answer == -4
    assert ArithmeticExample(5, 9, "*").answer == 45


@pytest.mark.parametrize(
    "response,ok",
    [
        ("132", True),
        (" 132\n", True),
        ("132.", False),
        ("The answer is 132.", False),
        ("#### 132", False),
        ("1 32", False),
        ("0132", False),  # canonical form only
        ("132\n\n47 + 85 = 132", False),
        ("133", False),
        ("", False),
        ("+132", False),
        ("１３２", False),  # full-width digits are not ASCII decimal
    ],
)
def test_strict_check(response, ok):
    assert check(response, ArithmeticExample(47, 85)) is ok


def test_parse_and_accuracy():
    assert parse_answer("-7") == -7
    assert parse_answer("seven") is None
    exs = [ArithmeticExample(1, 2), ArithmeticExample(3, 4)]
    assert accuracy(["3", "8"], exs) == 0.5
    assert accuracy([], []) == 0.0
