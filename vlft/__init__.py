"""vlft: LoRA fine-tuning experiments on Qwen-VL models, as a Snakemake workflow."""

import logging

# The release, read by the workflow (workflow/Snakefile) from its own copy of this file to check that
# the installed package is the same release, and by pyproject.toml as the package's version.
__version__ = "0.1.0"

# bitsandbytes (for quantization_bit: 4; PEFT imports it wherever it is installed) warns at import,
# on CPUs with AVX512-BF16, that it could not fetch a faster CPU kernel from the Hugging Face Hub,
# and then uses its own: in every job's log, a line that reads like a failure and is none. Its
# errors still show.
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
