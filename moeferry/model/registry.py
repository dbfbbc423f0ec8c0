"""HF architecture string -> spec parser."""
from __future__ import annotations

from moeferry.checkpoint.reader import CheckpointError, CheckpointReader
from moeferry.model.spec import ModelSpec, parse_qwen3_5_moe, parse_qwen3_moe

ARCHITECTURES = {
    "Qwen3MoeForCausalLM": parse_qwen3_moe,
    "Qwen3_5MoeForCausalLM": parse_qwen3_5_moe,
    "Qwen3_5MoeForConditionalGeneration": parse_qwen3_5_moe,
}


def resolve_spec(reader: CheckpointReader) -> ModelSpec:
    archs = reader.config.get("architectures") or []
    arch = next((a for a in archs if a in ARCHITECTURES), None)
    if arch is None:
        raise CheckpointError(
            f"unsupported architecture {archs or '(none in config.json)'}; supported: {', '.join(ARCHITECTURES)}"
        )
    text = reader.text_config
    if "tie_word_embeddings" not in text and "tie_word_embeddings" in reader.config:
        text["tie_word_embeddings"] = reader.config["tie_word_embeddings"]
    try:
        return ARCHITECTURES[arch](arch, text, reader.generation_config)
    except KeyError as e:
        raise CheckpointError(f"config.json of {reader.dir} lacks {e} needed by {arch}") from None
