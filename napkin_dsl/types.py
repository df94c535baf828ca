"""Annotation objects: ``napkin.bf16["b h q d"]`` and friends.

They serve twice. In a ``@napkin.kernel`` signature they declare a parameter's dtype and axes.
At run time they are classes whose ``isinstance`` checks a NumPy array's dtype and rank, so
typeguard (or a plain ``isinstance``) can check user code that passes arrays around.

>>> import numpy as np
>>> isinstance(np.zeros((2, 3), np.float32), f32["q d"])
True
>>> isinstance(np.zeros((2, 3), np.float64), f32["q d"])
False
>>> f32["q d"].axes
('q', 'd')

typeguard: ``typeguard.check_type(x, f32["q d"])`` works as is. Its ``@typechecked``
decorator rewrites every string inside a subscripted annotation as a forward reference and
fails on ``"q d"``, so functions it instruments write the call form ``napkin.f32("q d")``
(the same type) or a module-level alias (``QD = napkin.f32["q d"]``; ``def f(x: QD)``).

>>> f32("q d") is f32["q d"]
True
"""

from __future__ import annotations

import functools

import numpy as np

from .dtypes import DTYPE_BYTES, FP8_MAX, canonical_dtype


def numpy_dtype(dtype: str) -> np.dtype:
    """The NumPy dtype napkin uses for a napkin dtype name (bf16 and fp8 via ml_dtypes)."""
    dtype = canonical_dtype(dtype)
    if dtype in ("bf16", "fp8e4m3", "fp8e5m2"):
        import ml_dtypes

        return np.dtype({"bf16": ml_dtypes.bfloat16, "fp8e4m3": ml_dtypes.float8_e4m3fn, "fp8e5m2": ml_dtypes.float8_e5m2}[dtype])
    return np.dtype({"f64": np.float64, "f32": np.float32, "f16": np.float16, "i32": np.int32, "i64": np.int64}[dtype])


class ArrayTypeMeta(type):
    """Metaclass of array annotations: isinstance checks dtype and rank."""

    dtype: str
    axes: tuple[str, ...]

    def __instancecheck__(cls, value) -> bool:
        return (
            isinstance(value, np.ndarray)
            and value.ndim == len(cls.axes)
            and value.dtype == numpy_dtype(cls.dtype)
        )

    def __repr__(cls) -> str:
        return f"napkin.{cls.dtype}[{' '.join(cls.axes)!r}]"


@functools.lru_cache(maxsize=None)
def array_type(dtype: str, axes: tuple[str, ...]) -> type:
    return ArrayTypeMeta(f"{dtype}[{' '.join(axes)}]", (), {"dtype": dtype, "axes": axes, "__module__": "napkin_dsl"})


class DTypeMeta(type):
    """Metaclass of ``napkin.f32`` etc.: subscript for arrays; bare, a scalar type."""

    dtype: str

    def __getitem__(cls, axes) -> type:
        if isinstance(axes, str):
            names = tuple(axes.split())
        elif isinstance(axes, tuple) and all(isinstance(a, str) for a in axes):
            names = axes
        else:
            raise TypeError(f"napkin.{cls.dtype}[...] takes axis names as a string, e.g. napkin.{cls.dtype}[\"q d\"]")
        for name in names:
            if not name.isidentifier():
                raise TypeError(f"{name!r} is not an axis name")
        return array_type(cls.dtype, names)

    def __call__(cls, axes) -> type:
        """``napkin.f32("q d")``: the same array type as ``napkin.f32["q d"]``.

        typeguard's ``@typechecked`` reads a string inside a subscripted annotation as a
        forward reference ("q d" is not Python), so code it instruments writes the call form.
        """
        return cls[axes]

    def __instancecheck__(cls, value) -> bool:
        """A scalar of this dtype: a Python number it holds, or a NumPy scalar of exactly it.

        Python ints fit every dtype and floats every float dtype; NumPy scalars must match,
        as arrays must (an np.float64 is not an f32). bool is not a number here.
        """
        if isinstance(value, (bool, np.bool_)):
            return False
        if isinstance(value, (np.generic, np.ndarray)):
            return np.ndim(value) == 0 and value.dtype == numpy_dtype(cls.dtype)
        if isinstance(value, int):
            return True
        return isinstance(value, float) and not canonical_dtype(cls.dtype).startswith("i")

    def __repr__(cls) -> str:
        return f"napkin.{cls.dtype}"


def _dtype(name: str) -> type:
    return DTypeMeta(name, (), {"dtype": name, "__module__": "napkin_dsl"})


f64, f32, f16, bf16 = _dtype("f64"), _dtype("f32"), _dtype("f16"), _dtype("bf16")
fp8e4m3, fp8e5m2 = _dtype("fp8e4m3"), _dtype("fp8e5m2")
fp8 = fp8e4m3
i32, i64 = _dtype("i32"), _dtype("i64")

assert set(DTYPE_BYTES) == {"f64", "f32", "f16", "bf16", "fp8e4m3", "fp8e5m2", "i32", "i64"}


def convert(values, dtype: str, order: str = "K") -> np.ndarray:
    """``values`` converted to the napkin dtype ``dtype`` as every napkin backend stores them:
    round to nearest even (ml_dtypes for bf16 and fp8), an integer dtype rounded to the nearest
    integer first, and an fp8 dtype **saturating** (``dtypes.FP8_MAX``): a value whose rounding
    would pass the largest finite fp8 value, and an infinity, becomes that value with its sign;
    NaN stays NaN. Always a new array."""
    target = numpy_dtype(dtype)
    values = np.asarray(values)
    with np.errstate(all="ignore"):
        if target.kind in "iu" and values.dtype.kind == "f":
            values = np.rint(values)  # float64 rounding error must not truncate 2.9999999 to 2
        elif dtype in FP8_MAX:
            largest = FP8_MAX[dtype]
            wide = values.astype(np.float32 if values.dtype.itemsize <= 4 else np.float64, copy=False)
            # Clipping before the cast is saturation: every value in [-max, max] rounds to a finite
            # fp8 value (max is one), and NaN passes np.clip unchanged.
            values = np.clip(wide, -largest, largest)
        return values.astype(target, order=order)  # not ascontiguousarray: it turns a 0-d result into 1-d
