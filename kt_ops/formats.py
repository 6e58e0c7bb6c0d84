"""Method names (kt-kernel's) and the packed formats they select."""

# kt-kernel method name -> packed format of the native kernels.
METHOD_FORMATS: dict[str, str] = {
    "BF16": "bf16",
}


def format_for_method(method: str) -> str:
    """The packed format for a kt-kernel method name, e.g. ``"BF16" -> "bf16"``.

    Raises ``ValueError`` naming the methods that exist when ``method`` is unknown or
    not implemented yet.
    """
    if not isinstance(method, str):
        raise TypeError(f"method must be a str, got {type(method).__name__}")
    try:
        return METHOD_FORMATS[method.upper()]
    except KeyError:
        raise ValueError(
            f"method {method!r} is not available; implemented: {', '.join(METHOD_FORMATS)}"
        ) from None
