"""Answers: final answers compared normalized, the last marker taken."""

import pytest
from vlft.data.answers import final_answer, is_correct, normalize


@pytest.mark.parametrize(
    "prediction,reference,correct",
    [
        ("It is round and red. Final answer: Red.", "Final answer: red", True),
        ("final answer: three", "I count one, two, three. Final answer: 3", True),
        ("Final answer: 2", "Final answer: 3", False),
        ("yes", "The shape is blue. Final answer: yes", True),
    ],
)
def test_final_answers_are_compared_normalized(prediction, reference, correct):
    assert is_correct(prediction, reference) is correct


def test_final_answer_takes_the_last_marker():
    assert final_answer("Final answer: no... wait. Final answer: yes") == "yes"
    assert normalize("The  Left!") == "left"
