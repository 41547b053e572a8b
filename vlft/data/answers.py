"""Answers: the final answer parsed out of chain-of-thought text, normalized for comparison."""

from __future__ import annotations

import re
from enum import Enum

FINAL_ANSWER = re.compile(r"final answer\s*[:：]", re.IGNORECASE)
NUMBER_WORDS = {w: str(i) for i, w in enumerate("zero one two three four five six seven eight nine ten".split())}
ARTICLES = {"a", "an", "the"}


END_OF_THINKING = "</think>"


class AnswerFormat(str, Enum):
    """How a stage's answers are written and judged (a stage's `answer_format`; equal to its name)."""

    FINAL = "final"  # the final answer alone
    COT = "cot"  # reasoning, then the final answer
    CLICK = "click"  # a point on the image, judged by whether it lands in the target's box (vlft.data.clicks)


def final_answer(text: str) -> str:
    """The text after the last 'Final answer:' marker, or the whole text when there is none; of a
    Thinking checkpoint's answer, only what follows its think block counts."""
    return FINAL_ANSWER.split(text.split(END_OF_THINKING)[-1])[-1].strip()


def normalize(answer: str) -> str:
    """Lower case, no punctuation or articles, number words as digits: 'Three.' == '3'."""
    words = re.sub(r"[^\w\s]", " ", answer.lower()).split()
    return " ".join(NUMBER_WORDS.get(w, w) for w in words if w not in ARTICLES)


def target_text(answer: str, answer_format: str) -> str:
    """What a stage trains the model to say: the final answer alone, or reasoning then final answer."""
    return final_answer(answer) if answer_format == AnswerFormat.FINAL else answer.strip()


def is_correct(prediction: str, reference: str) -> bool:
    return normalize(final_answer(prediction)) == normalize(final_answer(reference))
