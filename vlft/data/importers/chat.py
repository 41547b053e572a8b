"""Chat-format JSON or JSONL as LLaMA-Factory, ms-swift and LLaVA publish it, brought to records.

Read: sharegpt `conversations` (from / value) with `images` or LLaVA's `image`; `messages`
(role / content) with `images`; content as text with `<image>` markers or as typed parts
(`{"type": "image_url" | "image" | "text", "value" | "text" | "image_url": ...}`, LLaMA-Factory's
v1 format and OpenAI's); a system turn (a first `system` message, or sharegpt's `system` field);
ms-swift's sharegpt (`conversation`: [{human, assistant}]) and query / response / history rows;
ms-swift's grounding rows (`objects: {ref, bbox}` with `<ref-object>` and `<bbox>` in the text).
Preference pairs: LLaMA-Factory's (`chosen` and `rejected` turns after a conversation that ends with
the question, `ranking: true` in its dataset_info) and ms-swift's (`rejected_response` beside a
conversation whose last answer is the chosen one).

A conversation of n rounds on one image becomes n records, each with the rounds before it as its
`history` (the loss is on its own answer); a preference pair becomes one record, its last round,
with `rejected`. One image per conversation, shown in its first user turn; the same file shown
again in a later turn is that image (counted in the summary). Rows without an image are skipped
and counted; everything else that does not fit (two images, a URL, a tool turn, a pair whose
rejected answer is about other images, a KTO row) is refused with the file, the row and the
reason, never cut. Rows of video or audio are skipped and counted as such (with an image too: refused,
a record would keep its `<video>` and learn about what it cannot see); answers their publisher marks
as not to be learned (ms-swift's `loss: false`, LLaMA-Factory v1's `loss_weight: 0`) make no
record, and stay in later rounds' history. Qwen-VL's inline images (`<img>path</img>`) are read as
the row's image; `file://` paths are paths; an image as a `data:` URL is refused."""

from __future__ import annotations

import re
from pathlib import Path

from vlft.errors import InputError
from vlft.data.importers.common import (
    IMAGE_MARKER,
    Refusals,
    UniqueIds,
    holds_bytes,
    json_rows,
    shown,
    structure,
    tagged_answer,
    write_splits,
)
from vlft.data.importers.targets import conversation_target

ROLES = {"human": "user", "gpt": "assistant", "user": "user", "assistant": "assistant", "system": "system"}
# Pairs as whole conversations, which no peer's VLM preference format writes: not read.
WHOLE_CONVERSATION_PAIRS = ("rejected_messages", "chosen_messages")
IMAGE_PART_TYPES = ("image", "image_url")
# What a box written in an answer is measured in: a family's coordinates (vlft.data.clicks), or pixels.
# Media besides images, which no record holds: the fields, typed parts and text markers that carry them.
MEDIA = {
    "video": (("videos", "video"), ("video", "video_url"), "<video>"),
    "audio": (("audios", "audio"), ("audio", "audio_url", "input_audio"), "<audio>"),
}
# Qwen-VL's inline images: "Picture 1: <img>path or URL</img>" in the text.
INLINE_IMAGE = re.compile(r"(?:Picture \d+: )?<img>(.*?)</img>\n?", re.DOTALL)


def import_chat(
    files: list[str | Path],
    image_root: str | Path,
    out_dir: str | Path,
    split: str = "train",
    skip_bad_rows=False,
    answer_coordinates: str | None = None,
) -> dict:
    """Records from chat files; image paths stay relative to `image_root` (images are not copied).
    Rows refused are listed all at once (vlft.data.importers.common.Refusals). A box or point
    written in an answer is read in `answer_coordinates` (importers.targets.ANSWER_COORDINATES: a family's own, or
    pixels of the image), which Qwen2-VL's <|box_start|> syntax needs not name."""
    records, ids, refusals = [], UniqueIds(), Refusals(out_dir, skip_bad_rows)
    counts = {
        "conversations": 0,
        "skipped_without_image": 0,
        "skipped_video": 0,
        "skipped_audio": 0,
        "skipped_not_learned": 0,
        "image_shown_again": 0,
        "grounding_rows": 0,
        "preference_pairs": 0,
        "rounds_not_learned": 0,
        "answers_from_solution": 0,
    }
    for path in files:
        for where, row in json_rows(path, refusals):
            with refusals.row(where):
                conversation = Conversation.read(row, where, Path(image_root), answer_coordinates)
                if isinstance(conversation, str):  # skipped: why
                    counts[conversation] += 1
                    continue
                counts["conversations"] += 1
                counts["image_shown_again"] += conversation.shown_again
                counts["grounding_rows"] += bool(conversation.extra)
                counts["preference_pairs"] += conversation.rejected is not None
                counts["rounds_not_learned"] += len(conversation.not_learned)
                counts["answers_from_solution"] += conversation.from_solution
                base_id = ids.add(str(row.get("id", f"{Path(path).stem}-{where[1]}")), where)
                for record in conversation.records(base_id):
                    if record["id"] != base_id:  # a round's own id: unique too
                        record["id"] = ids.add(record["id"], where)
                    records.append(record)
    refused = refusals.finish()
    write_splits(out_dir, {split: records})
    return {"records": len(records), **counts, **refused, **ids.summary(), "splits": {split: len(records)}}


