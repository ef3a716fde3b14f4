"""llama.cpp's own converter (convert_hf_to_gguf.py), run on several folders in one process.

    python tests/llama_convert.py LLAMA_CPP_DIR MODEL_DIR:OUTTYPE:OUTFILE ...

One process for all the conversions: importing torch and transformers is most of a tiny
model's conversion time. It runs in a process of its own because the converter puts its
vendored gguf-py first on the import path, which must not replace the installed one in the
tests' process.

A byte-level BPE trained in a test has a pre-tokenizer hash the converter does not know (it
names only published vocabularies); such a vocabulary is written as Qwen2's pre-tokenizer,
the one it was trained with. A known hash keeps the converter's own answer.
"""

from __future__ import annotations

import sys
from pathlib import Path


def main(argv: list[str]) -> None:
    root = Path(argv[0])
    sys.path[:0] = [str(root / "gguf-py"), str(root)]
    import convert_hf_to_gguf
    from conversion.base import TextModel

    known = TextModel.get_vocab_base_pre

    def pre_tokenizer(self: TextModel, tokenizer: object) -> str:
        try:
            return known(self, tokenizer)
        except NotImplementedError:
            return "qwen2"

    TextModel.get_vocab_base_pre = pre_tokenizer  # type: ignore[method-assign]
    for job in argv[1:]:
        model, outtype, outfile = job.split(":", 2)
        sys.argv = ["convert_hf_to_gguf.py", model, "--outtype", outtype, "--outfile", outfile]
        convert_hf_to_gguf.main()


if __name__ == "__main__":
    main(sys.argv[1:])
