"""TRL's GRPOTrainer on grpo_speed.py's workload (run by it with --trl-site, in a process of its own
with TRL's pinned packages first on PYTHONPATH): the same checkpoint, the same questions on the same
images, G answers sampled to each by TRL's own generation (transformers' `generate`; vLLM cannot be
installed on the GPU machine), the same reward's cost class (a cheap function of the text), LoRA
r=16 (alpha 32, no dropout) on the language model's linear layers, bf16, β 0 (no reference pass, as
ours), one update a rollout (num_iterations 1), P questions an optimizer step: TRL generates the
step's P x G answers at once (generation_batch_size) and computes its loss one question's G answers
a micro-batch (per_device_train_batch_size G, gradient accumulation P), as its documentation lays out
a step of P prompts. Each optimizer step is timed with the GPU synchronized at its start and end
(rollout, log-probabilities and update together), as peer_timer.py times the peers' SFT steps.

    python benchmarks/grpo_trl.py --model DIR --questions prompts/raw.jsonl --images DIR --prompts 4 \\
        --generations 8 --max-completion-length 20 --steps 6 --result trl.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

# The project's language-model linear layers (vlft.modeling's LoRA targets): not the vision tower's.
TARGETS = r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--questions", required=True, help="raw JSONL: image (relative to --images), question")
    parser.add_argument("--images", required=True)
    parser.add_argument("--prompts", type=int, required=True, help="questions an optimizer step")
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--max-completion-length", type=int, default=20)
    parser.add_argument("--steps", type=int, default=6)
    # TRL's default; without it the 8B's micro-batch of 8 answers (each with its image) ran out of an
    # H100's memory in the loss's forward (2026-11-26).
    parser.add_argument("--gradient-checkpointing", type=int, choices=[0, 1], default=1)
    parser.add_argument("--result", required=True)
    return parser.parse_args()


def dataset_of(args):
    """The benchmark's questions as TRL's conversational rows, each with its image."""
    import datasets

    rows = [json.loads(line) for line in Path(args.questions).read_text().splitlines()]
    rows = rows[: args.prompts * args.steps]
    return datasets.Dataset.from_list(
        [
            {
                "prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": r["question"]}]}],
                "image": str(Path(args.images) / r["image"]),
            }
            for r in rows
        ]
    ).cast_column("image", datasets.Image())


def answer_length(completions, **kwargs):
    """As cheap as our `format` reward: a function of each answer's text."""
    return [float(len(c[0]["content"]) % 7) for c in completions]


def grpo_settings(args, gpu: bool) -> dict:
    """TRL's GRPOConfig as ours runs the same step: G answers to each of --prompts questions a step."""
    return dict(
        output_dir=str(Path(args.result).parent / "trl-out"),
        per_device_train_batch_size=args.generations,
        gradient_accumulation_steps=args.prompts,
        num_generations=args.generations,
        max_completion_length=args.max_completion_length,
        max_prompt_length=None,  # the image's tokens are the prompt's: never cut
        temperature=1.0,
        beta=0.0,
        num_iterations=1,
        learning_rate=1e-4,
        lr_scheduler_type="constant",
        warmup_ratio=0.0,
        weight_decay=0.0,
        max_steps=args.steps,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        bf16=gpu,
        use_cpu=not gpu,
        gradient_checkpointing=bool(args.gradient_checkpointing),
        seed=0,
        shuffle_dataset=False,
        dataloader_num_workers=0,
    )


def step_timer(steps: list[float], gpu: bool):
    """A callback that appends each step's seconds to `steps`, the device synchronized around it."""
    import torch
    import transformers

    synchronize = torch.cuda.synchronize if gpu else (lambda: None)

    class StepTimer(transformers.TrainerCallback):
        def on_step_begin(self, *a, **k):
            synchronize()
            self.start = time.perf_counter()

        def on_step_end(self, *a, **k):
            synchronize()
            steps.append(time.perf_counter() - self.start)

    return StepTimer()


def main() -> None:
    args = parse_args()

    import torch
    import transformers
    import trl
    from peft import LoraConfig

    gpu = torch.cuda.is_available()
    settings = grpo_settings(args, gpu)
    # Settings a TRL release no longer has (0.29 dropped max_prompt_length: it never cuts prompts).
    known = {field.name for field in dataclasses.fields(trl.GRPOConfig)}
    config = trl.GRPOConfig(**{k: v for k, v in settings.items() if k in known})
    steps: list[float] = []
    model = transformers.AutoModelForImageTextToText.from_pretrained(
        args.model, dtype=torch.bfloat16 if gpu else torch.float32
    )
    # Left padding, as TRL's own loading sets it: a processor given to it is the caller's to set
    # (huggingface/trl#5785; right padding broke Qwen3-VL's rope index in generate).
    processor = transformers.AutoProcessor.from_pretrained(args.model, padding_side="left")
    processor.tokenizer.padding_side = "left"
    trainer = trl.GRPOTrainer(
        model=model,
        reward_funcs=answer_length,
        args=config,
        train_dataset=dataset_of(args),
        processing_class=processor,
        peft_config=LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=TARGETS),
        callbacks=[step_timer(steps, gpu)],
    )
    trainer.train()
    result = {
        "trl": trl.__version__,
        "transformers": transformers.__version__,
        "step_s": steps,
        "completions_per_step": args.prompts * args.generations,
        "settings_not_in_this_trl": sorted(set(settings) - known),
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if gpu else 0.0,
    }
    Path(args.result).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