class Conversation:
    """One image, an optional system prompt and rounds of (question, answer)."""

    def __init__(
        self,
        image: str,
        system: str | None,
        rounds: list[tuple[str, str]],
        shown_again: int,
        extra: dict,
        rejected: str | None = None,
        not_learned: frozenset[int] = frozenset(),
        from_solution: bool = False,
    ):
        self.image, self.system, self.rounds, self.shown_again, self.extra = image, system, rounds, shown_again, extra
        self.from_solution = from_solution  # its last answer is the row's `solution` (a GRPO row's reference)
        self.rejected = rejected  # a preference pair's rejected answer to its last question
        # Rounds whose answers their publisher marks as not learned (ms-swift's `loss: false`,
        # LLaMA-Factory v1's `loss_weight: 0`): no record of their own, kept in later rounds' history.
        self.not_learned = not_learned

    def records(self, base_id: str) -> list[dict]:
        if self.rejected is not None:  # the pair: its last round, the rounds before as its history
            n = len(self.rounds) - 1
            record = {"id": base_id, "image": self.image, **({"system": self.system} if self.system else {})}
            if n:
                record["history"] = [{"question": q, "answer": a} for q, a in self.rounds[:n]]
            question, answer = self.rounds[n]
            return [dict(record, question=question, answer=answer, rejected=self.rejected, **self.extra)]
        out = []
        for n, (question, answer) in enumerate(self.rounds):
            if n in self.not_learned:
                continue
            record = {"id": base_id if len(self.rounds) == 1 else f"{base_id}-{n + 1}", "image": self.image}
            if self.system:
                record["system"] = self.system
            if n:
                record["history"] = [{"question": q, "answer": a} for q, a in self.rounds[:n]]
            out.append(dict(record, question=question, answer=answer, **self.extra))
        return out

    @classmethod
    def read(cls, row, where, image_root: Path, coordinates: str | None = None) -> "Conversation | str":
        """The row's conversation, or why it is skipped (a summary count's name): its turns, its
        one image, its rounds' texts, the target a grounding row asks for, and a pair's checks."""
        path, number = where
        if not isinstance(row, dict):
            raise InputError(path, "each record must be a JSON object", number)
        rejected = _rejected(row, where)
        turns, not_learned, system, from_solution = _all_turns(row, rejected, where)
        texts, images_by_turn, media = [], [], set()
        for n, (_, content) in enumerate(turns):
            text, images, kinds = _content(content, where, f"turn {n + 1}")
            texts.append(text)
            images_by_turn.append(images)
            media |= kinds
        image = _one_image(row, texts, images_by_turn, media, image_root, where)
        if image in SKIPPED:
            return image
        markers = sum(t.count(IMAGE_MARKER) for t in texts) + sum(map(len, images_by_turn))
        texts = [t.replace(IMAGE_MARKER, "").strip() for t in texts]
        rounds = list(zip(texts[0::2], texts[1::2]))
        for n, (question, answer) in enumerate(rounds, start=1):
            if not question or not answer:
                raise InputError(path, f"an empty question or answer in round {n}", number)
        rounds, extra = conversation_target(row, rounds, where, image_root / image, coordinates)
        _check_pair(rejected, rounds, extra, not_learned, where)
        if len(not_learned) == len(rounds) and rejected is None:
            return "skipped_not_learned"  # every answer marked not to be learned: nothing to learn from it
        shown_again = max(0, markers - 1)
        return cls(image, system, rounds, shown_again, extra, rejected, frozenset(not_learned), from_solution)


