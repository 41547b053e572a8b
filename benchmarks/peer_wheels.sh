#!/usr/bin/env bash
# Download, here, the wheels that benchmarks/peers.py installs on the GPU machine: ms-swift and
# LLaMA-Factory, each with the versions of transformers, peft, trl, datasets (and for LLaMA-Factory
# accelerate and tokenizers) that its own requirements pin, and each of its imports that the GPU
# machine lacks. They are benchmark tools, not project dependencies: each peer goes into a folder of
# its own there (`pip install --target`), put first on PYTHONPATH for that peer's run only.
#
#   echo /.whl-peers/ >> .git/info/exclude; bash benchmarks/peer_wheels.sh .whl-peers
#
# The GPU machine's python3 is 3.12 with torch 2.11, torchvision, torchaudio, transformers 5.17,
# tokenizers 0.23.2, accelerate 1.15, pyarrow, aiohttp, einops, sentencepiece, tiktoken, xxhash.
# About 40 MB in all (the device's carry limit is 64 MiB a call).
set -euo pipefail
dest=${1:-.whl-peers}
mkdir -p "$dest/common" "$dest/swift" "$dest/llamafactory" "$dest/ours"
plat=(--python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
      --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 --platform any)
get() {  # folder, packages...
  local dir=$1; shift
  for p in "$@"; do
    python3 -m pip download -q --no-deps --only-binary=:all: "${plat[@]}" -d "$dest/$dir" "$p" 2>&1 | grep -iE '^error' || true
  done
}
# Imported by both peers' training paths and absent on the GPU machine.
get common liger_kernel==0.8.5 dill==0.4.1 multiprocess==0.70.19 modelscope==1.40.2 modelscope_hub==0.5.1 \
  cryptography==46.0.3 cffi==2.0.0 pycparser==2.23 pydantic==2.14.3 pydantic-core==2.50.4 annotated-types==0.8.0 \
  typing-inspection==0.4.5 zstandard==0.25.0 json_repair==0.64.6 qwen-vl-utils==0.0.14
# ms-swift 4.6.0: transformers<5.20 (the machine's 5.17 serves), peft<0.21, trl<1.0, datasets<4.8.5.
get swift ms-swift==4.6.0 peft==0.20.0 trl==0.29.1 datasets==4.8.4 addict==2.4.0 attrdict==2.0.1 \
  binpacking==2.0.1 cpm-kernels==1.0.11 dacite==1.9.2 rouge==1.0.1 nltk==3.10.4 simplejson==3.20.2 msgspec==0.22.0
# LLaMA-Factory 0.9.5: transformers<=5.6.0 (with tokenizers<=0.23.0), peft<=0.18.1, trl<=0.24.0,
# datasets<=4.0.0, accelerate<=1.11.0.
get llamafactory llamafactory==0.9.5 transformers==5.6.0 tokenizers==0.22.2 peft==0.18.1 trl==0.24.0 \
  datasets==4.0.0 accelerate==1.11.0 omegaconf==2.4.0 fire==0.7.1 termcolor==3.3.0 tyro==0.8.14 \
  docstring-parser==0.18.0 shtab==1.13.0 typeguard==4.6.1 torchdata==0.11.0
# Ours, in the benchmark's own process: the project's imports the machine lacks (liger-kernel is in common).
get ours jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1
# antlr4-python3-runtime (omegaconf's parser) is published as source only: build its pure-Python wheel.
python3 -m pip wheel -q --no-deps antlr4-python3-runtime==4.9.3 -w "$dest/llamafactory" 2>&1 | grep -iE '^error' || true
ls "$dest"/* | grep -c whl | xargs echo "wheels in $dest:"
du -sh "$dest"
