"""Image groups: the questions asked about one image, computed with the image once.

Every prompt starts with the template's header and then the image; the question follows. For the
questions on one image that prefix is the same token for token, and under causal attention its
hidden states do not depend on anything after it. So a group is laid out as the prefix once and
each question's own tokens after it (vlft.forward.packing.pack_groups): each question attends to the whole
prefix and causally to itself, never to another question, at the M-RoPE positions it has alone. Its
logits, loss and gradients are then the ones it gets alone: the backward pass sums the questions'
gradients into the one prefix, as separate copies would sum them into the weights (summation order
aside). The vision tower, or the vision cache, is read once per group too.

Not the same with LoRA dropout > 0: the prefix draws one dropout mask for all its questions instead
of one each (the same expectation, correlated draws). Across optimizer steps nothing is shared: the
adapter changes the language model's view of the image every step.

Which samples share a step changes with grouping (all of an image's questions go into one step,
vlft.training.steps), so it is a stage option (`image_groups`), off by default; with it off every
group is one sample and the layout is the plain packed row.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from vlft.data.prompts import Sample
from vlft.forward.linear_attention import LinearPieces
from vlft.jobs.distributed import share_by_tokens


@dataclass
class ImageGroup:
    """Samples laid out with their first `shared` tokens once: the header and the image they share."""

    samples: list[Sample]
    shared: int
    # Samples that stay together when a group is cut to fit a budget: 2 for preference pairs (a
    # pair's loss needs both its answers in one micro-batch), 1 otherwise.
    unit: int = 1

    @classmethod
    def of(cls, samples: list[Sample], unit: int = 1) -> "ImageGroup":
        return cls(samples, shared_prefix_length(samples), unit)

    @property
    def tokens(self) -> int:
        """The group's length laid out: the shared prefix once, then each sample's own tokens."""
        return self.shared + sum(len(s.input_ids) - self.shared for s in self.samples)


def shared_prefix_length(samples: list[Sample]) -> int:
    """The leading tokens every sample has in common, short of each one's last prompt token (it
    predicts the sample's first answer token, so each keeps its own); 0 for a sample alone."""
    if len(samples) < 2:
        return 0
    return common_prefix([s.input_ids for s in samples], min(s.prompt_length for s in samples) - 1)


def common_prefix(sequences: list[list[int]], limit: int) -> int:
    """How many leading tokens all `sequences` have in common, at most `limit`. A binary search on
    slices compared whole (in C), not a token at a time in Python: a GRPO step asks it of every
    question's prompts, some 1,300-3,000 tokens each (tens of ms a step on the GPU machine's host)."""
    first, length = sequences[0], max(0, min(limit, *map(len, sequences)))
    for other in sequences[1:]:
        if first[:length] == other[:length]:
            continue
        shared, differs = 0, length  # first[:shared] == other[:shared], first[:differs] != other[:differs]
        while differs - shared > 1:
            middle = (shared + differs) // 2
            shared, differs = (middle, differs) if first[:middle] == other[:middle] else (shared, middle)
        length = shared
    return length


