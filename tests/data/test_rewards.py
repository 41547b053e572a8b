"""Reward stages' pieces: the built-in rewards judge as the evaluation judges, a user's reward is
imported and checked in one sentence, advantages are normalised within each prompt's group, and the
GRPO loss and its gradients are TRL's (trl 0.24's GRPOTrainer._compute_loss, called on a stand-in
for the trainer that holds the settings it reads)."""

from __future__ import annotations

import math
import os
import types
from collections import defaultdict

import pytest
import torch

from vlft.data.clicks import Frame
from vlft.errors import ConfigError, InputError, TrainingError
from vlft.training.objectives import grpo_loss_sum, grpo_step_weight, grpo_token_losses, group_advantages
from vlft.training.mismatch import Mismatch, importance_ratios
from vlft.jobs import distributed
from vlft.data.rewards import Answer, Rewards
from tests.helpers import FLOAT64_RTOL

# A 1000 x 500 screenshot seen on Qwen3-VL's 0-1000 grid; the target box 100 x 50 px around (300, 200).
FRAME = Frame(1000, 500, 1000, 500, "relative")
BUTTON = {"id": "b1", "source_split": "screens.jsonl", "box": [250, 175, 350, 225], "answer": ""}


def click(x_px: float, y_px: float) -> Answer:
    """An answer clicking original pixel (x, y), said on the relative grid."""
    return Answer(BUTTON, f"({round(x_px * 1000 / 1000)}, {round(y_px * 1000 / 500)})", FRAME)


def test_click_rewards_judge_the_point_in_original_pixels():
    rewards = Rewards({"click_in_box": 1.0, "click_gaussian": 1.0, "format": 0.5}, "click")
    answers = [click(300, 200), click(350, 200), click(325, 200), click(351, 200), Answer(BUTTON, "the button", FRAME)]
    scored = rewards.score(answers)
    assert scored["click_in_box"] == [1.0, 1.0, 1.0, 0.0, 0.0]
    # σ is half the box: 50 px along x; 50 px off centre is one σ, 25 px half of one.
    assert scored["click_gaussian"][0] == 1.0
    assert scored["click_gaussian"][1] == pytest.approx(math.exp(-0.5), rel=1e-12)
    assert scored["click_gaussian"][2] == pytest.approx(math.exp(-0.125), rel=1e-12)
    assert scored["click_gaussian"][4] == 0.0 and scored["format"] == [1, 1, 1, 1, 0]
    assert scored["total"][1] == pytest.approx(1 + math.exp(-0.5) + 0.5)
    with pytest.raises(InputError, match="record p1 has no box: click_gaussian needs its size"):
        Rewards({"click_gaussian": 1.0}, "click").score(
            [Answer(BUTTON | {"id": "p1", "box": None, "point": [300, 200]}, "(1, 2)", FRAME)]
        )


def test_a_point_target_is_judged_near_it_as_android_control_judges_a_click():
    """GUI-R1's and AndroidControl's click steps give a point, no box: click_near (and answer_match)
    reward a click within 14% of the screen, each axis over its own side (1000 x 500 here: 139 px
    along x is inside, 141 px outside; 69 px along y inside, 71 px outside); click_in_box says it
    needs a box, in one sentence."""
    target = BUTTON | {"id": "p1", "box": None, "point": [300, 200]}
    answers = [
        Answer(target, click(x, y).text, FRAME) for x, y in [(300, 200), (439, 200), (441, 200), (300, 269), (300, 271)]
    ]
    answers.append(Answer(target, "the button", FRAME))
    scored = Rewards({"click_near": 1.0, "answer_match": 1.0}, "click").score(answers)
    assert scored["click_near"] == scored["answer_match"] == [1.0, 1.0, 0.0, 1.0, 0.0, 0.0]
    with pytest.raises(InputError, match="record p1 has a point and no box: click_in_box needs a box, click_near"):
        Rewards({"click_in_box": 1.0}, "click").score(answers[:1])
    assert Rewards({"answer_match": 1.0}, "click").score([click(300, 200), click(351, 200)])["answer_match"] == [1, 0]


