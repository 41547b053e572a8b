"""Published dataset formats brought to our records (vlft.data.records): one JSONL per split, and the
images they name, so that nothing downstream knows the formats' shapes. One module per family:
kvasir (Kvasir-VQA, Kvasir-VQA-x1), chat (LLaMA-Factory, ms-swift, LLaVA; their preference pairs
too), screenspot (v1, v2, Pro, the Hub mirror), pairs (flat preference pairs as RLAIF-V publishes them),
flat (one image, question and answer a row, as SLAKE, VQA-RAD, PathVQA and LLaVA-Med publish them,
and RL datasets' problem / solution rows); targets (an answer that is a place on the image: box
solutions and click actions, read by flat and screenspot).

Each importer writes its outputs whole or not at all. A row it cannot import is refused with the
file, the row and the reason, and every refused row is named at once (the first few in the
message, all of them in `<out>.refused.jsonl`); `skip_bad_rows` imports the others and writes that
list all the same (vlft.data.importers.common.Refusals). What it leaves out on purpose (rows without
an answer or an image, video, audio) is counted in the summary it returns under its own name, and
so are refused rows and ids given to rows that shared one."""

from vlft.data.importers.chat import import_chat
from vlft.data.importers.flat import import_flat_vqa
from vlft.data.importers.kvasir import import_kvasir_vqa, import_kvasir_vqa_x1, question_type, split_of
from vlft.data.importers.pairs import import_pairs
from vlft.data.importers.screenspot import import_screenspot

__all__ = [
    "import_chat",
    "import_flat_vqa",
    "import_kvasir_vqa",
    "import_kvasir_vqa_x1",
    "import_pairs",
    "import_screenspot",
    "question_type",
    "split_of",
]