@dataclass
class RowLayout:
    """Where the samples of image groups lie in one row, and which row positions each attends to.

    A group's first sample lies whole (the prefix with it), each other sample's own tokens after
    it; each sample's keys are the group's prefix, then its own tokens."""

    segments: list[tuple[int, int]]  # each sample's own stretch of the row, its queries
    key_spans: list[list[tuple[int, int]]]  # each sample's keys: the row's stretches, in order
    # Each group with a shared prefix: where its prefix starts and ends, and where the group ends.
    prefixes: list[tuple[int, int, int]] = field(default_factory=list)

    @classmethod
    def of(cls, groups: list[tuple[int, list[int]]]) -> "RowLayout":
        """From each group's shared prefix length and its samples' whole lengths."""
        segments, key_spans, prefixes, start = [], [], [], 0
        for shared, lengths in groups:
            prefix = (start, start + shared)
            for n, length in enumerate(lengths):
                own = length - (shared if n else 0)
                segments.append((start, start + own))
                key_spans.append([(start, start + own)] if n == 0 else [prefix, (start, start + own)])
                start += own
            if shared:
                prefixes.append((*prefix, start))
        return cls(segments, key_spans, prefixes)

    def attention_inputs(self, prefix_once: bool = True, linear: LinearPieces | None = None) -> dict:
        """What vlft.forward.packing.packed_attention takes for this row (on the host): the segments'
        bounds; with shared prefixes, attention in two parts (vlft.forward.prefix_attention): each
        group's prefix a segment of its own, read once by the queries of all its samples' own
        tokens, which attend causally to their own segments besides. Without `prefix_once`, each
        sample's keys gathered whole (its group's prefix, then its own tokens): where no backward
        pass follows, the copies cost less than the two parts' merge (an 8B evaluation's prefills:
        benchmarks/README.md). With shared prefixes, or `linear` given, where a hybrid model's
        linear-attention layers start each piece (`linear_pieces`)."""
        linear = linear or (self.linear_pieces() if self.prefixes else None)
        linear_inputs = linear.as_inputs() if linear else {}
        if not self.prefixes:
            return _segments_inputs([end - start for start, end in self.segments]) | linear_inputs
        if not prefix_once:
            return self._gathered_inputs() | linear_inputs
        bounds = self._piece_starts()
        inputs = _segments_inputs([end - start for start, end in zip(bounds, bounds[1:] + [self.segments[-1][1]])])
        queries = [group_end - end for _, end, group_end in self.prefixes]
        keys = [end - start for start, end, _ in self.prefixes]
        inputs |= {
            "packed_prefix_index": torch.cat([torch.arange(start, end) for start, end, _ in self.prefixes]),
            "packed_prefix_query_index": torch.cat(
                [torch.arange(end, group_end) for _, end, group_end in self.prefixes]
            ),
            "packed_prefix_cu_seqlens_q": torch.tensor([0] + queries).cumsum(0, dtype=torch.int32),
            "packed_prefix_cu_seqlens_k": torch.tensor([0] + keys).cumsum(0, dtype=torch.int32),
            "packed_prefix_max_seqlen_q": max(queries),
            "packed_prefix_max_seqlen_k": max(keys),
        }
        return inputs | linear_inputs

    def _piece_starts(self) -> list[int]:
        """Where each sample's own stretch and each group's prefix start, in order."""
        return sorted({start for start, _ in self.segments} | {end for _, end, _ in self.prefixes})

    def linear_pieces(self, cuts: tuple[int, ...] = ()) -> LinearPieces:
        """Where a hybrid model's linear-attention layers start each piece of the row: each group's
        prefix from zero, each of its samples' own tokens from the prefix's end (its recurrent
        state and convolution window), a sample alone from zero; a piece cut at one of `cuts` goes
        on from the piece before the cut."""
        starts, end = self._piece_starts(), self.segments[-1][1]
        bounds = sorted(set(starts) | {cut for cut in cuts if 0 < cut < end}) + [end]
        piece_at = {start: n for n, start in enumerate(bounds[:-1])}
        parents = [n - 1 for n in range(len(bounds) - 1)]  # a cut: the sample goes on
        for start in starts:
            parents[piece_at[start]] = -1
        for prefix_start, prefix_end, group_end in self.prefixes:
            for start in starts:
                if prefix_end <= start < group_end:
                    parents[piece_at[start]] = piece_at[prefix_start]
        return LinearPieces(bounds, parents)

    def _gathered_inputs(self) -> dict:
        inputs = _segments_inputs([end - start for start, end in self.segments])
        key_lengths = [sum(end - start for start, end in spans) for spans in self.key_spans]
        spans = [span for sample in self.key_spans for span in sample]
        inputs["packed_key_index"] = torch.cat([torch.arange(start, end) for start, end in spans])
        inputs["packed_cu_seqlens_k"] = torch.tensor([0] + key_lengths).cumsum(0, dtype=torch.int32)
        inputs["packed_max_seqlen_k"] = max(key_lengths)
        return inputs


def _segments_inputs(lengths: list[int]) -> dict:
    """A packed row's segments, each attending causally to itself: their bounds and the longest."""
    return {
        "packed_cu_seqlens": torch.tensor([0] + lengths).cumsum(0, dtype=torch.int32),
        "packed_max_seqlen": max(lengths),
    }


