"""Rewards of a reward stage: each sampled answer scored against its record by the evaluation's own
rules, the named rewards combined with the config's weights (TRL's `reward_funcs` and
`reward_weights`: a weighted sum).

Built in, by the name a stage's `rewards` gives them:

- `click_in_box`: 1 where the answered point lands in the target's box, 0 elsewhere or where the
  answer gives no point (vlft.data.clicks.score, as the evaluation judges a click);
- `click_near`: 1 where the answered point lies within NEAR_RADIUS of the target point, as
  AndroidControl's evaluation judges a click on a point target (GUI-R1's and AndroidControl's steps
  give a point, no box);
- `click_gaussian`: GUI-G²'s Gaussian point reward, exp(-((dx / σx)² + (dy / σy)²) / 2) for the
  point's distance to the box's centre, σ half the box's width and height (their alpha 0.5), so
  that a small target asks for a closer click; 0 where the answer gives no point;
- `answer_match`: 1 where the final answer equals the reference by the evaluation's rule
  (vlft.data.answers.is_correct), and for clicks where the point is in the box (`click_near` where
  the record gives a point and no box);
- `format`: 1 where the answer parses in the stage's answer format: a point for clicks, a
  "Final answer:" for chains of thought, a non-empty answer otherwise.

A user's own reward is named `module:function` (importable where the job runs) and called once
for a rollout's answers as `function(records=[...], answers=[...])`, the records as the prepared
split holds them; it returns one number an answer (None where it does not apply). One that raises,
returns something else, or runs long is said in one sentence naming it: it runs beside the job's
main thread, which says every REPORT_EVERY_S seconds that it has not returned, and a stop signal
(Ctrl-C, SLURM's SIGTERM) ends the job at once, the stage resuming from its newest checkpoint.
"""

from __future__ import annotations

import importlib
import math
import numbers
import threading
import time
from dataclasses import dataclass
from typing import Callable

from vlft.data import clicks
from vlft.data.answers import FINAL_ANSWER, AnswerFormat, final_answer, is_correct
from vlft.errors import ConfigError, InputError, TrainingError
from vlft.jobs.stopping import Preempted, StopRequest

# AndroidControl's judge of a click on a point target (GUI-R1's too): within 14% of the screen, each
# axis's distance taken as a fraction of the screen's width or height.
NEAR_RADIUS = 0.14
# GUI-G²'s point reward: σ = alpha x the target box's width (height).
GAUSSIAN_ALPHA = 0.5
# How often the job says a user's reward has not returned yet, and looks for a stop signal meanwhile.
REPORT_EVERY_S = 60.0
WATCH_S = 0.5


@dataclass
class Answer:
    """A sampled answer to judge: its record, its text, and for clicks the image's frame."""

    record: dict
    text: str
    frame: clicks.Frame | None = None


def click_in_box(answer: Answer, answer_format: str) -> float:
    if not answer.record.get("box"):
        raise InputError(
            answer.record["source_split"],
            f"record {answer.record['id']} has a point and no box: click_in_box needs a box, click_near (or "
            "answer_match) judges a point",
        )
    return float(bool(_click(answer)["correct"]))


def click_near(answer: Answer, answer_format: str) -> float:
    point = _click(answer)["point"]
    if point is None:
        return 0.0
    x, y = clicks.target_point(answer.record, answer.record["source_split"])
    dx, dy = (point[0] - x) / answer.frame.width, (point[1] - y) / answer.frame.height
    return float(math.hypot(dx, dy) < NEAR_RADIUS)


def click_gaussian(answer: Answer, answer_format: str) -> float:
    point = _click(answer)["point"]
    if point is None:
        return 0.0
    box = answer.record.get("box")
    if not box:
        raise InputError(
            answer.record["source_split"], f"record {answer.record['id']} has no box: click_gaussian needs its size"
        )
    x1, y1, x2, y2 = box
    sigma_x, sigma_y = GAUSSIAN_ALPHA * (x2 - x1), GAUSSIAN_ALPHA * (y2 - y1)
    dx, dy = point[0] - (x1 + x2) / 2, point[1] - (y1 + y2) / 2
    return math.exp(-0.5 * ((dx / sigma_x) ** 2 + (dy / sigma_y) ** 2))


def answer_match(answer: Answer, answer_format: str) -> float:
    if answer_format == AnswerFormat.CLICK:
        return (click_in_box if answer.record.get("box") else click_near)(answer, answer_format)
    return float(is_correct(answer.text, answer.record["answer"]))


def format_reward(answer: Answer, answer_format: str) -> float:
    if answer_format == AnswerFormat.CLICK:
        return float(clicks.parse_point(answer.text) is not None)
    if answer_format == AnswerFormat.COT:
        return float(FINAL_ANSWER.search(answer.text) is not None and final_answer(answer.text) != "")
    return float(final_answer(answer.text) != "")


def _click(answer: Answer) -> dict:
    record = answer.record
    return clicks.score(record, answer.text, answer.frame, record["source_split"])


BUILT_IN: dict[str, Callable[[Answer, str], float]] = {
    "click_in_box": click_in_box,
    "click_gaussian": click_gaussian,
    "click_near": click_near,
    "answer_match": answer_match,
    "format": format_reward,
}
CLICKS_ONLY = ("click_in_box", "click_gaussian", "click_near")


