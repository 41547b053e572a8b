"""BLEU, ROUGE-L and METEOR of free-text answers, as the public challenges on Kvasir-VQA and
Kvasir-VQA-x1 (MediaEval Medico 2025, ImageCLEFmed MEDVQA-GI 2025) compute them: their evaluation
scripts call Hugging Face `evaluate`'s "bleu", "rouge" and "meteor" on the predictions and the
references. Those metrics are scripts `evaluate.load` fetches from the Hub at run time, which a job
here never does; this module computes the same numbers from the libraries they wrap:

- BLEU: corpus BLEU-4 without smoothing over sacrebleu's 13a tokens (`evaluate`'s bleu is
  tensorflow/nmt's compute_bleu over the same tokenizer; written out below, 20 lines, because
  sacrebleu's own BLEU differs where a corpus has no 4-gram at all);
- ROUGE-L: rouge_score's RougeScorer(["rougeL"]) F-measure, averaged over the answers (`evaluate`
  reports the median of a bootstrap of that average, a random estimate of the same number);
- METEOR: nltk's single_meteor_score (alpha 0.9, beta 3, gamma 0.5), averaged over the answers,
  **without its WordNet synonym stage**: WordNet is data nltk downloads, not a package any
  registry installs, so two words match here when they are equal or share a Porter stem. Where
  an answer pair has no synonyms to match (most short clinical answers) the number is nltk's; where
  it has, it is lower. Words are split by nltk's Treebank tokenizer (`word_tokenize` without its
  sentence splitter, whose model is downloaded data too).
"""

from __future__ import annotations

import math
from collections import Counter


def text_metrics(predictions: list[str], references: list[str]) -> dict[str, float]:
    """BLEU, ROUGE-L and METEOR of the predictions against the references, one reference each."""
    if not predictions:
        return {}
    return {
        "bleu": bleu(predictions, references),
        "rouge_l": rouge_l(predictions, references),
        "meteor": meteor(predictions, references),
    }


def bleu(predictions: list[str], references: list[str], max_order: int = 4) -> float:
    """Corpus BLEU as tensorflow/nmt's compute_bleu (`evaluate`'s bleu), unsmoothed, on 13a tokens."""
    from sacrebleu.tokenizers.tokenizer_13a import Tokenizer13a

    tokenize = Tokenizer13a()
    matches, possible = [0] * max_order, [0] * max_order
    translation_length = reference_length = 0
    for prediction, reference in zip(predictions, references):
        said, meant = tokenize(prediction).split(), tokenize(reference).split()
        translation_length, reference_length = translation_length + len(said), reference_length + len(meant)
        overlap = _ngrams(said, max_order) & _ngrams(meant, max_order)
        for ngram, count in overlap.items():
            matches[len(ngram) - 1] += count
        for order in range(1, max_order + 1):
            possible[order - 1] += max(0, len(said) - order + 1)
    precisions = [m / p if p else 0.0 for m, p in zip(matches, possible)]
    if min(precisions) == 0 or translation_length == 0:
        return 0.0
    geometric_mean = math.exp(sum(math.log(p) for p in precisions) / max_order)
    ratio = translation_length / reference_length
    return geometric_mean * (1.0 if ratio > 1.0 else math.exp(1 - 1 / ratio))


def _ngrams(tokens: list[str], max_order: int) -> Counter:
    return Counter(tuple(tokens[i : i + n]) for n in range(1, max_order + 1) for i in range(len(tokens) - n + 1))


def rouge_l(predictions: list[str], references: list[str]) -> float:
    """The mean ROUGE-L F-measure (rouge_score, its own tokenizer, no stemming: `evaluate`'s defaults)."""
    from rouge_score.rouge_scorer import RougeScorer

    scorer = RougeScorer(["rougeL"])
    scores = [scorer.score(ref, pred)["rougeL"].fmeasure for pred, ref in zip(predictions, references)]
    return sum(scores) / len(scores)


class _NoSynonyms:
    """What nltk's METEOR asks WordNet, answered with nothing (see the module's note)."""

    def synsets(self, *args, **kwargs):
        return []


def meteor(predictions: list[str], references: list[str]) -> float:
    """The mean of nltk's single_meteor_score, exact and stem matches (see the module's note)."""
    from nltk.tokenize import NLTKWordTokenizer
    from nltk.translate.meteor_score import single_meteor_score

    words = NLTKWordTokenizer().tokenize
    scores = [
        single_meteor_score(words(ref), words(pred), alpha=0.9, beta=3, gamma=0.5, wordnet=_NoSynonyms())
        for pred, ref in zip(predictions, references)
    ]
    return sum(scores) / len(scores)
