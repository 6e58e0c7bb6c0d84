"""Method names (kt-kernel's) and the packed formats they select."""

# kt-kernel method name -> packed format of the native kernels (zero_point=False).
METHOD_FORMATS: dict[str, str] = {
    "BF16": "bf16",
    "AMXINT8": "int8",
    "MOE_INT8": "int8",
    "AMXINT4": "int4",
    "MOE_INT4": "int4",
    "LLAMAFILE": "gguf",
}

# Formats quantized in k-groups (they take group_size and zero_point).
GROUPED_FORMATS = ("int4", "int4_asym")
GROUP_SIZES = (32, 64, 128)
DEFAULT_GROUP_SIZE = 128


def format_for_method(method: str, zero_point: bool = False) -> str:
    """The packed format for a kt-kernel method name, e.g. ``"AMXINT8" -> "int8"``;
    ``zero_point=True`` selects the asymmetric INT4 format (``"int4_asym"``).

    Raises ``ValueError`` naming the methods that exist when ``method`` is unknown, or
    when ``zero_point`` is asked of a method without groups.
    """
    if not isinstance(method, str):
        raise TypeError(f"method must be a str, got {type(method).__name__}")
    try:
        fmt = METHOD_FORMATS[method.upper()]
    except KeyError:
        raise ValueError(
            f"method {method!r} is not available; implemented: {', '.join(METHOD_FORMATS)}"
        ) from None
    if zero_point:
        if fmt != "int4":
            raise ValueError(f"zero_point applies to the INT4 methods, not {method!r}")
        return "int4_asym"
    return fmt
