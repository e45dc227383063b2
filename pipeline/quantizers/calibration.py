"""Calibration text for every quantizer that needs one (GPTQ/AWQ through GPTQModel, llama.cpp's importance
matrix): business prose kept apart from every scored evaluation turn (prompts/calibration.jsonl), or a
`datasets` source where the network allows."""

from __future__ import annotations

from pathlib import Path

from pipeline.infra.errors import ConfigError

PROJECT_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_CALIBRATION = {"path": str(PROJECT_ROOT / "prompts" / "calibration.jsonl"), "field": "text",
                       "samples": 64, "seq_len": 256}
CALIBRATION_KEYS = ("path", "dataset", "config", "split", "field", "samples", "seq_len")


def check_calibration(calibration: dict | None) -> None:
    """variant.quantize.calibration: known keys only, positive sample count and sequence length."""
    from pipeline.config.settings import one_of, positive_int

    for k, v in (calibration or {}).items():
        one_of("variant.quantize.calibration", k, CALIBRATION_KEYS)
        if k in ("samples", "seq_len"):
            positive_int(f"variant.quantize.calibration.{k}", v)


def check_group_size(group_size) -> None:
    from pipeline.config.settings import require

    require(group_size == "auto" or (isinstance(group_size, int) and not isinstance(group_size, bool)
                                     and group_size > 0),
            "variant.quantize.group_size", group_size, "auto or a positive integer")


def calibration_texts(spec: dict) -> list[str]:
    """Every text of the calibration source ``spec`` ({path | dataset, config, split, field}), in order."""
    field = spec.get("field", "text")
    if spec.get("dataset"):
        from datasets import load_dataset

        try:
            ds = load_dataset(spec["dataset"], spec.get("config"), split=spec.get("split", "train"))
        except Exception as exc:
            raise ConfigError(f"calibration.dataset={spec['dataset']!r} could not be loaded ({exc}); offline, "
                              "point calibration.path at a local JSONL file") from None
        texts = [r[field] for r in ds if isinstance(r.get(field), str) and r[field].strip()]
    else:
        path = Path(spec.get("path") or DEFAULT_CALIBRATION["path"])
        if not path.is_file():
            raise ConfigError(f"calibration.path={str(path)!r} does not exist: expected a JSONL file with a "
                              f"'{field}' field per line")
        from pipeline.suites.records import iter_jsonl

        texts = []
        for lineno, row in iter_jsonl(path):
            if not isinstance(row, dict) or not isinstance(row.get(field), str):
                raise ConfigError(f"{path}:{lineno}: field '{field}': expected a string")
            texts.append(row[field])
    if not texts:
        raise ConfigError(f"calibration source {spec} holds no texts")
    return texts


def calibration_key(spec: dict) -> dict:
    """``spec`` plus the content hash of the texts a local file contributes (its first ``samples`` texts when the
    spec has a sample count, else all), so an edited text rebuilds what used it and appending texts beyond those
    used rebuilds nothing. A path inside the project is recorded relative to it, so clones share keys."""
    from pipeline.infra.files import stable_hash

    key = dict(spec)
    path = Path(spec["path"]) if spec.get("path") else None
    if path is not None and path.is_file():
        texts = calibration_texts(spec)
        key["sha"] = stable_hash(texts[: spec["samples"]] if spec.get("samples") else texts)
        if path.resolve().is_relative_to(PROJECT_ROOT):
            key["path"] = str(path.resolve().relative_to(PROJECT_ROOT))
    return key
