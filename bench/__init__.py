"""Benchmarks and the measurements behind README's figures."""


def weight_mode(mode: str) -> tuple[str, int]:
    """A bench's weight mode as (--quantization, --quant-activation-bits): "int4a8" and
    "int8a8" are int4 and int8 with 8-bit activations, any other mode keeps 16."""
    if mode in ("int4a8", "int8a8"):
        return mode[:4], 8
    return mode, 16
