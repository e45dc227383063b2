"""llama.cpp's HF -> GGUF converter, run as a child process, with the one override the converter lacks: the BPE
pre-tokenizer name (``model.gguf_pre_tokenizer``) for a fine-tuned model whose tokenizer the converter does not
recognise by its hash. Usage: python -m pipeline.quantizers.gguf_convert SRC PRE -- CONVERTER-ARGS...

The wrapper also prints, on stderr, the Unix time at which the converter opened its output (imports and the
model's config read), began writing its tensors (the vocabulary and metadata gathered) and finished them
(``PHASE_MARK`` lines, read back by ``conversion_phases``): the planner carries each part by what it grows with.

Also: the names the converter can write (``known_pre_tokenizers``) and the converter's failure text read into a
named cause with the override that gets past it (``conversion_failure``). A leaf module (no project imports).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path


def known_pre_tokenizers(src: Path) -> list[str]:
    """Every pre-tokenizer name the vendored converter writes (its ``res = "..."`` lines)."""
    text = (Path(src) / "conversion" / "base.py").read_text(encoding="utf-8", errors="replace")
    return sorted(set(re.findall(r'^\s*res = "([^"]+)"', text, flags=re.M)))


def _last_error(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    errors = [ln for ln in lines if re.match(r"^[\w.]*(Error|Exception)\b.*:", ln)]
    return (errors or lines or ["no output"])[-1][:400]


def conversion_failure(text: str, returncode: int) -> str:
    """Why the converter failed, in words a user can act on: its own last error line, the cause it names, and
    the override that gets past it where one exists."""
    last = _last_error(text)
    if "BPE pre-tokenizer was not recognized" in text:
        chk = re.search(r"chkhsh:\s*([0-9a-f]{64})", text)
        return ("llama.cpp's converter does not recognise this tokenizer's BPE pre-tokenizer (it identifies one by "
                f"a hash of its output{', chkhsh ' + chk.group(1)[:16] + '…' if chk else ''}; usual for a fine-tuned "
                "model whose tokenizer.json was re-saved): set model.gguf_pre_tokenizer to the pre-tokenizer of the "
                "model it was fine-tuned from (llama-bpe for Llama 3, qwen2 for Qwen 2.5, smollm for SmolLM2, …); "
                "the tokenizer parity check then reports whether the GGUF tokenizer agrees. Converter: " + last)
    if re.search(r"tokenizer\.model", text) and re.search(r"Missing|No such file|not found|FileNotFoundError", text):
        return ("llama.cpp's converter needs a SentencePiece tokenizer.model for this architecture and the folder "
                "has none (only tokenizer.json): add the base model's tokenizer.model. Converter: " + last)
    if re.search(r"Architecture .* not supported|Model .* is not supported", text):
        line = next((ln.strip() for ln in text.splitlines()
                     if re.search(r"Architecture .* not supported|Model .* is not supported", ln)), last)
        return f"llama.cpp's converter does not support this architecture: {line[:300]}"
    return f"llama.cpp's converter failed (exit {returncode}): {last}"


PHASE_MARK = "quantdrift-conversion-phase"
# the converter's phases, in order, each ending at its mark: the start (an interpreter importing torch, the
# converter and gguf-py, the model's config read), the vocabulary and metadata, the tensors read and written
PHASES = ("start", "vocabulary", "tensors")


def conversion_phases(text: str, started: float, ended: float) -> dict | None:
    """Seconds of each phase of one conversion (``PHASES``, then ``exit``: the interpreter's exit after the last
    tensor) from the marks in its stderr ``text``, ``started`` and ``ended`` the parent's Unix times around the
    child; None without every mark (a converter that writes otherwise)."""
    marks = dict(re.findall(rf"^{PHASE_MARK} (\w+) ([0-9.]+)$", text, flags=re.M))
    if not all(name in marks for name in PHASES):
        return None
    times = [started, *(float(marks[name]) for name in PHASES), ended]
    return {name: round(max(0.0, b - a), 3) for name, a, b in zip((*PHASES, "exit"), times, times[1:])}


def _mark_phases() -> None:
    """Print a ``PHASE_MARK`` line when the converter opens its GGUF writer and when it writes the tensors."""
    import time

    import gguf

    def mark(name: str) -> None:
        print(f"{PHASE_MARK} {name} {time.time():.3f}", file=sys.stderr, flush=True)

    writer = gguf.GGUFWriter
    init, write = writer.__init__, writer.write_tensors_to_file

    def opened(self, *args, **kwargs):
        mark("start")
        return init(self, *args, **kwargs)

    def tensors(self, *args, **kwargs):
        mark("vocabulary")
        out = write(self, *args, **kwargs)
        mark("tensors")
        return out

    writer.__init__, writer.write_tensors_to_file = opened, tensors


def main(argv: list[str]) -> None:
    import runpy

    src, pre = Path(argv[0]), argv[1]
    rest = argv[3:] if len(argv) > 2 and argv[2] == "--" else argv[2:]
    sys.path[:0] = [str(src / "gguf-py"), str(src)]
    _mark_phases()
    if pre:
        from conversion.base import TextModel       # the vendored converter's own package

        def fixed(self, tokenizer) -> str:           # noqa: ARG001  (the converter's signature)
            return pre

        TextModel.get_vocab_base_pre = fixed
    sys.argv = [str(src / "convert_hf_to_gguf.py"), *rest]
    runpy.run_path(str(src / "convert_hf_to_gguf.py"), run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