class Rewards:
    """A stage's rewards (`rewards`: name -> weight) for its answer format."""

    def __init__(self, weights: dict[str, float], answer_format: str, key: str = "rewards"):
        if not weights:
            raise ConfigError(f"{key}: a reward stage needs at least one reward (built in: {', '.join(BUILT_IN)})")
        self.weights, self.answer_format = dict(weights), answer_format
        self.functions = {name: reward_function(name, answer_format, f"{key}.{name}") for name in weights}

    def score(self, answers: list[Answer]) -> dict[str, list[float]]:
        """Each reward of each answer, and their weighted sum (`total`), by name."""
        scored = {}
        for name, function in self.functions.items():
            if name in BUILT_IN:
                scored[name] = [function(answer, self.answer_format) for answer in answers]
            else:
                returned = watched(name, function, [a.record for a in answers], [a.text for a in answers])
                scored[name] = checked(name, returned, answers)
        if all(math.isnan(value) for name in self.functions for value in scored[name]):
            raise TrainingError(
                f"every reward ({', '.join(self.functions)}) returned None for every answer of a rollout: "
                "there is nothing to learn from"
            )
        # A reward that does not apply to an answer (None, NaN) adds nothing to it: TRL's nansum.
        scored["total"] = [
            sum(self.weights[name] * scored[name][i] for name in self.functions if not math.isnan(scored[name][i]))
            for i in range(len(answers))
        ]
        return scored


def reward_function(name: str, answer_format: str, key: str) -> Callable:
    """A built-in reward, or a user's `module:function`, refused in one sentence where it cannot serve."""
    if name in BUILT_IN:
        if name in CLICKS_ONLY and answer_format != AnswerFormat.CLICK:
            raise ConfigError(f"{key}: judges clicks, and this stage answers in '{answer_format}'")
        return BUILT_IN[name]
    module_name, _, function_name = name.partition(":")
    if not module_name or not function_name:
        raise ConfigError(f"{key}: not a built-in reward ({', '.join(BUILT_IN)}) nor a 'module:function' of your own")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ConfigError(f"{key}: module '{module_name}' cannot be imported here ({err})") from None
    except Exception as err:  # the module's own code failed as it was imported
        raise ConfigError(
            f"{key}: module '{module_name}' failed as it was imported ({type(err).__name__}: {err})"
        ) from None
    function = getattr(module, function_name, None)
    if not callable(function):
        raise ConfigError(f"{key}: module '{module_name}' has no function '{function_name}'")
    return lambda records, answers: function(records=records, answers=answers)


def watched(name: str, function: Callable, records: list[dict], texts: list[str]):
    """What a user's reward returns for a rollout's answers, called in a thread of its own while this
    one watches: a reward that blocks (a server that never answers) is said every REPORT_EVERY_S
    seconds, and a stop signal ends the job rather than wait for it. What it raises, a SystemExit
    included, is one sentence naming it."""
    outcome: dict = {}

    def call():
        try:
            outcome["values"] = function(records, texts)
        except BaseException as err:  # SystemExit too: said as the reward's, not as the job's end
            outcome["error"] = err

    thread = threading.Thread(target=call, name=f"reward {name}", daemon=True)
    started = time.monotonic()
    thread.start()
    said = 0
    while thread.is_alive():
        thread.join(timeout=WATCH_S)
        running = time.monotonic() - started
        if thread.is_alive() and StopRequest.received:
            raise Preempted(
                f"{StopRequest.received} received while reward '{name}' had run {running:.0f} s on {len(texts)} answers "
                "without returning: stopped in a step; the retry (or a rerun) resumes from the newest checkpoint"
            )
        if thread.is_alive() and running >= (said + 1) * REPORT_EVERY_S:
            said += 1
            print(f"reward '{name}' has run {running:.0f} s on {len(texts)} answers and not returned yet", flush=True)
    if "error" in outcome:
        err = outcome["error"]
        if isinstance(err, KeyboardInterrupt):
            raise err
        what = (
            f"called sys.exit({err.code!r})" if isinstance(err, SystemExit) else f"raised {type(err).__name__}: {err}"
        )
        raise TrainingError(
            f"reward '{name}' {what} (on {len(texts)} answers, records {records[0]['id']}...)"
        ) from None
    return outcome["values"]


def checked(name: str, values, answers: list[Answer]) -> list[float]:
    """A user's rewards: one number an answer (None or NaN where it does not apply, as TRL allows;
    numpy's numbers and arrays too), or one sentence saying what came back instead."""
    try:
        values = list(values)
    except TypeError:
        raise TrainingError(
            f"reward '{name}' returned {values!r}, not one number an answer (a list of {len(answers)})"
        ) from None
    if len(values) != len(answers):
        raise TrainingError(f"reward '{name}' returned {len(values)} values for {len(answers)} answers")
    for value, answer in zip(values, answers):
        if value is None:
            continue
        if isinstance(value, (str, bytes)) or not isinstance(value, numbers.Real) or math.isinf(float(value)):
            raise TrainingError(f"reward '{name}' returned {value!r} for record {answer.record['id']}: not a number")
    return [math.nan if v is None else float(v) for v in values]