# Why a row is skipped: the summary's counts of rows without an image, and of video or audio alone.
SKIPPED = ("skipped_without_image", *(f"skipped_{kind}" for kind in MEDIA))


def _all_turns(row: dict, rejected: str | None, where) -> tuple[list, set[int], str | None, bool]:
    """The row's user and assistant turns in turn (a GRPO row's `solution` and LLaMA-Factory's
    `chosen` as its last answer), the rounds not learned, its system prompt, and whether its last
    answer is its `solution`."""
    path, number = where
    turns, not_learned = _turns(row, where)
    from_solution = "solution" in row and bool(turns) and turns[-1][0] == "user"
    if from_solution:  # ms-swift's GRPO rows: the question alone, its reference answer as `solution`
        turns.append(("assistant", _solution(row["solution"], where)))
    if rejected is not None and "chosen" in row:  # LLaMA-Factory's: the conversation ends with the question
        turns.append(("assistant", _answer_turn(row["chosen"], where, "chosen")))
    system = row.get("system")
    if turns and turns[0][0] == "system":
        system = turns.pop(0)[1]
    system = _content(system, where, "system")[0] if system is not None else None
    roles = [role for role, _ in turns]
    if not roles or roles != ["user", "assistant"] * (len(roles) // 2) or len(roles) % 2:
        raise InputError(path, f"needs user and assistant turns in turn, ending with an answer; has {roles}", number)
    return turns, not_learned, system, from_solution


def _one_image(row: dict, texts: list[str], images_by_turn: list, media: set[str], image_root: Path, where) -> str:
    """The conversation's one image, relative to `image_root`, or why the row is skipped (SKIPPED):
    refused where it has several, holds their bytes, shows video or audio beside it, or first shows
    it after the first question."""
    path, number = where
    media |= {kind for kind, (fields, _, marker) in MEDIA.items() if any(row.get(f) for f in fields)}
    media |= {kind for kind, (_, _, marker) in MEDIA.items() if any(marker in t for t in texts)}
    listed = row.get("images", row.get("image", []))
    listed = [listed] if isinstance(listed, str) else listed
    if holds_bytes(listed):
        raise InputError(
            path,
            "holds its images' bytes, not their paths: this importer reads image files under --image-root "
            "(`vqa` reads a row's embedded image)",
            number,
            "images",
        )
    if not isinstance(listed, list) or not all(isinstance(i, str) for i in listed):
        raise InputError(path, f"must be a list of paths, not {shown(listed)}", number, "images")
    images = listed + [image for turn in images_by_turn for image in turn]
    if media:
        kinds = " and ".join(sorted(media))
        if not images:  # video or audio alone: skipped, counted as what it is
            return f"skipped_{sorted(media)[0]}"
        raise InputError(
            path,
            f"holds {kinds} beside its image: only images are read, and a record without its {kinds} "
            f"would learn answers about what it cannot see",
            number,
        )
    if not images:
        if any(IMAGE_MARKER in t for t in texts):
            raise InputError(path, f"has {IMAGE_MARKER} in its text but names no image", number, "images")
        return "skipped_without_image"
    distinct = list(dict.fromkeys(images))
    if len(distinct) > 1:
        raise InputError(path, f"needs one image, has {len(distinct)}: {', '.join(distinct)}", number, "images")
    if "rejected_images" in row and _files(row["rejected_images"], image_root, where) != _files(
        distinct, image_root, where
    ):
        # ms-swift's field: the same image again names the pair's one image; another would not.
        raise InputError(
            path,
            "the rejected answer is about other images: a pair answers one question about one image",
            number,
            "rejected_images",
        )
    first_shown = next((n for n, t in enumerate(texts) if IMAGE_MARKER in t), None)
    parts_first = next((n for n, imgs in enumerate(images_by_turn) if imgs), None)
    first_turns = [n for n in (first_shown, parts_first) if n is not None]
    if first_turns and min(first_turns) != 0:
        raise InputError(
            path,
            f"its image is first shown in turn {min(first_turns) + 1}; a record shows its image in its first question",
            number,
        )
    return _relative(distinct[0], image_root, where)


def _check_pair(rejected: str | None, rounds: list, extra: dict, not_learned: set[int], where) -> None:
    """A preference pair's rejected answer: to a question that is no click, other than the chosen
    answer, beside a chosen answer that is learned."""
    if rejected is None:
        return
    path, number = where
    if extra:
        raise InputError(path, "a grounding row with a rejected answer: pairs of clicks are not learned", number)
    if rejected == rounds[-1][1]:
        raise InputError(
            path, "the same as the chosen answer: a preference pair needs two different answers", number, "rejected"
        )
    if len(rounds) - 1 in not_learned:
        raise InputError(path, "a pair whose chosen answer is marked not to be learned (loss)", number)


def _rejected(row: dict, where) -> str | None:
    """A preference pair's rejected answer (ms-swift's `rejected_response`, LLaMA-Factory's
    `rejected` turn beside its `chosen` one), or None for a row of answers alone. What is no pair of
    answers to one question about one image is refused: a KTO row (one answer, `label` true or
    false), pairs as whole conversations (and, where the row is read, a rejected answer about other
    images, `rejected_images`, or one the same as the chosen answer)."""
    path, number = where
    label = row.get("label", row.get("kto_tag"))
    if isinstance(label, bool) or (isinstance(label, str) and label.strip().lower() in ("true", "false")):
        raise InputError(
            path,
            "a KTO row (label: true/false marks one answer desirable or not): preference stages learn from a "
            "chosen and a rejected answer to one question, and this row has one answer",
            number,
            "label" if "label" in row else "kto_tag",
        )
    if found := [f for f in WHOLE_CONVERSATION_PAIRS if f in row]:
        raise InputError(
            path,
            f"a pair as whole conversations ({', '.join(found)}) is not read: give ms-swift's rejected_response or "
            "LLaMA-Factory's chosen and rejected turns",
            number,
        )
    if "rejected_response" in row:
        return _answer_turn(row["rejected_response"], where, "rejected_response")
    if "rejected" in row or "chosen" in row:
        if "rejected" not in row or "chosen" not in row:
            raise InputError(path, "a pair needs both a 'chosen' and a 'rejected' answer", number)
        return _answer_turn(row["rejected"], where, "rejected")
    return None


def _files(images, image_root: Path, where) -> list[str]:
    """The distinct image files a row's image field names, as paths under `image_root` (the same
    file named relatively and absolutely is one)."""
    listed = _listed(images)
    if not all(isinstance(i, str) for i in listed):
        raise InputError(where[0], f"must name image files, not {shown(images)}", where[1], "rejected_images")
    return list(dict.fromkeys(_relative(i, image_root, where) for i in listed))


def _listed(value) -> list:
    """A row's image field as a list of its distinct entries (one path may be given bare)."""
    return list(dict.fromkeys([value] if isinstance(value, str) else value if isinstance(value, list) else [value]))


def _solution(value, where) -> str:
    """A GRPO row's reference answer: text, its R1-style tags read (importers.common.tagged_answer).
    A box or an action (GUI-R1's, VLM-R1's REC solutions) is refused as what it is: the `vqa`
    importer reads those rows (importers.targets)."""
    if (kind := structure(value)) is not None:
        raise InputError(
            where[0],
            f"is {kind}, not text: this importer reads text solutions (`vqa` reads a box or a click action as a "
            "click record)",
            where[1],
            "solution",
        )
    if not isinstance(value, str) or not value.strip():
        raise InputError(where[0], "must be a non-empty answer", where[1], "solution")
    return tagged_answer(value) or value.strip()


def _role_turns(value) -> bool:
    """Whether a list holds role / content (or from / value) turns, as `messages` does."""
    return isinstance(value, list) and any(isinstance(t, dict) and ("role" in t or "from" in t) for t in value)


def _answer_turn(value, where, field: str) -> str:
    """An answer given beside the conversation: text, or an assistant turn ({from/role, value/content}),
    alone or as a list of that one turn (as ms-swift's messages write it)."""
    if isinstance(value, list) and len(value) == 1:
        value = value[0]
    if isinstance(value, dict):
        if ROLES.get(value.get("role", value.get("from"))) != "assistant":
            raise InputError(where[0], "must be an assistant turn", where[1], field)
        value = value.get("content", value.get("value"))
    if not isinstance(value, str) or not value.strip():
        raise InputError(where[0], "must be a non-empty answer", where[1], field)
    return value.strip()


def _turns(row: dict, where) -> tuple[list[tuple[str, object]], set[int]]:
    """(role, content) of each turn, from any of the published layouts: `messages` (role /
    content), `conversations` (from / value, as sharegpt and LLaVA write it), ms-swift's sharegpt
    `conversation` ([{human, assistant}]) and its query / response / history ([[query, response]]);
    and the rounds (counted from 0, a system turn apart) whose answers are marked not to be learned."""
    path, number = where
    if "conversation" in row and "conversations" not in row and not _role_turns(row["conversation"]):
        pairs = row["conversation"]
        if not isinstance(pairs, list) or not all(isinstance(p, dict) for p in pairs):
            raise InputError(path, "must be a list of {human, assistant}", number, "conversation")
        return [t for p in pairs for t in (("user", p.get("human")), ("assistant", p.get("assistant")))], set()
    if "query" in row and "messages" not in row:
        history = row.get("history") or []
        if not isinstance(history, list) or not all(isinstance(h, list) and len(h) == 2 for h in history):
            raise InputError(path, "must be a list of [query, response] pairs", number, "history")
        pairs = history + [[row["query"], row.get("response")]]
        return [t for q, r in pairs for t in (("user", q), ("assistant", r))], set()
    if "messages" in row:
        raw = row["messages"]
    elif "conversations" in row:
        raw = row["conversations"]
    elif "conversation" in row:  # Mantis's: role / content turns under ms-swift's field name
        raw = row["conversation"]
    else:
        raise InputError(path, "none of 'messages', 'conversations', 'conversation' or 'query'", number)
    if not isinstance(raw, list) or not all(isinstance(m, dict) for m in raw):
        raise InputError(path, "must be a list of turns", number, "messages" if "messages" in row else "conversations")
    turns, not_learned = [], set()
    for message in raw:
        role = message.get("role", message.get("from"))
        if role not in ROLES:
            raise InputError(path, f"a turn of role {role!r}: only system, user and assistant turns are taken", number)
        turns.append((ROLES[role], message.get("content", message.get("value"))))
        if ROLES[role] == "assistant" and (message.get("loss") is False or message.get("loss_weight") in (0, 0.0)):
            not_learned.add(sum(r == "assistant" for r, _ in turns) - 1)
    return turns, not_learned


def _content(content, where, what: str) -> tuple[str, list[str], set[str]]:
    """A turn's text (its `<image>` markers left in, Qwen-VL's inline `<img>` images taken out), the
    images its typed parts and inline images name, and the other media its parts hold (video, audio)."""
    if isinstance(content, str):
        inline = INLINE_IMAGE.findall(content)
        return INLINE_IMAGE.sub("", content) if inline else content, [i.strip() for i in inline], set()
    if not isinstance(content, list):
        raise InputError(where[0], f"{what}: content must be text or a list of parts, not {shown(content)}", where[1])
    texts, images, media = [], [], set()
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        other = next((media for media, (_, types, _) in MEDIA.items() if kind in types), None)
        if other is not None:
            media.add(other)
        elif kind == "text":
            texts.append(str(part.get("value", part.get("text", ""))))
        elif kind in IMAGE_PART_TYPES:
            value = part.get("value", part.get(kind))
            value = value.get("url") if isinstance(value, dict) else value
            if not isinstance(value, str):
                raise InputError(where[0], f"{what}: an image part without a path: {shown(part)}", where[1])
            images.append(value)
        else:
            raise InputError(
                where[0], f"{what}: a part of type {kind!r}: only text and image parts are taken", where[1]
            )
    return "\n".join(texts), images, media


def _relative(image: str, image_root: Path, where) -> str:
    """The image's path relative to `image_root` (a `file://` URL is a path); a URL is refused
    (nothing is downloaded at run time), and so is an image written into the row (a `data:` URL)."""
    if image.startswith("file://"):
        image = image[len("file://") :]
    if image.startswith("data:"):
        raise InputError(
            where[0],
            f"image {image[:40]}... is written into the row as a data: URL: save it as a file under the image "
            "root and name that file",
            where[1],
            "images",
        )
    if "://" in image:
        raise InputError(
            where[0],
            f"image {image} is a URL: download it and name the file (nothing is downloaded at run time)",
            where[1],
            "images",
        )
    path = Path(image)
    if path.is_absolute():
        try:
            path = path.relative_to(image_root.resolve())
        except ValueError:
            raise InputError(where[0], f"image {image} is not under {image_root}", where[1], "images") from None
    return str(path)
