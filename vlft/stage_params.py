"""What a stage's params are, for the plan that writes them and the jobs that read them: the keys
never in them, those left out while off, with another or for another method, and the schedule's
warmup rule that both the config's check and the training job apply."""

from __future__ import annotations

import math

# Keys that decide how a job runs, not what it computes: never part of a job's params.
RUN_ONLY_KEYS = ("resources", "checkpoint_every", "activation_checkpointing")

# Options added after studies already ran, left out of a stage's parameters while off, so that
# adding them reruns nothing a study has already trained. The training job takes them back from the
# schema's defaults, once, at its entry (vlft.job_settings).
LEFT_OUT_WHEN_OFF = {"image_groups": False, "eval_every": 0, "quantization_bit": None, "method": "sft"}
LEFT_OUT_WHEN_OFF |= {"importance_sampling_level": "token", "mask_truncated_completions": False}
LEFT_OUT_WHEN_OFF |= {"tis_imp_ratio_cap": None, "filter_groups": False}
LEFT_OUT_WHEN_OFF |= {"vision_lora": False, "train_merger": False}
# Options that mean something only while another is on: left out with it.
WATCHING_KEYS = ("eval_samples", "eval_split", "keep", "best_metric")  # a stage's evaluations during training
LEFT_OUT_WITH = {key: "eval_every" for key in WATCHING_KEYS} | {"max_num_gen_batches": "filter_groups"}
# Each training method's own settings: left out of a stage's params unless it uses that method.
GRPO_KEYS = ("num_generations", "max_completion_length", "temperature", "top_p", "top_k", "epsilon")
GRPO_KEYS += ("epsilon_high", "scale_rewards", "rewards", "num_iterations")
GRPO_KEYS += ("importance_sampling_level", "mask_truncated_completions", "tis_imp_ratio_cap")
GRPO_KEYS += ("filter_groups", "max_num_gen_batches")
METHOD_KEYS = {
    "dpo": ("beta", "loss_type", "label_smoothing", "rpo_alpha"),
    "grpo": ("beta", "loss_type") + GRPO_KEYS,
}
LOSS_TYPES = {"dpo": ("sigmoid",), "grpo": ("grpo", "bnpo", "dr_grpo", "dapo")}

# Settings that must match between a stage and the stage it starts from (the adapter's shape: what
# it holds trains on in the later stage).
LORA_KEYS = ("lora_r", "lora_alpha", "lora_target_modules", "vision_lora", "train_merger")


def trains_vision(settings) -> bool:
    """Whether a stage trains any part of the image's path (the tower's LoRA, the merger): then the
    vision cache, the frozen tower's outputs, cannot stand in for it."""
    return bool(settings["vision_lora"] or settings["train_merger"])


def warmup_steps(settings: dict, n_steps: int) -> int:
    """Steps of linear warmup from learning rate 0 (the first step's rate) up to `learning_rate`."""
    if settings["lr_schedule"] == "constant":
        return 0
    return math.ceil(settings["warmup_ratio"] * n_steps)


def schedule_problem(settings: dict, n_steps: int) -> str | None:
    """Why a stage of `n_steps` steps would not train as its schedule intends, or None: a schedule
    all in warmup never reaches its learning rate, and one step of warmup is one step at rate 0."""
    warmup = warmup_steps(settings, n_steps)
    if warmup < n_steps:
        return None
    return (
        f"all {n_steps} of its steps are warmup (warmup_ratio {settings['warmup_ratio']} of {n_steps} is "
        f"{warmup} step(s), the first at learning rate 0), so it never trains at learning_rate; "
        "give it more steps, or warmup_ratio: 0"
    )
