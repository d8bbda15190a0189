"""Model geometry presets for KV-cache sizing: what one token of KV cache costs.

Only the attention geometry matters here: the number of decoder layers, the
number of KV heads (grouped-query attention: fewer KV heads than query heads)
and the head dimension, plus the bytes per element of the KV cache's dtype.

Sources: each preset is the model's Hugging Face ``config.json``:
``num_hidden_layers``, ``num_key_value_heads``, and ``head_dim`` (where the
config has no ``head_dim`` key it is ``hidden_size / num_attention_heads``).
The figures are given next to each preset below. ``dtype_bytes`` is 2 for all
presets (the configs' ``torch_dtype`` is ``bfloat16``; an fp16 cache costs the
same); an fp8 or fp32 cache is a ``dtype=`` override or a custom geometry.

``prefill_tokens_per_s_8gpu`` is a measured prefill throughput on 8 GPUs, when
one is known. No preset carries one: we have no measured figure we can cite, and
a guessed one would quietly decide every TTFT comparison. ``bench.ttft`` then
asks for ``--prefill-tps``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

DTYPE_BYTES: dict[str, int] = {"fp8": 1, "fp16": 2, "bf16": 2, "fp32": 4}
CUSTOM_KEYS = ("layers", "kv_heads", "head_dim", "dtype")


@dataclass(frozen=True)
class ModelGeometry:
    """The attention geometry of one model, as far as its KV cache goes."""

    name: str
    layers: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int = 2
    prefill_tokens_per_s_8gpu: float | None = None

    def __post_init__(self) -> None:
        for field_name in ("layers", "kv_heads", "head_dim", "dtype_bytes"):
            value = getattr(self, field_name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{self.name}: {field_name} must be a positive integer, got {value!r}")
        rate = self.prefill_tokens_per_s_8gpu
        if rate is not None and not (rate > 0 and rate != float("inf")):
            raise ValueError(f"{self.name}: prefill_tokens_per_s_8gpu must be positive and finite, got {rate!r}")

    @property
    def dtype_name(self) -> str:
        """A dtype name for this element size (2 bytes reads as fp16/bf16)."""
        return {1: "fp8", 2: "fp16/bf16", 4: "fp32"}.get(self.dtype_bytes, f"{self.dtype_bytes} B")

    def with_dtype(self, dtype: str) -> ModelGeometry:
        """The same geometry with a KV cache of another dtype (e.g. an fp8 cache)."""
        return dataclasses.replace(self, dtype_bytes=dtype_bytes(dtype))


PRESETS: tuple[ModelGeometry, ...] = (
    # meta-llama/Llama-3.1-8B config.json: num_hidden_layers 32, num_key_value_heads 8,
    # hidden_size 4096 / num_attention_heads 32 = head_dim 128.
    ModelGeometry("Llama-3.1-8B", layers=32, kv_heads=8, head_dim=128),
    # meta-llama/Llama-3.1-70B: num_hidden_layers 80, num_key_value_heads 8, 8192 / 64 = 128.
    ModelGeometry("Llama-3.1-70B", layers=80, kv_heads=8, head_dim=128),
    # meta-llama/Llama-3.1-405B: num_hidden_layers 126, num_key_value_heads 8, 16384 / 128 = 128.
    ModelGeometry("Llama-3.1-405B", layers=126, kv_heads=8, head_dim=128),
    # Qwen/Qwen2.5-7B: num_hidden_layers 28, num_key_value_heads 4, 3584 / 28 = 128.
    ModelGeometry("Qwen2.5-7B", layers=28, kv_heads=4, head_dim=128),
    # Qwen/Qwen2.5-72B: num_hidden_layers 80, num_key_value_heads 8, 8192 / 64 = 128.
    ModelGeometry("Qwen2.5-72B", layers=80, kv_heads=8, head_dim=128),
    # mistralai/Mixtral-8x7B-v0.1: num_hidden_layers 32, num_key_value_heads 8, 4096 / 32 = 128
    # (the experts are MLPs: attention, and so the KV cache, is that of one 7B model).
    ModelGeometry("Mixtral-8x7B", layers=32, kv_heads=8, head_dim=128),
)
_BY_NAME = {m.name.lower(): m for m in PRESETS}


def preset_names() -> list[str]:
    return [m.name for m in PRESETS]


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of a KV-cache dtype name: fp8, fp16, bf16 or fp32."""
    try:
        return DTYPE_BYTES[dtype.strip().lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}: expected one of {', '.join(DTYPE_BYTES)}") from None


def get_preset(name: str) -> ModelGeometry:
    """A preset by name, case-insensitively; a ValueError lists the valid names."""
    try:
        return _BY_NAME[name.strip().lower()]
    except KeyError:
        raise ValueError(
            f"unknown model {name!r}: expected one of {', '.join(preset_names())}, "
            "or a custom geometry 'layers=N,kv_heads=N,head_dim=N[,dtype=fp16|bf16|fp8|fp32]'"
        ) from None


def _positive_int(key: str, text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"custom geometry: {key}={text!r} is not an integer") from None
    if value < 1:
        raise ValueError(f"custom geometry: {key}={value} must be at least 1")
    return value


def parse_custom(spec: str) -> ModelGeometry:
    """A geometry from ``layers=..,kv_heads=..,head_dim=..[,dtype=fp16|bf16|fp8|fp32]``.

    A leading ``custom:`` is allowed. ``dtype`` defaults to fp16 (2 bytes).
    """
    body = spec.strip()
    if body.lower().startswith("custom:"):
        body = body[len("custom:") :]
    fields: dict[str, str] = {}
    for part in body.split(","):
        if not part.strip():
            continue
        key, sep, value = part.partition("=")
        key = key.strip().lower()
        if not sep or not value.strip():
            raise ValueError(f"custom geometry: {part.strip()!r} is not key=value")
        if key not in CUSTOM_KEYS:
            raise ValueError(f"custom geometry: unknown key {key!r}: expected {', '.join(CUSTOM_KEYS)}")
        if key in fields:
            raise ValueError(f"custom geometry: {key} given twice")
        fields[key] = value.strip()
    missing = [k for k in CUSTOM_KEYS[:3] if k not in fields]
    if missing:
        raise ValueError(f"custom geometry: missing {', '.join(missing)} (in {spec!r})")
    return ModelGeometry(
        name=f"custom({body.strip()})",
        layers=_positive_int("layers", fields["layers"]),
        kv_heads=_positive_int("kv_heads", fields["kv_heads"]),
        head_dim=_positive_int("head_dim", fields["head_dim"]),
        dtype_bytes=dtype_bytes(fields.get("dtype", "fp16")),
    )


def resolve_model(text: str) -> ModelGeometry:
    """A preset name, or a custom geometry when the text has a ``=``."""
    return parse_custom(text) if "=" in text else get_preset(text)
