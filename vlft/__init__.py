"""vlft: LoRA fine-tuning experiments on Qwen-VL models, as a Snakemake workflow."""
