"""Run a peer's training command with a step timer on its Trainer (used by benchmarks/peers.py).

    python benchmarks/peer_timer.py RESULT.json swift --model ... (ms-swift's `swift sft` arguments)
    python benchmarks/peer_timer.py RESULT.json swift-rlhf --rlhf_type dpo ... (`swift rlhf`'s)
    python benchmarks/peer_timer.py RESULT.json llamafactory train CONFIG.yaml

Both peers train with a transformers Trainer. This wraps that class, whichever subclass the peer
uses, the way the training benchmark times its reference: the GPU synchronized at each optimizer
step's start and end. It counts what each step computed from the batches themselves: samples
(each has one image, so one `<|vision_start|>` token), tokens that are not padding, and all the
tokens its batches held (padding included). At the end
it writes the steps, the logged losses and the peak GPU memory to RESULT.json. Nothing of the
peer's training is changed.
"""

from __future__ import annotations

import functools
import json
import os
import runpy
import sys
import time


def install(result_path: str, vision_start_id: int, pad_id: int) -> None:
    import torch
    import transformers

    steps, losses, counts = [], [], {"samples": 0, "tokens": 0, "computed": 0}
    gpu = torch.cuda.is_available()
    synchronize = torch.cuda.synchronize if gpu else lambda: None  # the CPU: the test of this counting

    class StepTimer(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            synchronize()
            counts.update(samples=0, tokens=0, computed=0)
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            synchronize()
            steps.append({"s": time.perf_counter() - self.start, **counts})

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                losses.append(float(logs["loss"]))

        def on_train_end(self, args, state, control, **kwargs):
            result = {
                "steps": steps,
                "losses": losses,
                "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if gpu else 0.0,
            }
            with open(result_path, "w") as f:
                json.dump(result, f)

    trainer_init = transformers.Trainer.__init__
    training_step = transformers.Trainer.training_step

    @functools.wraps(trainer_init)  # peers read the signature (ms-swift: processing_class or tokenizer)
    def init(self, *args, **kwargs):
        trainer_init(self, *args, **kwargs)
        self.add_callback(StepTimer())

    @functools.wraps(training_step)
    def step(self, model, inputs, *args, **kwargs):
        # A GRPO trainer's step takes its prompts, not a batch of ids: its answers are counted by the caller.
        ids = inputs.get("input_ids") if isinstance(inputs, dict) else None
        if ids is not None:
            counts["samples"] += int((ids == vision_start_id).sum())
            counts["tokens"] += int((ids != pad_id).sum())
            counts["computed"] += ids.numel()
        return training_step(self, model, inputs, *args, **kwargs)

    transformers.Trainer.__init__ = init
    transformers.Trainer.training_step = step


def main() -> None:
    result_path, peer, *args = sys.argv[1:]
    install(result_path, int(os.environ["PEER_VISION_START_ID"]), int(os.environ["PEER_PAD_ID"]))
    if peer in ("swift", "swift-rlhf"):  # what `swift sft` (or `swift rlhf`) runs on one GPU
        command = "rlhf" if peer == "swift-rlhf" else "sft"
        sys.argv = [f"swift-{command}", *args]
        runpy.run_module(f"swift.cli.{command}", run_name="__main__")
    elif peer == "llamafactory":  # what `llamafactory-cli` runs
        sys.argv = ["llamafactory-cli", *args]
        from llamafactory.cli import main as cli

        cli()
    else:
        raise SystemExit(f"unknown peer {peer!r}: swift, swift-rlhf or llamafactory")


if __name__ == "__main__":
    main()
