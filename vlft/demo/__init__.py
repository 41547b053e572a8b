"""The built-in demo: a synthetic VQA dataset and a tiny Qwen3-VL, made locally, nothing downloaded."""
