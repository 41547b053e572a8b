"""Loading a Qwen-VL checkpoint (or the tiny demo one) and attaching LoRA adapters to its language model."""

from __future__ import annotations

import importlib.util
import inspect
import json
import os
import re
import socket
from contextlib import nullcontext
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from peft.tuners.tuners_utils import BaseTunerLayer
from peft.utils import ModulesToSaveWrapper
from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

from vlft.errors import ConfigError, DeviceError, InputError
from vlft.integrity import verify_adapter
from vlft.model_files import require_model_dir


def cuda_problem() -> str | None:
    """Why CUDA cannot be used here, in CUDA's own words where it gives any; None where it can."""
    if torch.version.cuda is None:
        return f"this torch ({torch.__version__}) is built without CUDA"
    if torch.cuda.is_available():
        return None
    try:
        torch.cuda.init()  # raises with the driver's reason: no driver, one too old, a failed start
    except Exception as err:  # noqa: BLE001 - whatever CUDA raised, its words are the message
        return " ".join(str(err).split())
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return "no CUDA device is visible" + (f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else "")


def require_gpus(count: int, cpu_fallback: bool) -> None:
    """A job that asked for `count` GPUs fails at once where CUDA is not usable, rather than running
    on the CPU unnoticed (an 8B stage for days). With the config's `cpu_fallback` (the demo's) it
    says so in one line and runs on the CPU."""
    if count < 1 or (problem := cuda_problem()) is None:
        return
    where = f"host {socket.gethostname()}"
    if not cpu_fallback:
        raise DeviceError(
            f"{where}: this job asked for {count} GPU(s), but CUDA is not usable: {problem}; "
            "to run on the CPU, set `cpu_fallback: true` in the config (every job that asks for a GPU "
            "runs without one), or set to 0 each key that asks for one: `resources.gpus` of the stage "
            "or of `defaults` (training and vision caches) and `evaluation.resources.gpus` (evaluations)"
        )
    if os.environ.get("RANK") in (None, "0"):
        print(f"{where}: no usable GPU ({problem}): running on the CPU, as cpu_fallback allows", flush=True)


def pick_device(dtype: torch.dtype | None = None) -> tuple[torch.device, torch.dtype]:
    """bf16 on a GPU that supports it, fp32 elsewhere (`dtype`, where given, instead); TF32 for
    whatever matmuls stay in fp32."""
    if torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        default = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
        # The GPU this process was given: device 0 of its own, or its LOCAL_RANK's in a data-parallel job.
        return torch.device("cuda", torch.cuda.current_device()), dtype or default
    return torch.device("cpu"), dtype or torch.float32


def attention_implementation(device: torch.device) -> str:
    if device.type == "cuda" and importlib.util.find_spec("flash_attn") is not None:
        return "flash_attention_2"
    return "sdpa"


# Kept in the model's dtype in a 4-bit base: the vision tower (its cached outputs are computed by the
# tower in that dtype) and the output layer, as QLoRA keeps it. Module names from the model's root:
# the tower is model.visual in transformers' current Qwen-VL classes, visual in older ones.
NOT_QUANTIZED = ["model.visual", "visual", "lm_head"]


def load_base_model(
    model_dir: str | Path,
    device: torch.device,
    dtype: torch.dtype,
    trust_remote_code: bool = False,
    quantization_bit: int | None = None,
):
    """The base model with every weight frozen; only adapters added later train. `quantization_bit`
    4: the language model's linear layers in 4-bit NF4 (bitsandbytes, double-quantized, computing in
    `dtype`), QLoRA's base: about a quarter of the memory of its weights."""
    require_model_dir(model_dir)
    quantized = {}
    if quantization_bit == 4:
        from transformers import BitsAndBytesConfig

        config = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=dtype,
            llm_int8_skip_modules=NOT_QUANTIZED,
        )
        quantized = {"quantization_config": config, "device_map": {"": device}}
    # An MoE's experts computed one by one in float64 (the tests' dtype): torch's grouped matmul,
    # transformers' default, has no float64 kernel.
    experts = {"experts_implementation": "eager"} if dtype == torch.float64 else {}
    model = AutoModelForImageTextToText.from_pretrained(
        model_dir,
        dtype=dtype,
        attn_implementation=attention_implementation(device),
        trust_remote_code=trust_remote_code,
        **quantized,
        **experts,
    )
    model.requires_grad_(False)
    return model if quantized else model.to(device)


