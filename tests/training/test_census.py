"""What a stage trained, by part of the model (vlft.training.census): an ordinary stage's adapter
changed and nothing else did; the peers' two silent failures, made here, are each one sentence in the
summary and one line in red in the report."""

from __future__ import annotations

import json

import torch

import vlft.training.train as train_module
from vlft.report.page import trained_parts_html
from vlft.report.study import StageResult
from vlft.training.census import checksum, part_of


def trained(small_stage, out, steps=2, **options):
    inputs, settings = small_stage
    settings = settings | options | {"max_steps": steps, "micro_batch": 4, "warmup_ratio": 0.0, "learning_rate": 1e-3}
    train_module.train_stage(inputs, settings, out / "adapter", out / "log.jsonl", out / "summary.json", out / "c", 100)
    summary = json.loads((out / "summary.json").read_text())
    page = trained_parts_html([StageResult("exp", "main", summary, [])])
    return summary, page


def part_left_trainable(monkeypatch, part: str, trainable: bool) -> None:
    """The stage's model set up as usual, then one part's parameters made trainable or frozen, as
    a mistake in later code would."""
    setup_model = train_module._setup_model

    def altered(*args, **kwargs):
        model = setup_model(*args, **kwargs)
        for name, param in model.named_parameters():
            if part_of(name) == part:
                param.requires_grad_(trainable)
        return model

    monkeypatch.setattr(train_module, "_setup_model", altered)


def test_an_ordinary_stage_changed_its_adapter_and_nothing_else(small_stage, tmp_path):
    summary, page = trained(small_stage, tmp_path)
    parts = summary["trained_parts"]
    assert set(parts) == {"language model", "vision tower", "merger", "LoRA adapter"}  # no vision LoRA adapter
    assert parts["LoRA adapter"]["trained"] and parts["LoRA adapter"]["changed"] > 0
    for frozen in ("language model", "vision tower", "merger"):
        assert parts[frozen] == {"changed": 0, "unchanged": parts[frozen]["unchanged"], "trained": False}
        assert parts[frozen]["unchanged"] > 0
    assert summary["trained_parts_problems"] == []
    assert "<h2>What trained</h2>" in page and 'class="problem"' not in page
    assert "vision LoRA adapter" not in page  # a part no stage has is no column


def test_a_merger_trained_while_the_tower_was_frozen_is_one_line_in_red(small_stage, tmp_path, monkeypatch):
    """LLaMA-Factory PR #9399: Qwen3-VL's mergers (DeepStack's among them) took gradients while the
    vision tower was frozen. Made here by the same mistake: the mergers' parameters left trainable."""
    part_left_trainable(monkeypatch, "merger", True)
    summary, page = trained(small_stage, tmp_path)
    merger = summary["trained_parts"]["merger"]
    assert merger["changed"] > 0 and not merger["trained"]
    said = f"the merger was frozen, yet {merger['changed']} of its {merger['changed'] + merger['unchanged']} tensors changed"
    assert summary["trained_parts_problems"] == [said]
    assert f'<p class="problem">exp/main: {said}.</p>' in page


def test_a_trained_part_whose_weights_never_changed_is_one_line_in_red(small_stage, tmp_path, monkeypatch):
    """2U1/Qwen-VL-Series-Finetune#115: a part meant to train whose weights never changed. Made here
    by an optimizer that steps none of them (as one built before the part was made trainable)."""
    monkeypatch.setattr(torch.optim.AdamW, "step", lambda self, closure=None: None)
    summary, page = trained(small_stage, tmp_path)
    adapter = summary["trained_parts"]["LoRA adapter"]
    said = f"the LoRA adapter was trained, yet none of its {adapter['unchanged']} tensors changed"
    assert adapter["changed"] == 0 and summary["trained_parts_problems"] == [said]
    assert f'<p class="problem">exp/main: {said}.</p>' in page


def test_a_stage_that_trains_the_tower_changed_its_lora_and_its_mergers_copies_and_nothing_else(small_stage, tmp_path):
    """vision_lora and train_merger: the tower's LoRA and PEFT's trained copy of each merger
    changed (the originals, kept for the adapter switched off, did not); the base stayed as it was."""
    summary, page = trained(small_stage, tmp_path, vision_lora=True, train_merger=True)
    parts = summary["trained_parts"]
    assert parts["vision LoRA adapter"]["trained"] and parts["vision LoRA adapter"]["unchanged"] == 0
    assert parts["merger"]["trained"] and parts["merger"]["changed"] == parts["merger"]["unchanged"] > 0
    for frozen in ("language model", "vision tower"):
        assert parts[frozen]["changed"] == 0 and not parts[frozen]["trained"]
    assert summary["trained_parts_problems"] == [] and 'class="problem"' not in page
    assert "vision LoRA adapter" in page
    # The adapter holds what trained: the tower's LoRA and the mergers' weights, which a later
    # stage or the evaluation loads with it.
    adapter = json.loads((tmp_path / "adapter/adapter_config.json").read_text())
    assert "visual" in adapter["target_modules"] and any("merger" in m for m in adapter["modules_to_save"])


def test_a_tower_unfrozen_whose_lora_never_changed_is_one_line_in_red(small_stage, tmp_path, monkeypatch):
    """2U1/Qwen-VL-Series-Finetune#115 as it happened there: the tower set to train, and frozen
    again by later code before the optimizer was built; its LoRA's weights never changed."""
    part_left_trainable(monkeypatch, "vision LoRA adapter", False)
    summary, page = trained(small_stage, tmp_path, vision_lora=True)
    tower = summary["trained_parts"]["vision LoRA adapter"]
    said = f"the vision LoRA adapter was trained, yet none of its {tower['unchanged']} tensors changed"
    assert tower["changed"] == 0 and summary["trained_parts_problems"] == [said]
    assert f'<p class="problem">exp/main: {said}.</p>' in page


def test_a_checksum_sees_any_one_value_change_and_reads_every_dtype():
    for dtype in (torch.float32, torch.bfloat16, torch.float64, torch.uint8):
        tensor = torch.arange(1000).to(dtype)
        before = checksum(tensor)
        tensor[5] += 1  # exact in every dtype here
        assert checksum(tensor) != before, dtype
    assert part_of("base_model.model.model.visual.deepstack_merger_list.0.linear_fc1.weight") == "merger"
    assert part_of("model.visual.blocks.0.attn.qkv.lora_A.default.weight") == "vision LoRA adapter"
    assert part_of("model.language_model.layers.0.mlp.up_proj.lora_B.default.weight") == "LoRA adapter"
    assert part_of("model.visual.blocks.0.attn.qkv.weight") == "vision tower"
    assert part_of("model.language_model.layers.0.mlp.up_proj.weight") == "language model"
