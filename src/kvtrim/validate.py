"""Checks of user-given values, one place: each raises ``KVTrimError`` saying what was wrong and
what is allowed. ``bool`` is never accepted as a number (``True`` is an ``int`` in Python).

Each check returns the value (converted where it says so), so it reads as an assignment::

    self.window = validate.integer(self.window, "snapkv: window", minimum=1)
"""

from __future__ import annotations

import math

from kvtrim.errors import KVTrimError

#: the bit widths a KV cache's ``kv_bits`` takes (16: the model's dtype); here, below every layer that
#: checks them (the cache, eval lines, calibration points), without importing torch
KV_BITS = (16, 8, 4, 2)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    """An ``int`` or ``float`` (not ``bool``) that a float can hold: an int beyond about 1.8e308 is not."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        float(value)
    except OverflowError:
        return False
    return True


def integer(value, what: str, *, minimum: int | None = None, maximum: int | None = None, unit: str | None = None) -> int:
    """An ``int`` (not ``bool``) within ``[minimum, maximum]`` where given.

    ``unit`` names what is counted in the message ("a positive number of tokens").
    """
    if not _is_int(value) or (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        raise KVTrimError(f"{what} must be {_int_range(minimum, maximum, unit)}, got {value!r}")
    return int(value)


def odd_integer(value, what: str) -> int:
    """A positive odd ``int`` (a pooling kernel's width, centred on its token)."""
    if not _is_int(value) or value < 1 or value % 2 == 0:
        raise KVTrimError(f"{what} must be a positive odd integer, got {value!r}")
    return int(value)


def optional_integer(value, what: str, *, minimum: int | None = None, maximum: int | None = None,
                     unit: str | None = None) -> int | None:
    """``None``, or an integer as :func:`integer` checks it."""
    return None if value is None else integer(value, what, minimum=minimum, maximum=maximum, unit=unit)


def number(value, what: str, *, minimum: float | None = None, maximum: float | None = None,
           min_open: bool = False, max_open: bool = False, finite: bool = True) -> float:
    """A real number (``int`` or ``float``, not ``bool``, not NaN) within the given bounds; returns a ``float``.

    ``min_open``/``max_open`` exclude the bound itself; ``finite=False`` admits infinities.
    """
    ok = _is_number(value) and not math.isnan(float(value)) and (not finite or math.isfinite(float(value)))
    if ok and minimum is not None:
        ok = float(value) > minimum if min_open else float(value) >= minimum
    if ok and maximum is not None:
        ok = float(value) < maximum if max_open else float(value) <= maximum
    if not ok:
        raise KVTrimError(f"{what} must be {_num_range(minimum, maximum, min_open, max_open, finite)}, got {value!r}")
    return float(value)


def fraction(value, what: str, *, allow_zero: bool = False) -> float:
    """A fraction in ``(0, 1]`` (``[0, 1]`` with ``allow_zero``)."""
    if not _is_number(value) or not (0.0 <= float(value) <= 1.0) or (not allow_zero and float(value) == 0.0):
        raise KVTrimError(f"{what} must be a fraction in {'[' if allow_zero else '('}0, 1], got {value!r}")
    return float(value)


def boolean(value, what: str) -> bool:
    """True or False (not a number or a string that reads like one)."""
    if not isinstance(value, bool):
        raise KVTrimError(f"{what} must be true or false, got {value!r}")
    return value


def choice(value, what: str, allowed) -> str:
    """One of ``allowed``."""
    if value not in allowed:
        raise KVTrimError(f"{what} must be one of {', '.join(map(str, allowed))}; got {value!r}")
    return value


def comma_list(value, what: str) -> list[str]:
    """A comma-separated string (or a sequence) of non-empty items, each stripped:
    ``"a, b"`` -> ``["a", "b"]``. Numbers in it stay strings; the caller converts them."""
    items = value.split(",") if isinstance(value, str) else list(value)
    items = [str(x).strip() for x in items]
    if not items or any(not x for x in items):
        raise KVTrimError(f"{what} takes a comma-separated list without empty items; got {value!r}")
    return items


def _int_range(lo, hi, unit) -> str:
    noun = f"number of {unit}" if unit else "integer"
    if lo is not None and hi is not None:
        return f"an integer in [{lo}, {hi}]"
    if lo == 1:
        return f"a positive {noun}"
    if lo == 0:
        return f"a non-negative {noun}"
    if lo is not None:
        return f"an integer >= {lo}"
    if hi is not None:
        return f"an integer <= {hi}"
    return f"an integer number of {unit}" if unit else "an integer"


def _num_range(lo, hi, lo_open, hi_open, finite) -> str:
    kind = "a finite number" if finite else "a number"
    if lo is not None and hi is not None:
        return f"in {'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}"
    if lo is not None:
        return f"{kind} {'>' if lo_open else '>='} {lo:g}"
    if hi is not None:
        return f"{kind} {'<' if hi_open else '<='} {hi:g}"
    return kind