def unwrapped(model):
    """The Qwen-VL model itself, whether or not PEFT wraps it."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def rope_index(model):
    """The model's M-RoPE position function (text and image token positions from the ids and the
    image grids), for collate to run on the host."""
    return unwrapped(model).model.get_rope_index


def load_tokenizer(model_dir: str | Path, trust_remote_code: bool = False):
    require_model_dir(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    if tokenizer.chat_template is None:
        # Some checkpoints keep the chat template with the processor only: as a Jinja file, or in
        # chat_template.json ({"chat_template": "..."}) as earlier processors saved it.
        jinja, as_json = Path(model_dir) / "chat_template.jinja", Path(model_dir) / "chat_template.json"
        if jinja.exists():
            tokenizer.chat_template = jinja.read_text()
        elif as_json.exists():
            tokenizer.chat_template = json.loads(as_json.read_text())["chat_template"]
        else:
            raise InputError(
                model_dir, "has no chat template (in tokenizer_config.json, chat_template.jinja or chat_template.json)"
            )
    return tokenizer


def load_image_processor(model_dir: str | Path, trust_remote_code: bool = False):
    require_model_dir(model_dir)
    return AutoImageProcessor.from_pretrained(model_dir, trust_remote_code=trust_remote_code)


# The linear layers of a vision tower's blocks, in each family's names: attention's qkv and proj;
# the MLP's fc1/fc2 (Qwen2-VL), gate/up/down projections (Qwen2.5-VL), linear_fc1/linear_fc2
# (Qwen3-VL, Qwen3.5). Not the patch embedding (a convolution) nor the merger (`train_merger`).
VISION_BLOCK_LINEARS = r"attn\.(qkv|proj)|mlp\.(fc1|fc2|gate_proj|up_proj|down_proj|linear_fc1|linear_fc2)"


def merger_modules(model) -> list[str]:
    """The merger and Qwen3-VL's DeepStack mergers, by their names in the model: each trained in
    full as a module of its own (the DeepStack ones are called one by one from their list)."""
    return [
        name
        for name, _ in unwrapped(model).named_modules()
        if re.search(r"visual\.(merger|deepstack_merger_list\.\d+)$", name)
    ]


def lora_config(settings, model=None) -> LoraConfig:
    """LoRA on the language model's `lora_target_modules`, and on the vision tower's blocks with
    `vision_lora` (a pattern: Qwen2.5-VL's vision MLP also has gate/up/down projections, which the
    language model's names alone would reach); the mergers of `model` trained in full with
    `train_merger`."""
    modules = "|".join(settings["lora_target_modules"])
    pattern = rf".*language_model.*\.({modules})"
    if settings["vision_lora"]:
        pattern = rf"({pattern})|(.*visual\.blocks\.\d+\.({VISION_BLOCK_LINEARS}))"
    return LoraConfig(
        r=settings["lora_r"],
        lora_alpha=settings["lora_alpha"],
        lora_dropout=settings["lora_dropout"],
        target_modules=pattern,
        target_parameters=expert_weights(settings, model),
        modules_to_save=merger_modules(model) if settings["train_merger"] else None,
        task_type="CAUSAL_LM",
    )


# A mixture of experts holds each projection of all its experts in one 3D weight (transformers'
# Qwen3-VL-MoE: gate and up fused in gate_up_proj), no module of each projection's name: LoRA reaches
# them through PEFT's target_parameters, a low-rank pair an expert, where the stage's
# lora_target_modules name the MLP's projections (as the peers put LoRA on every linear weight).
EXPERT_WEIGHTS = {"gate_proj": "gate_up_proj", "up_proj": "gate_up_proj", "down_proj": "down_proj"}


def expert_weights(settings, model) -> list[str] | None:
    """The experts' weights the stage's LoRA reaches (PEFT's target_parameters), or None for a dense model."""
    if model is None or not any(name.endswith("mlp.experts.gate_up_proj") for name, _ in model.named_parameters()):
        return None
    weights = sorted(
        {f"mlp.experts.{EXPERT_WEIGHTS[m]}" for m in settings["lora_target_modules"] if m in EXPERT_WEIGHTS}
    )
    if weights and settings["lora_dropout"]:
        raise ConfigError(
            f"lora_dropout: {settings['lora_dropout']} on a mixture of experts whose lora_target_modules name the "
            "MLP's projections: PEFT's LoRA on the experts' weights takes no dropout; give lora_dropout: 0, or "
            "lora_target_modules without gate_proj, up_proj and down_proj (attention's alone)"
        )
    return weights or None


def with_new_adapter(model, settings):
    return trained_copies_in_float32(get_peft_model(model, lora_config(settings, model)))


def trained_copies_in_float32(model):
    """The modules PEFT trains in full (modules_to_save: the merger) copied in the model's dtype,
    upcast to float32 as PEFT keeps the adapter's own weights: in bf16 most of an AdamW step's
    change to a weight rounds away. They compute in the model's dtype under adapter_autocast, and
    answer in it (vlft.training.step_evals.adapter_in_model_dtype), as the adapter does."""
    for module in model.modules():
        if isinstance(module, ModulesToSaveWrapper):
            for param in module.modules_to_save.parameters():
                if param.dtype in (torch.bfloat16, torch.float16):
                    param.data = param.data.float()
    return model


def with_adapter(model, adapter_dir: str | Path, trainable: bool):
    """A trained stage's adapter on the model, its files checked against its summary's checksums."""
    verify_adapter(adapter_dir)
    model = PeftModel.from_pretrained(model, str(adapter_dir), is_trainable=trainable)
    return trained_copies_in_float32(model) if trainable else model


def use_activation_checkpointing(model) -> None:
    """Recompute each decoder layer's activations in the backward pass instead of keeping them
    (transformers' own gradient checkpointing, non-reentrant: the frozen base's inputs need no
    gradient for the LoRA weights' to flow)."""
    unwrapped(model).model.language_model.gradient_checkpointing_enable({"use_reentrant": False})


def adapter_autocast(model, device: torch.device, dtype: torch.dtype):
    """The context for training forward passes: LoRA computed in the base model's dtype.

    PEFT keeps adapter weights in float32, for the optimizer, and by default casts every input of a
    LoRA layer to float32 first: a float32 copy of each activation, kept for the backward pass, and
    float32 matmuls. Under autocast the float32 weights are used in bf16 instead and the inputs
    stay as they are, the way transformers' Trainer runs LoRA with bf16=True; gradients and
    optimizer state stay float32. A float32 or float64 model needs none of this.
    """
    if dtype in (torch.float32, torch.float64):
        return nullcontext()
    for module in model.modules():
        if isinstance(module, BaseTunerLayer):
            module.cast_input_dtype_enabled = False
    return torch.autocast(device.type, dtype=dtype)


def cache_keyword(module) -> str:
    """The name `module`'s forward takes the KV cache by: `cache` in newer transformers releases,
    `past_key_values` in older ones (the newer ones take the old name too, with a warning a job)."""
    return "cache" if "cache" in inspect.signature(module.forward).parameters else "past_key_values"


def output_cache(output):
    """A forward's KV cache, under either name (cache_keyword)."""
    return output["cache"] if "cache" in output else output["past_key_values"]


def language_model(model):
    """The decoder stack of a Qwen-VL model (its embeddings, layers and final norm)."""
    return model.model.language_model


def is_hybrid_model(model) -> bool:
    """Whether the model's language layers include linear-attention ones (Qwen3.5's Gated DeltaNet),
    whose rows carry a recurrent state and a convolution window besides attention keys."""
    return "linear_attention" in (getattr(language_model(unwrapped(model)).config, "layer_types", None) or ())


def head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def compile_decoder_layers(model, backend: str = "inductor") -> None:
    """torch.compile each decoder layer of the language model: fused elementwise work around the
    matmuls, one graph reused by every layer; dynamic shapes, as batch widths vary.

    Floats specialized: with dynamic shapes dynamo otherwise passes each Python float the layer
    reads (LoRA's scaling, the norms' epsilon) into the graph as a float64 tensor on the CPU, and
    inductor compiles a C++ kernel to convert it. Loading that kernel in a later job probes the
    CPU's vector instructions with a C++ compiler and a Python subprocess per instruction set: on
    the GPU machine most of each training job's warm compile (benchmarks/README.md). The
    floats are constants of the model, so specializing them costs no recompiles."""
    torch._dynamo.config.specialize_float = True
    for layer in unwrapped(model).model.language_model.layers:
        layer.compile(dynamic=True, backend=backend)
