"""Argument checks shared by the public entry points."""

from __future__ import annotations


def is_int(value: object) -> bool:
    """True for a Python ``int`` that is not a ``bool`` (``True`` is an ``int`` to
    ``isinstance``, but a count of ``True`` is a caller's mistake)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_real(value: object) -> bool:
    """True for a real number (``int``, ``float``, numpy scalars) that is neither a
    ``bool`` nor a string: ``True`` as a clamp limit, or ``"7"``, is a caller's mistake."""
    import numbers
    return isinstance(value, numbers.Real) and not isinstance(value, bool)
