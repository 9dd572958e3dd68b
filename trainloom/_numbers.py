"""The checks every numeric argument shares."""

from __future__ import annotations

import numbers


def is_real(value: object) -> bool:
    """Whether ``value`` is a real number (int, float, numpy scalar, Fraction...; not bool).

    A function rather than an inline ``isinstance``: narrowing a ``float``-annotated argument by
    ``numbers.Real`` makes mypy invent an intersection type, after which it cannot type the
    attributes of the class being built.
    """
    return not isinstance(value, bool) and isinstance(value, numbers.Real)


def is_integral(value: object) -> bool:
    """Whether ``value`` is an integer (int, numpy integer...; not bool), as :func:`is_real`."""
    return not isinstance(value, bool) and isinstance(value, numbers.Integral)
