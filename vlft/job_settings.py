"""A training job's settings, resolved once at its entry point into one typed object.

The plan hands a training job its stage's settings as its params, leaving out the options that are
off (vlft.stage_params.LEFT_OUT_WHEN_OFF), so that adding an option reruns nothing a study has trained. The
job takes them back in here, once: every key the schema documents, the params' values where they
give one, the schema's defaults elsewhere (vlft.config.stage_defaults). Nothing downstream reads a
setting with a default of its own. What a job's identity rests on (its checkpoints' directory, its
fingerprint) stays the params as given (`params`), so the rerun policy is the plan's.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from vlft.config import METHOD_DEFAULTS, stage_defaults
from vlft.errors import ConfigError
from vlft.stage_params import RUN_ONLY_KEYS


@dataclass(frozen=True)
class StageSettings:
    dataset: str | None  # the plan always names it; None only where a caller needs no data
    train_splits: list[str]
    eval_splits: list[str]
    filter: dict
    order: str  # random, given or by_field
    order_field: str | None
    order_descending: bool
    init_from: str | None
    answer_format: str  # vlft.data.answers.AnswerFormat
    epochs: int
    max_steps: int | None
    learning_rate: float
    lr_schedule: str
    warmup_ratio: float
    weight_decay: float
    max_grad_norm: float
    micro_batch: int
    grad_accum: int
    lora_r: int
    lora_alpha: int
    lora_dropout: float
    lora_target_modules: list[str]
    vision_lora: bool  # LoRA on the vision tower's blocks too
    train_merger: bool  # the merger trained in full, saved with the adapter
    min_pixels: int | None
    max_pixels: int | None
    max_seq_len: int
    seed: int
    vision_cache: bool
    max_batch_tokens: int | str | None  # a number, "auto" or None
    packing: bool
    compile: bool
    image_groups: bool
    method: str  # sft, dpo or grpo (vlft.training.methods)
    beta: float | None  # None only where the method is sft (vlft.config.METHOD_DEFAULTS)
    loss_type: str | None
    label_smoothing: float
    rpo_alpha: float | None
    num_generations: int
    num_iterations: int
    max_completion_length: int
    temperature: float
    top_p: float
    top_k: int
    epsilon: float
    epsilon_high: float | None
    scale_rewards: str
    importance_sampling_level: str  # token (GRPO) or sequence (GSPO)
    mask_truncated_completions: bool
    tis_imp_ratio_cap: float | None
    filter_groups: bool  # dynamic sampling
    max_num_gen_batches: int
    rewards: dict
    quantization_bit: int | None
    eval_every: int
    eval_samples: int
    eval_split: str | None
    keep: str  # last or best
    best_metric: str  # accuracy or loss
    params: dict = field(compare=False, repr=False)  # as the job was given them

    @classmethod
    def resolve(cls, params: dict) -> "StageSettings":
        """The job's params, every key they leave out taken from the schema's default; a key the
        schema does not know is an error naming it."""
        names = {f.name for f in fields(cls)} - {"params"}
        unknown = sorted(set(params) - names - set(RUN_ONLY_KEYS))
        if unknown:
            raise ConfigError(f"unknown stage setting(s) {', '.join(unknown)} in this job's settings")
        values = {k: v for k, v in ({"dataset": None} | stage_defaults() | params).items() if k in names}
        for key, value in METHOD_DEFAULTS.get(values["method"], {}).items():
            values[key] = value if values[key] is None else values[key]
        return cls(**values, params=dict(params))

    def __getitem__(self, key: str):
        """A setting by name, for code that takes a stage's settings as a mapping (lora_config,
        the schedule's checks, the plan's)."""
        return getattr(self, key)