def test_answer_rewards_judge_the_final_answer_as_the_evaluation_does():
    record = {"id": "q", "source_split": "val.jsonl", "answer": "Two circles. Final answer: 2"}
    rewards = Rewards({"answer_match": 1.0, "format": 0.2}, "cot")
    texts = ["I see two. Final answer: two", "Final answer: 3", "two", "Final answer:"]
    scored = rewards.score([Answer(record, text) for text in texts])
    assert scored["answer_match"] == [1.0, 0.0, 1.0, 0.0]  # 'two' == '2', as is_correct normalizes
    assert scored["format"] == [1.0, 1.0, 0.0, 0.0]
    assert scored["total"] == pytest.approx([1.2, 0.2, 1.0, 0.0])


def test_a_users_reward_is_imported_and_what_it_returns_checked(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        "def brevity(records, answers):\n    return [1.0 / len(a) for a in answers]\n"
        "def partial(records, answers):\n    return [None if r['id'] == 'b' else 1 for r in records]\n"
        "def short(records, answers):\n    return [1.0]\n"
        "def words(records, answers):\n    return ['good' for a in answers]\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    answers = [Answer({"id": "a", "answer": "x"}, "four"), Answer({"id": "b", "answer": "x"}, "no")]
    scored = Rewards({"my_rewards:brevity": 2.0, "my_rewards:partial": 1.0}, "final").score(answers)
    assert scored["my_rewards:brevity"] == [0.25, 0.5]
    assert math.isnan(scored["my_rewards:partial"][1])
    assert scored["total"] == [1.5, 1.0]  # a reward that does not apply adds nothing
    with pytest.raises(TrainingError, match="reward 'my_rewards:short' returned 1 values for 2 answers"):
        Rewards({"my_rewards:short": 1.0}, "final").score(answers)
    with pytest.raises(TrainingError, match="returned 'good' for record a: not a number"):
        Rewards({"my_rewards:words": 1.0}, "final").score(answers)


MISBEHAVING = """
import sys
import numpy as np


def raises(records, answers):
    raise RuntimeError("the judge server is down")


def exits(records, answers):
    sys.exit(3)


def one_float(records, answers):
    return 0.5


def infinite(records, answers):
    return [float("inf") for a in answers]


def nothing(records, answers):
    return [None for a in answers]


def numpy_array(records, answers):
    return np.array([0.25, 0.75], dtype=np.float32)
"""


@pytest.mark.parametrize(
    "function, said",
    [
        (
            "raises",
            "reward 'misbehaving:raises' raised RuntimeError: the judge server is down (on 2 answers, records a...)",
        ),
        ("exits", "reward 'misbehaving:exits' called sys.exit(3) (on 2 answers, records a...)"),
        ("one_float", "reward 'misbehaving:one_float' returned 0.5, not one number an answer (a list of 2)"),
        ("infinite", "reward 'misbehaving:infinite' returned inf for record a: not a number"),
        (
            "nothing",
            "every reward (misbehaving:nothing) returned None for every answer of a rollout: there is nothing to learn from",
        ),
    ],
)
def test_a_users_reward_that_misbehaves_is_one_sentence_naming_it(tmp_path, monkeypatch, function, said):
    (tmp_path / "misbehaving.py").write_text(MISBEHAVING)
    monkeypatch.syspath_prepend(str(tmp_path))
    answers = [Answer({"id": "a", "answer": "x"}, "four"), Answer({"id": "b", "answer": "x"}, "no")]
    with pytest.raises(TrainingError) as stopped:
        Rewards({f"misbehaving:{function}": 1.0}, "final").score(answers)
    assert str(stopped.value) == said


def test_a_users_reward_may_return_numpys_numbers_and_a_module_that_fails_on_import_is_one_sentence(
    tmp_path, monkeypatch
):
    (tmp_path / "misbehaving.py").write_text(MISBEHAVING)
    (tmp_path / "broken_rewards.py").write_text("raise RuntimeError('no licence key')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    answers = [Answer({"id": "a", "answer": "x"}, "four"), Answer({"id": "b", "answer": "x"}, "no")]
    assert Rewards({"misbehaving:numpy_array": 1.0}, "final").score(answers)["total"] == [0.25, 0.75]
    with pytest.raises(ConfigError) as refused:
        Rewards({"broken_rewards:f": 1.0}, "final")
    assert str(refused.value) == (
        "rewards.broken_rewards:f: module 'broken_rewards' failed as it was imported (RuntimeError: no licence key)"
    )


def test_a_users_reward_that_blocks_is_said_and_a_stop_signal_ends_the_wait(tmp_path, monkeypatch, capsys):
    """A reward waiting on something that never answers: the job says so as it waits, and Ctrl-C
    (or SLURM's SIGTERM) stops it at once, where the job used to wait for the reward for ever."""
    import signal
    import threading

    from vlft.jobs.stopping import Preempted, StopRequest
    from vlft.data import rewards

    (tmp_path / "blocking.py").write_text("import time\n\ndef waits(records, answers):\n    time.sleep(3600)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(rewards, "REPORT_EVERY_S", 1.0)
    monkeypatch.setattr(StopRequest, "received", None)
    previous = {number: signal.getsignal(number) for number in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)}
    StopRequest()  # as the training job has one, from its start
    try:
        threading.Timer(2.5, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
        answers = [Answer({"id": "a", "answer": "x"}, "four"), Answer({"id": "b", "answer": "x"}, "no")]
        with pytest.raises(
            Preempted, match=r"SIGINT received while reward 'blocking:waits' had run \d+ s on 2 answers"
        ):
            Rewards({"blocking:waits": 1.0}, "final").score(answers)
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
    assert "reward 'blocking:waits' has run 1 s on 2 answers and not returned yet" in capsys.readouterr().out


@pytest.mark.parametrize(
    "weights, answer_format, said",
    [
        ({}, "cot", "rewards: a reward stage needs at least one reward"),
        ({"click_in_box": 1.0}, "cot", "rewards.click_in_box: judges clicks, and this stage answers in 'cot'"),
        ({"accuracy": 1.0}, "cot", "rewards.accuracy: not a built-in reward"),
        ({"no_such_module_here:f": 1.0}, "cot", "rewards.no_such_module_here:f: module 'no_such_module_here' cannot"),
        ({"math:no_such_function": 1.0}, "cot", "rewards.math:no_such_function: module 'math' has no function"),
    ],
)
def test_a_reward_that_cannot_serve_is_one_sentence(weights, answer_format, said):
    with pytest.raises(ConfigError, match=said.replace("(", r"\(")):
        Rewards(weights, answer_format)


def test_advantages_are_normalised_within_each_prompts_group():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.5, 1.0, 0.5], dtype=torch.float64)
    grouped = group_advantages(rewards, 4, "group")
    spread = math.sqrt(1 / 3)  # the unbiased standard deviation of [1, 0, 0, 1]
    unit = 0.5 / (spread + 1e-4)
    assert grouped[:4].tolist() == pytest.approx([unit, -unit, -unit, unit], rel=1e-12)
    assert grouped[4:8].tolist() == [0.0] * 4  # all alike: no signal
    assert group_advantages(rewards, 4, "none")[8:].tolist() == [-0.5, 0.0, 0.5, 0.0]
    batch = group_advantages(rewards, 4, "batch")
    assert batch[8].item() == pytest.approx(-0.5 / (rewards.std().item() + 1e-4))


def trl_grpo_loss(
    logps,
    old,
    ref,
    advantages,
    mask,
    loss_type,
    beta,
    epsilon_low,
    epsilon_high,
    max_completion_length,
    level="token",
    truncated=None,
    importance=None,
):
    """TRL's GRPO loss (trl 0.24's GRPOTrainer._compute_loss) on given per-token log-probabilities:
    a stand-in for the trainer holds the settings it reads and hands it `logps` as the model's.
    `level`: its importance_sampling_level. `truncated`: the answers cut off, whose tokens its
    mask_truncated_completions takes out of the completion mask, as its
    _generate_and_score_completions does (after counting every token into num_items_in_batch).
    `importance`: the truncated importance-sampling ratios its vLLM path weights the loss by."""
    import importlib

    flags = importlib.import_module("trl.import_utils")
    for name, value in list(vars(flags).items()):
        if name.endswith("_available") and isinstance(value, tuple):
            setattr(flags, name, value[0])
    from trl.trainer.grpo_trainer import GRPOTrainer

    trainer = types.SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *args, **kwargs: (logps, torch.zeros_like(logps)),
        top_entropy_quantile=1.0,
        beta=beta,
        epsilon_low=epsilon_low,
        epsilon_high=epsilon_high,
        importance_sampling_level=level,
        args=types.SimpleNamespace(delta=None),
        use_vllm=importance is not None,
        vllm_importance_sampling_correction=importance is not None,
        loss_type=loss_type,
        current_gradient_accumulation_steps=1,
        max_completion_length=max_completion_length,
        accelerator=types.SimpleNamespace(gather=lambda x: x, num_processes=1),
        model=types.SimpleNamespace(training=True),
        _metrics={"train": defaultdict(list)},
    )
    inputs = {
        "prompt_ids": torch.zeros(logps.shape[0], 3, dtype=torch.long),
        "prompt_mask": torch.ones(logps.shape[0], 3, dtype=torch.long),
        "completion_ids": torch.zeros_like(mask, dtype=torch.long),
        "completion_mask": mask if truncated is None else mask * (~truncated).long()[:, None],
        "advantages": advantages,
        "old_per_token_logps": old,
        "ref_per_token_logps": ref,
        "num_items_in_batch": mask.sum(),
    }
    if importance is not None:
        inputs["importance_sampling_ratio"] = importance
    return GRPOTrainer._compute_loss(trainer, None, inputs), trainer._metrics["train"]


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
@pytest.mark.parametrize("beta, epsilon_high", [(0.0, 0.2), (0.04, 0.28)], ids=["no-kl", "kl-clip-higher"])
def test_the_grpo_loss_and_its_gradients_are_trls(loss_type, beta, epsilon_high):
    """6 answers of 1 to 7 tokens (padded to 7 for TRL, packed for ours), old log-probabilities off
    the current ones so that ratios clip on both sides: the same loss, gradient and clipped share."""
    generator = torch.Generator().manual_seed(7)
    lengths = torch.tensor([7, 3, 1, 5, 7, 2])
    mask = (torch.arange(7)[None, :] < lengths[:, None]).long()
    logps = (-torch.rand(6, 7, generator=generator, dtype=torch.float64) * 3).requires_grad_()
    old = logps.detach() + torch.randn(6, 7, generator=generator, dtype=torch.float64) * 0.3
    ref = logps.detach() + torch.randn(6, 7, generator=generator, dtype=torch.float64) * 0.5
    advantages = torch.tensor([1.2, -0.7, 0.3, -1.5, 0.0, 0.9], dtype=torch.float64)
    theirs, metrics = trl_grpo_loss(logps, old, ref, advantages, mask, loss_type, beta, 0.2, epsilon_high, 8)
    (their_grad,) = torch.autograd.grad(theirs, logps)

    ours_logps = logps.detach().clone().requires_grad_()
    where = mask.bool()
    owners = torch.arange(6)[:, None].expand(6, 7)[where]
    losses, flags = grpo_token_losses(
        ours_logps[where], old[where], ref[where], advantages[owners], beta, 0.2, epsilon_high
    )
    ours = grpo_loss_sum(losses, owners, lengths, loss_type) / grpo_step_weight(lengths.tolist(), loss_type, 8)
    (our_grad,) = torch.autograd.grad(ours, ours_logps)
    assert ours.item() == pytest.approx(theirs.item(), rel=FLOAT64_RTOL)
    torch.testing.assert_close(our_grad, their_grad, rtol=FLOAT64_RTOL, atol=1e-15)
    clipped = (flags["clipped_low"] | flags["clipped_high"]).double().mean().item()
    # TRL averages the clipped flags in float32: its share is within float32's rounding (6e-8) of ours.
    assert 0 < clipped < 1 and clipped == pytest.approx(metrics["clip_ratio/region_mean"][0], rel=1e-6)
    if beta:
        assert flags["kl"].mean().item() == pytest.approx(metrics["kl"][0], rel=1e-12)


