"""BLEU, ROUGE-L and METEOR of free-text answers, against the numbers of the implementations the
field's public challenges run (Hugging Face evaluate's bleu, rouge and meteor, which wrap
tensorflow/nmt's BLEU, rouge_score and nltk), on a few pairs each."""

from __future__ import annotations

import math

import pytest
import sacrebleu

from vlft.generation.evaluate import scores
from vlft.generation.text_metrics import bleu, meteor, rouge_l

ANSWERS = ["the polyp is in the upper left of the image", "there are two polyps and one instrument visible"]
REFERENCES = ["the polyp is located in the upper left of the image", "two polyps and an instrument are visible"]


def test_bleu_is_corpus_bleu_4_unsmoothed_on_13a_tokens():
    # sacrebleu's corpus BLEU (13a, no smoothing) computes the same where every order has matches.
    expected = sacrebleu.corpus_bleu(ANSWERS, [REFERENCES], smooth_method="none").score / 100
    assert bleu(ANSWERS, REFERENCES) == pytest.approx(expected, rel=1e-12)
    # evaluate's documented example: identical answers score 1.
    assert (
        bleu(["hello there general kenobi", "foo bar foobar"], ["hello there general kenobi", "foo bar foobar"]) == 1.0
    )
    # nmt's BLEU: a corpus without one 4-gram (one-word answers) has a precision of 0, so BLEU 0.
    assert bleu(["yes", "no"], ["yes", "no"]) == 0.0
    # By hand: 4 of 5 unigrams, 3 of 4 bigrams, 2 of 3 trigrams, 1 of 2 4-grams; 5 tokens each, BP 1.
    said, meant = "a b c d x", "a b c d e"
    p = [4 / 5, 3 / 4, 2 / 3, 1 / 2]
    assert bleu([said], [meant]) == pytest.approx(math.exp(sum(map(math.log, p)) / 4), rel=1e-12)


def test_rouge_l_is_the_mean_f_measure_of_the_longest_common_subsequence():
    # "a polyp in the image": 5 words in common, of 6 said and 7 meant (rouge_score drops punctuation, lowercases).
    precision, recall = 5 / 6, 5 / 7
    f = 2 * precision * recall / (precision + recall)
    assert rouge_l(["A polyp is in the image."], ["There is a polyp in the image."]) == pytest.approx(f, rel=1e-12)
    assert rouge_l(["hello there", "general kenobi"], ["hello there", "general kenobi"]) == 1.0  # evaluate's example
    assert rouge_l(["yes", "no"], ["yes", "yes"]) == 0.5


def test_meteor_is_nltks_without_the_synonym_stage():
    # nltk's documented single_meteor_score example (0.6944: its matches are exact words).
    hypothesis = "It is a guide to action which ensures that the military always obeys the commands of the party"
    reference = "It is a guide to action that ensures that the military will forever heed Party commands"
    assert round(meteor([hypothesis], [reference]), 4) == 0.6944
    # Stems match ("polyps" and "polyp"); one chunk of 3 matches: penalty 0.5 * (1/3)^3.
    fmean = 1.0  # 3 of 3 words each way
    assert meteor(["two polyps seen"], ["two polyp seen"]) == pytest.approx(fmean * (1 - 0.5 * (1 / 3) ** 3))


def test_an_evaluation_of_free_text_reports_them_beside_accuracy_and_a_click_one_does_not():
    predictions = [
        {"category": None, "correct": a == r, "predicted_answer": a, "reference": r}
        for a, r in zip(ANSWERS, REFERENCES)
    ]
    metrics = scores(predictions, 1.0, 1, "final")
    assert metrics["bleu"] == pytest.approx(bleu(ANSWERS, REFERENCES)) and metrics["accuracy"] == 0.0
    assert metrics["rouge_l"] == rouge_l(ANSWERS, REFERENCES) and metrics["meteor"] == meteor(ANSWERS, REFERENCES)
    clicks = [dict(p, distance=0.1, parsed=True) for p in predictions]
    assert "bleu" not in scores(clicks, 1.0, 1, "click")


def test_a_click_evaluation_reports_accuracy_by_element_type_and_by_platform():
    """ScreenSpot is reported per element type (data_type / ui_type: the records' category) and per
    platform (v1/v2's data_source, Pro's platform), as its leaderboards are."""
    from vlft.generation.evaluate import prediction_of

    from vlft.data.clicks import Frame as ClickFrame
    from vlft.data.stage_data import StageData

    frame = ClickFrame(100, 100, 100, 100, "absolute")  # answered in the image's own pixels
    rows = [
        ("icon", "ios", "(5, 5)"),
        ("text", "web", "(50, 50)"),
        ("text", "web", "(5, 5)"),
        ("icon", "web", "(5, 5)"),
    ]
    records = [
        {
            "id": str(i),
            "key": str(i),
            "question": "Click.",
            "answer": "(5, 5)",
            "box": [0, 0, 10, 10],
            "category": c,
            "data_source": p,
            "source_split": "test.jsonl",
            "width": 100,
            "height": 100,
        }
        for i, (c, p, _) in enumerate(rows)
    ]
    data = StageData.__new__(StageData)
    data.frames = {r["key"]: frame for r in records}
    predictions = [prediction_of(r, said, data) for r, (_, _, said) in zip(records, rows)]
    metrics = scores(predictions, 1.0, 1, "click")
    assert metrics["accuracy_by_category"] == {"icon": 1.0, "text": 0.5}
    assert metrics["accuracy_by_platform"] == {"ios": 1.0, "web": 2 / 3}
