"""kvtrim.validate: the one place for value checks. Bools and NaN are refused everywhere, values in
range pass (and come back converted), and each message says what was wrong and what is allowed."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtrim import validate
from kvtrim.errors import KVTrimError

NOT_NUMBERS = st.one_of(st.booleans(), st.none(), st.text(max_size=3), st.just(float("nan")), st.lists(st.integers(), max_size=2))


@given(lo=st.integers(-50, 50), span=st.integers(0, 100), data=st.data())
def test_integer_in_range_passes(lo, span, data):
    v = data.draw(st.integers(lo, lo + span))
    assert validate.integer(v, "x", minimum=lo, maximum=lo + span) == v
    assert validate.optional_integer(v, "x", minimum=lo) == v


@given(lo=st.integers(-50, 50), v=st.integers(-200, 200))
def test_integer_out_of_range_is_refused(lo, v):
    if v >= lo:
        assert validate.integer(v, "x", minimum=lo) == v
    else:
        with pytest.raises(KVTrimError, match=f"x must be .*, got {v}"):
            validate.integer(v, "x", minimum=lo)


@given(v=st.one_of(NOT_NUMBERS, st.floats(allow_nan=True)))
def test_integer_refuses_bools_floats_and_the_rest(v):
    with pytest.raises(KVTrimError, match="x must be"):
        validate.integer(v, "x")
    if v is None:
        assert validate.optional_integer(v, "x", minimum=0) is None
    else:
        with pytest.raises(KVTrimError, match="x must be a non-negative integer"):
            validate.optional_integer(v, "x", minimum=0)


@given(v=NOT_NUMBERS)
def test_number_and_fraction_refuse_bools_nan_and_non_numbers(v):
    with pytest.raises(KVTrimError, match="x must be"):
        validate.number(v, "x")
    with pytest.raises(KVTrimError, match="x must be"):
        validate.number(v, "x", minimum=0.0, maximum=1.0)
    with pytest.raises(KVTrimError, match=r"x must be a fraction in \(0, 1\]"):
        validate.fraction(v, "x")


@given(v=st.floats(0.0, 1.0), allow_zero=st.booleans())
def test_fraction_in_range_passes(v, allow_zero):
    if v == 0.0 and not allow_zero:
        with pytest.raises(KVTrimError, match=r"\(0, 1\]"):
            validate.fraction(v, "x")
    else:
        out = validate.fraction(v, "x", allow_zero=allow_zero)
        assert out == v and isinstance(out, float)


@given(v=st.one_of(st.floats(allow_nan=False, allow_infinity=True), st.integers(-10**6, 10**6)))
def test_number_bounds_open_and_closed(v):
    f = float(v)
    inside = 0.0 < f < 1.0
    assert (validate.number(v, "x", minimum=0.0, maximum=1.0, min_open=True, max_open=True) == f) if inside else True
    if not inside:
        with pytest.raises(KVTrimError, match=r"x must be in \(0, 1\)"):
            validate.number(v, "x", minimum=0.0, maximum=1.0, min_open=True, max_open=True)
    if math.isfinite(f) and f >= 0:
        assert validate.number(v, "x", minimum=0.0) == f
    else:
        with pytest.raises(KVTrimError, match="x must be a finite number >= 0"):
            validate.number(v, "x", minimum=0.0)


def test_infinity_only_when_asked():
    with pytest.raises(KVTrimError, match="finite"):
        validate.number(math.inf, "x")
    assert validate.number(math.inf, "x", finite=False) == math.inf
    with pytest.raises(KVTrimError, match="x must be a number >= 0"):
        validate.number(-math.inf, "x", minimum=0.0, finite=False)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: validate.integer(0, "w", minimum=1), "w must be a positive integer, got 0"),
        (lambda: validate.integer(-1, "w", minimum=0), "w must be a non-negative integer, got -1"),
        (lambda: validate.integer(1, "w", minimum=2), "w must be an integer >= 2, got 1"),
        (lambda: validate.integer(9, "w", minimum=0, maximum=8), r"w must be an integer in \[0, 8\], got 9"),
        (lambda: validate.integer(0, "chunk", minimum=1, unit="tokens"), "chunk must be a positive number of tokens"),
        (lambda: validate.integer(1.5, "length", unit="tokens"), "length must be an integer number of tokens"),
        (lambda: validate.integer(True, "w"), "w must be an integer, got True"),
        (lambda: validate.fraction(1.5, "keep"), r"keep must be a fraction in \(0, 1\], got 1.5"),
        (lambda: validate.fraction(-0.1, "keep", allow_zero=True), r"keep must be a fraction in \[0, 1\]"),
        (lambda: validate.number(1.0, "r", minimum=0.0, maximum=1.0, max_open=True), r"r must be in \[0, 1\), got 1.0"),
        (lambda: validate.choice("x", "mode", ("a", "b")), "mode must be one of a, b; got 'x'"),
    ],
)
def test_messages_say_what_is_allowed(call, message):
    with pytest.raises(KVTrimError, match=message):
        call()


def test_values_come_back_converted():
    assert validate.number(3, "x") == 3.0 and isinstance(validate.number(3, "x"), float)
    assert validate.optional_integer(None, "x", minimum=1) is None
    assert validate.choice("b", "mode", ("a", "b")) == "b"