def within_budget(group: ImageGroup, max_tokens: int | None, max_samples: int | None) -> list[ImageGroup]:
    """A group cut into groups of at most `max_tokens` tokens and `max_samples` samples, each
    with the prefix of its own, between its units only (a unit that exceeds the budget alone gets
    a group of its own)."""
    parts, current = [], []
    units = [group.samples[i : i + group.unit] for i in range(0, len(group.samples), group.unit)]
    for unit in units:
        candidate = ImageGroup(current + unit, group.shared)
        too_long = max_tokens is not None and candidate.tokens > max_tokens
        too_many = max_samples is not None and len(candidate.samples) > max(max_samples, group.unit)
        if current and (too_long or too_many):
            parts.append(current)
            current = []
        current += unit
    parts.append(current)
    return [ImageGroup.of(part, group.unit) for part in parts]


def group_rows(groups: list[ImageGroup], max_tokens: int | None, max_samples: int | None) -> list[list[ImageGroup]]:
    """A step's groups in rows of at most `max_tokens` tokens (and `max_samples` samples): groups
    cut to fit, then first fit by decreasing length (a part longer than the budget gets a row of its
    own). Samples alone (vlft.forward.packing.packed_batches) are groups of one."""
    parts = [part for group in groups for part in within_budget(group, max_tokens, max_samples)]
    rows: list[list[ImageGroup]] = []
    room: list[tuple[float, float]] = []
    for part in sorted(parts, key=lambda g: g.tokens, reverse=True):
        size = (part.tokens, len(part.samples))
        row = next((i for i, left in enumerate(room) if left[0] >= size[0] and left[1] >= size[1]), None)
        if row is None:
            rows.append([])
            room.append((max_tokens or float("inf"), max_samples or float("inf")))
            row = len(rows) - 1
        rows[row].append(part)
        room[row] = (room[row][0] - size[0], room[row][1] - size[1])
    return rows


def share_groups(groups: list[ImageGroup], parts: int) -> list[list[ImageGroup]]:
    """A step's groups shared out among `parts` data-parallel processes, balanced by tokens.

    Whole groups where that balances the work. A step of Kvasir's 16 samples holds two images of 9
    questions: at 4 processes whole groups leave two idle. So groups longer than a fair share are
    also tried cut into 2, 3, ... near-equal parts (between their units, each part with the prefix
    of its own, as a token budget cuts them), and the sharing whose busiest process has the fewest
    tokens (they set the step's time) is kept; a tie keeps fewer cuts, as a cut repeats the prefix.
    Every sample is computed once with its own prefix either way: the same losses and gradients
    as one process computes."""
    fair = sum(g.tokens for g in groups) / parts
    best, best_busiest = None, float("inf")
    for cuts in range(1, parts + 1):
        pieces = [piece for g in groups for piece in (cut_evenly(g, cuts) if g.tokens > fair else [g])]
        shares = share_by_tokens(pieces, parts, length=lambda g: g.tokens)
        busiest = max(sum(g.tokens for g in share) for share in shares)
        if busiest < best_busiest:
            best, best_busiest = shares, busiest
    return best


def cut_evenly(group: ImageGroup, parts: int) -> list[ImageGroup]:
    """A group cut between its units into at most `parts` groups of near-equal own tokens, in order."""
    units = [group.samples[i : i + group.unit] for i in range(0, len(group.samples), group.unit)]
    own = [sum(len(s.input_ids) - group.shared for s in unit) for unit in units]
    pieces: list[list[Sample]] = [[]]
    done = 0
    for unit, tokens in zip(units, own):
        if pieces[-1] and done >= sum(own) * len(pieces) / parts:
            pieces.append([])
        pieces[-1] += unit
        done += tokens
    return [ImageGroup.of(piece, group.unit) for piece in pieces]


def pair_group(data, keys: list[str]) -> ImageGroup:
    """The preference pairs of `keys` (the records of one image group, or one record) as one image
    group: chosen, rejected, chosen, rejected, ..."""
    return ImageGroup.of([s for key in keys for s in (data.samples[key], data.rejected[key])], unit=2)