def packed_token_losses(logps, old, ref, advantages, mask, level, **options):
    """Our token losses (KL 0.04, clip 0.2 / 0.28) over padded answers' tokens packed end to end:
    the log-probabilities they differentiate (a leaf copy of `logps`), the losses and the flags."""
    ours = logps.detach().clone().requires_grad_()
    where = mask.bool()
    owners = torch.arange(mask.shape[0])[:, None].expand(*mask.shape)[where]
    sequences = (owners, mask.shape[0]) if level == "sequence" else None
    losses, flags = grpo_token_losses(
        ours[where], old[where], ref[where], advantages[owners], 0.04, 0.2, 0.28, sequences=sequences, **options
    )
    return ours, losses, flags


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("masked", [False, True], ids=["all-learned", "truncated-masked"])
def test_gspo_and_overlong_filtering_are_trls(loss_type, level, masked):
    """GSPO's sequence-level ratio (TRL's `importance_sampling_level: sequence`) and overlong
    filtering (`mask_truncated_completions`: answers 0 and 4, cut off at the longest, learned from
    by no token), with the KL and clip-higher on: the same loss and gradient as TRL's code, and the
    same KL and clip fractions as it logs (GSPO's per answer)."""
    generator = torch.Generator().manual_seed(11)
    lengths = torch.tensor([7, 3, 1, 5, 7, 2])
    mask = (torch.arange(7)[None, :] < lengths[:, None]).long()
    logps = (-torch.rand(6, 7, generator=generator, dtype=torch.float64) * 3).requires_grad_()
    # Off by whole answers as well as by tokens, so that sequence-level ratios clip too: answer 2's
    # above 1 + 0.28 (advantage above 0), answer 3's below 1 - 0.2 (advantage below 0).
    shift = torch.tensor([0.0, 0.1, -0.5, 0.4, 0.0, 0.0], dtype=torch.float64)[:, None]
    old = logps.detach() + shift + torch.randn(6, 7, generator=generator, dtype=torch.float64) * 0.1
    ref = logps.detach() + torch.randn(6, 7, generator=generator, dtype=torch.float64) * 0.5
    advantages = torch.tensor([1.2, -0.7, 0.3, -1.5, 0.9, -0.2], dtype=torch.float64)
    truncated = torch.tensor([True, False, False, False, True, False]) if masked else None
    theirs, metrics = trl_grpo_loss(
        logps, old, ref, advantages, mask, loss_type, 0.04, 0.2, 0.28, 8, level=level, truncated=truncated
    )
    (their_grad,) = torch.autograd.grad(theirs, logps)

    where = mask.bool()
    owners = torch.arange(6)[:, None].expand(6, 7)[where]
    learned = (~truncated).double()[owners] if masked else None
    ours_logps, losses, flags = packed_token_losses(logps, old, ref, advantages, mask, level, learned=learned)
    kept = lengths * (~truncated) if masked else lengths
    weight = grpo_step_weight(lengths.tolist(), loss_type, 8, kept.tolist())
    ours = grpo_loss_sum(losses, owners, lengths, loss_type) / weight
    (our_grad,) = torch.autograd.grad(ours, ours_logps)
    assert ours.item() == pytest.approx(theirs.item(), rel=FLOAT64_RTOL)
    torch.testing.assert_close(our_grad, their_grad, rtol=FLOAT64_RTOL, atol=1e-15)
    if masked:  # a truncated answer's tokens have no gradient
        assert (our_grad[truncated] == 0).all() and (our_grad[~truncated][mask[~truncated].bool()] != 0).all()
    clipped = flags["clipped_low"] | flags["clipped_high"]
    if level == "sequence":  # one flag an answer: TRL's fraction of answers
        share = torch.zeros(6, dtype=torch.bool).index_put((owners,), clipped).double().mean()
    else:  # TRL's fraction of learned tokens
        share = clipped.double().sum() / (learned.sum() if masked else clipped.numel())
    # TRL averages the flags in float32: its share is within float32's rounding (6e-8) of ours.
    assert 0 < share.item() < 1 and share.item() == pytest.approx(metrics["clip_ratio/region_mean"][0], rel=1e-6)
    kl = flags["kl"].sum() / (learned.sum() if masked else flags["kl"].numel())
    assert kl.item() == pytest.approx(metrics["kl"][0], rel=1e-12)


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_truncated_importance_sampling_and_the_mismatch_logged_are_trls(loss_type, level):
    """`tis_imp_ratio_cap`: each token's loss weighted by its ratio at the rollout to the sampler's,
    capped (TRL's `vllm_importance_sampling_cap`, 2.0 here, which some ratios pass), with the KL on:
    the same loss and gradient as TRL's code; and the step's mismatch fields as TRL's
    _generate_and_score_completions computes them from the same log-probabilities (verl's, of
    the probabilities, alike), over the answers the step learns from."""
    generator = torch.Generator().manual_seed(13)
    lengths = torch.tensor([7, 3, 1, 5, 7, 2])
    mask = (torch.arange(7)[None, :] < lengths[:, None]).long()
    logps = (-torch.rand(6, 7, generator=generator, dtype=torch.float64) * 3).requires_grad_()
    old = logps.detach() + torch.randn(6, 7, generator=generator, dtype=torch.float64) * 0.1
    sampled = old + torch.randn(6, 7, generator=generator, dtype=torch.float64) * 0.8
    ref = logps.detach() + torch.randn(6, 7, generator=generator, dtype=torch.float64) * 0.5
    advantages = torch.tensor([1.2, -0.7, 0.3, -1.5, 0.9, -0.2], dtype=torch.float64)
    theirs_ratio = torch.clamp(torch.exp(old - sampled), max=2.0)  # TRL's, as its trainer computes it
    theirs, _ = trl_grpo_loss(
        logps, old, ref, advantages, mask, loss_type, 0.04, 0.2, 0.28, 8, level=level, importance=theirs_ratio
    )
    (their_grad,) = torch.autograd.grad(theirs, logps)

    where = mask.bool()
    owners = torch.arange(6)[:, None].expand(6, 7)[where]
    ratios = importance_ratios(old[where], sampled[where], 2.0)
    assert 0 < int((ratios == 2.0).sum()) < len(ratios)  # the cap binds on some tokens, not all
    ours_logps, losses, _ = packed_token_losses(logps, old, ref, advantages, mask, level, importance=ratios)
    ours = grpo_loss_sum(losses, owners, lengths, loss_type) / grpo_step_weight(lengths.tolist(), loss_type, 8)
    (our_grad,) = torch.autograd.grad(ours, ours_logps)
    assert ours.item() == pytest.approx(theirs.item(), rel=FLOAT64_RTOL)
    torch.testing.assert_close(our_grad, their_grad, rtol=FLOAT64_RTOL, atol=1e-15)

    mismatch = Mismatch()  # the step's micro-batches: answers 0-2, then 3-5
    split = int(lengths[:3].sum())
    for part in (slice(0, split), slice(split, None)):
        mismatch.add(old[where][part], sampled[where][part], ratios[part], None)
    logged = mismatch.fields(distributed.Group())
    delta = torch.abs(old - sampled)[where]  # TRL's, over the completion mask
    probs = torch.abs(old.exp() - sampled.exp())[where]  # verl's rollout_probs_diff
    expected = {
        "sampling/sampling_logp_difference/mean": delta.mean(),
        "sampling/sampling_logp_difference/max": delta.max(),
        "sampling/importance_sampling_ratio/min": theirs_ratio[where].min(),
        "sampling/importance_sampling_ratio/mean": theirs_ratio[where].mean(),
        "sampling/importance_sampling_ratio/max": theirs_ratio[where].max(),
        "training/rollout_probs_diff_mean": probs.mean(),
        "training/rollout_probs_diff_max": probs.max(),
    }
    assert logged.keys() == expected.keys()
    for name, value in expected.items():
        assert logged[name] == pytest.approx(value.item(), rel=FLOAT64_RTOL), name
