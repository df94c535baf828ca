"""The table of elementwise functions: what each one is called, costs, computes and prints as.

One entry per function a kernel calls by name (``exp(S)``, ``max(a, b)``; :data:`FUNCTIONS`,
keyed by the name, which is also its ``Apply.fn``) says in one place:

* **its name and arity**, which the checker reads to accept a call (``check.py``);
* **the unit it is counted on** (``special``: the special-function unit, MUFU on NVIDIA GPUs;
  ``fma``: the FMA pipe) and how many operations one evaluation counts there: the model
  (``diagram.count_operations``, read by ``boxes.py`` and so by ``cost.py``) and the NumPy
  backend's own counts both read it;
* **its float64 definition**, given NumPy: what the reference evaluator computes
  (``reference.ELEMENTWISE``), and, unless the entry gives a ``tile`` definition of its own,
  what the NumPy backend computes on its tiles in their dtype;
* **its spelling in C**, one template for both dialects and both C types
  (:meth:`Elementwise.spell`), which ``backends/lowering.py``'s ``Dialect.math`` prints;
* **its derivative**, given NumPy: the partial derivatives by each argument, from the
  arguments and the result; and the same partials as notation templates (``grad``), which the
  derived backward kernels (``grad.py``) are written with.

A new elementwise function is one entry here: ``tests/test_elementwise_table.py`` checks every
entry against formulas of its own and adds one (``softplus``) at run time, end to end.

NumPy is not imported here: the definitions are functions of the NumPy module, resolved on
first use (:func:`float64`), so that ``import napkin_dsl`` and ``napkin check`` stay without
it. Deliberately not here: the operators (``+ - * / ^``), comparisons, ``and/or/not`` and
``where``, which are the notation's own syntax (``diagram.OPERATORS``; a power's unit depends on
its exponent), and the reductions (``boxes.REDUCTION_TABLE``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

Definition = Callable[[ModuleType], Callable]  # given NumPy, a function of float64 arrays

UNITS = ("special", "fma")


@dataclass(frozen=True)
class Elementwise:
    """One elementwise function.

    ``c``: its C spelling, a template of ``{x}`` (the first argument), ``{y}`` (the second),
    ``{f}`` (the dialect's libm suffix for the C type: CUDA's ``expf`` for float, nothing for
    double and in OpenCL, whose functions are overloaded) and ``{c}`` (the suffix of a literal
    of the C type: ``1.0f`` in float, ``1.0`` in double).
    ``float64``: given NumPy, the function on float64 arrays (a ufunc where NumPy has one, so
    that a reduction can fold with it). ``tile``: given NumPy, the function the NumPy backend
    evaluates on tiles, where the float64 one would not keep a tile's dtype or would be too
    slow on it (None: the float64 one, which keeps it).
    ``derivative``: given NumPy, ``(*args, result) -> (d result / d arg, ...)``, one partial per
    argument, each a function of float64 arrays.
    ``grad``: the same partials as notation text, one template per argument, of ``{x}`` (the
    first argument), ``{y}`` (the second) and ``{r}`` (the result), each already parenthesised
    by the caller: what a derived backward kernel (``grad.py``) writes, so that the backward is
    a napkin kernel like any other. ``tests/test_grad.py`` checks each against ``derivative``.
    ``domain``: the open interval of arguments where it is finite and smooth enough to
    differentiate (the fuzzer keeps its arguments there; the test of derivatives samples it)."""

    name: str
    arity: int
    unit: str
    operations: int  # counted on ``unit`` per element evaluated
    c: str
    float64: Definition
    derivative: Definition
    domain: tuple[float, float] = (-math.inf, math.inf)
    tile: Definition | None = None
    grad: tuple[str, ...] = ()
    # Its fast form in float: a template of ``{x}`` calling a function of FAST_PRELUDE, which
    # both dialects define (CUDA with its intrinsics, OpenCL with its precise functions), or ""
    # (the precise ``c`` spelling). ``fast_error``: (relative, absolute), the derived bound
    # ``|fast(x) - f(x)| <= relative |f(x)| + absolute`` for every float x, with CUDA's
    # intrinsics at their documented error (FAST_ERROR_TERMS); the tolerance of a run
    # (``backends.numpy.tolerance``) adds it where a statement calls the function in f32.
    fast: str = ""
    fast_error: tuple[float, float] = (0.0, 0.0)

    def spell(self, args: list[str], float_suffix: str, real: str) -> str:
        """The C expression of this function of ``args`` in C type ``real`` (float or double),
        ``float_suffix`` being the dialect's libm suffix for float; in float, its fast form
        where it has one."""
        if real == "float" and self.fast:
            return self.fast.format(x=args[0], y=args[-1])
        f, c = (float_suffix, "f") if real == "float" else ("", "")
        return self.c.format(x=args[0], y=args[-1], f=f, c=c)


# ---- definitions needing more than one NumPy call --------------------------------------------

_SQRT_HALF = math.sqrt(0.5)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


def _sigmoid(np):
    # exp(-log(1 + exp(-x))): no overflow for large |x|, unlike 1 / (1 + exp(-x)).
    return lambda x: np.exp(-np.logaddexp(0.0, -x))


def _erfc(np):
    erfc = np.frompyfunc(math.erfc, 1, 1)  # NumPy has no erf and SciPy is not a dependency
    # asarray, not .astype: frompyfunc returns a bare float, not an array, for a 0-d input.
    return lambda z: np.asarray(erfc(np.asarray(z)), dtype=np.float64)


def _gelu(np):
    # x/2 erfc(-x/sqrt 2), not x/2 (1 + erf(x/sqrt 2)): 1 + erf cancels to 0 below x = -8,
    # where GELU is still 1e-16 and smaller (the tile definition is written so too).
    erfc = _erfc(np)
    return lambda x: 0.5 * x * erfc(np.asarray(x) * -_SQRT_HALF)


def _gelu_derivative(np):
    # Phi(x) + x phi(x): the normal distribution and its density.
    erfc = _erfc(np)
    return lambda x, y: (0.5 * erfc(np.asarray(x) * -_SQRT_HALF) + x * np.exp(-0.5 * x * x) * _INV_SQRT_2PI,)


def _gelu_tile(np):
    """GELU in its exact erf form, vectorised, in the input's dtype (``backends.numpy.gelu``).

    In f64 (and on Python floats) erfc is ``math.erfc``, accurate to the last bits, as the
    reference's. Below f64 it is a rational fit (relative error below 1.2e-7, about 2 ulp of
    f32, as CUDA's ``erff`` and OpenCL's ``erf`` in float are), evaluated in float64:
    ``math.erfc`` one element at a time would be a Python loop over every tile."""
    accurate = _erfc(np)

    def erfc_nonnegative(z):
        # erfc(z) for z >= 0, fractional error below 1.2e-7 (Numerical Recipes' Chebyshev fit).
        t = 1.0 / (1.0 + 0.5 * z)
        poly = -1.26551223 + t * (1.00002368 + t * (0.37409196 + t * (0.09678418 + t * (-0.18628806 + t * (
            0.27886807 + t * (-1.13520398 + t * (1.48851587 + t * (-0.82215223 + t * 0.17087277))))))))
        return t * np.exp(-z * z + poly)

    def gelu(x):
        """GELU of an array in its dtype, or of a Python float as a float."""
        if not isinstance(x, np.ndarray) or x.dtype == np.float64:
            values = np.asarray(x, dtype=np.float64)
            result = 0.5 * values * accurate(values * -_SQRT_HALF)
            return result if isinstance(x, np.ndarray) else float(result)
        values = np.asarray(x, dtype=np.float64)
        z = values * -_SQRT_HALF
        erfc = np.where(z >= 0, erfc_nonnegative(np.abs(z)), 2.0 - erfc_nonnegative(np.abs(z)))
        return (0.5 * values * erfc).astype(x.dtype)

    return gelu


def _silu(np):
    sigmoid = _sigmoid(np)
    return lambda x: x * sigmoid(x)


def _silu_derivative(np):
    sigmoid = _sigmoid(np)

    def derivative(x, y):
        s = sigmoid(x)
        return (s + x * s * (1.0 - s),)

    return derivative


# ---- fast forms in float ------------------------------------------------------------------------
#
# sigmoid, silu and gelu in float are printed as functions of FAST_PRELUDE: one exponential
# (CUDA's __expf: ex2.approx of x log2 e, a FMUL and a MUFU.EX2) and one reciprocal
# (__fdividef(1, y): a MUFU.RCP; __frcp_rn's correctly rounded refinement calls a slow path per
# element) each, instead of the precise expf, the precise division and erfcf (some 20 FFMA, a
# MUFU.RCP and a MUFU.EX2 an element). GELU keeps its exact erf form (PyTorch's
# approximate="none"): erfc by the Chebyshev fit the NumPy backend evaluates in f32 too
# (Numerical Recipes' erfcc, fractional error below 1.2e-7 for every argument), not the tanh form,
# whose own error (~3e-4 absolute) is a different function.
#
# Their error bounds, derived from these terms (u: f32's unit roundoff, 2^-24; an ulp 2^-23 at
# most relative):
#
# * __expf(a): 2 + floor(1.173 |a|) ulp (CUDA C++ Programming Guide, "Intrinsic Functions",
#   table of single-precision intrinsics); OpenCL's exp on PoCL is within that;
# * __fdividef(1, y): 2 ulp for y in [2^-126, 2^126] (same table), 0 beyond, where every use
#   here wants 0 (1 + E and 1 + z/2 are at least 1); each +, * and FMA: u relative.
#
# sigmoid = rcp(1 + E), E = exp(-x): E's relative error d_E reaches s as (1 - s) d_E, so
# |err| <= (4 ulp + u) s + 1.173 ulp |x| s (1 - s), and |x| s (1 - s) <= 0.224 (at |x| ~ 2.4).
# silu = x rcp(1 + E): one more rounding, and x^2 s (1 - s) <= 0.44 for the |x| term.
# gelu = x/2 (x > 0 ? 2 - e : e), e = t exp(-z^2 + P(t)), t = rcp(1 + z/2), z = |x|/sqrt 2:
# the fit (1.2e-7), t's error (2 ulp) through e's sensitivity to t, |t de/dt / e| <= 1 + sum k |a_k|
# <= 30, Horner's rounding of P (18 u sum |a_k| <= 18 u 6.83, absolute in the exponent, relative
# in e), __expf's 2 ulp and the last four roundings: relative; the rounding of z^2 and of the
# exponent (4u z^2) and __expf's 1.173 ulp |a| (a ~ z^2) grow with z^2 but are weighed by e:
# z^2 |gelu| <= max z^3 erfc(z) / sqrt 2 <= 0.11, absolute.
_ULP = 2.0**-23
_U = 2.0**-24
_GELU_FIT = (-1.26551223, 1.00002368, 0.37409196, 0.09678418, -0.18628806, 0.27886807, -1.13520398,
             1.48851587, -0.82215223, 0.17087277)
FAST_ERROR_TERMS = {
    "sigmoid": (4 * _ULP + _U, 1.173 * _ULP * 0.224),
    "silu": (4 * _ULP + 2 * _U, 1.173 * _ULP * 0.44),
    "gelu": (1.2e-7 + 30 * 2 * _ULP + 18 * _U * sum(abs(a) for a in _GELU_FIT) + 2 * _ULP + 4 * _U,
             (4 * _U + 1.173 * _ULP) * 0.11),
}


def _fast_gelu_c() -> str:
    """The fit's polynomial in t, by Horner's rule, as C (each step one FFMA)."""
    horner = f"{_GELU_FIT[-1]!r}f"
    for a in reversed(_GELU_FIT[:-1]):
        horner = f"({horner} * t + {a!r}f)"
    return horner


# What the fast forms call: NK_FAST_FN, NK_EXPF and NK_RCPF are each dialect's (lowering.py).
FAST_PRELUDE = f"""// Fast forms of sigmoid, silu and gelu in float (elementwise.py: their error bounds).
NK_FAST_FN float nk_fast_sigmoid(float x) {{ return NK_RCPF(1.0f + NK_EXPF(-x)); }}
NK_FAST_FN float nk_fast_silu(float x) {{ return x * NK_RCPF(1.0f + NK_EXPF(-x)); }}
NK_FAST_FN float nk_fast_gelu(float x) {{
    const float z = fabs(x) * 0.70710678118654752f;
    const float t = NK_RCPF(1.0f + 0.5f * z);
    const float e = t * NK_EXPF(-z * z + {_fast_gelu_c()});  // the fit of erfc at z >= 0
    return 0.5f * x * (x > 0.0f ? 2.0f - e : e);
}}
"""


# ---- the table ---------------------------------------------------------------------------------

_POSITIVE = (0.0, math.inf)

# gelu is the exact erf form (PyTorch's default, approximate="none"), written x/2 erfc(-x/sqrt 2)
# in C too: 1 + erf(x/sqrt 2) cancels to 0 below x = -6 in float, where GELU is still 1e-10.
# sigmoid and silu are printed as 1 / (1 + exp(-x)): the GPU's exp overflows to inf, which
# gives the right limit, 0.
FUNCTIONS: dict[str, Elementwise] = {e.name: e for e in (
    Elementwise("exp", 1, "special", 1, "exp{f}({x})", lambda np: np.exp, lambda np: lambda x, y: (y,),
                grad=("{r}",)),
    Elementwise("log", 1, "special", 1, "log{f}({x})", lambda np: np.log, lambda np: lambda x, y: (1.0 / x,), _POSITIVE,
                grad=("1 / {x}",)),
    Elementwise("sqrt", 1, "special", 1, "sqrt{f}({x})", lambda np: np.sqrt, lambda np: lambda x, y: (0.5 / y,), _POSITIVE,
                grad=("0.5 / {r}",)),
    Elementwise("rsqrt", 1, "special", 1, "rsqrt{f}({x})", lambda np: lambda x: 1.0 / np.sqrt(x),
                lambda np: lambda x, y: (-0.5 * y / x,), _POSITIVE,
                grad=("-0.5 * {r} / {x}",)),
    Elementwise("tanh", 1, "special", 1, "tanh{f}({x})", lambda np: np.tanh, lambda np: lambda x, y: (1.0 - y * y,),
                grad=("1 - {r} * {r}",)),
    Elementwise("sigmoid", 1, "special", 1, "(1.0{c} / (1.0{c} + exp{f}(-({x}))))", _sigmoid,
                lambda np: lambda x, y: (y * (1.0 - y),),
                grad=("{r} * (1 - {r})",), fast="nk_fast_sigmoid({x})", fast_error=FAST_ERROR_TERMS["sigmoid"]),
    Elementwise("gelu", 1, "special", 1, "(0.5{c} * ({x}) * erfc{f}(({x}) * -0.70710678118654752{c}))", _gelu,
                _gelu_derivative, tile=_gelu_tile,
                grad=("where({x} == 0, 0.5, {r} / where({x} == 0, 1, {x})) + {x} * exp(-0.5 * {x} * {x}) * 0.3989422804014327",),
                fast="nk_fast_gelu({x})", fast_error=FAST_ERROR_TERMS["gelu"]),
    Elementwise("silu", 1, "special", 1, "(({x}) / (1.0{c} + exp{f}(-({x}))))", _silu, _silu_derivative,
                grad=("sigmoid({x}) * (1 + {x} * (1 - sigmoid({x})))",), fast="nk_fast_silu({x})",
                fast_error=FAST_ERROR_TERMS["silu"]),
    Elementwise("relu", 1, "fma", 1, "fmax{f}({x}, 0.0{c})", lambda np: lambda x: np.maximum(x, 0.0),
                lambda np: lambda x, y: (np.where(x > 0, 1.0, 0.0),),
                grad=("where({x} > 0, 1, 0)",)),
    Elementwise("abs", 1, "fma", 1, "fabs{f}({x})", lambda np: np.abs, lambda np: lambda x, y: (np.sign(x),),
                grad=("where({x} > 0, 1, where({x} < 0, -1, 0))",)),
    Elementwise("neg", 1, "fma", 1, "(-({x}))", lambda np: np.negative, lambda np: lambda x, y: (np.full_like(x, -1.0),),
                grad=("-1",)),
    Elementwise("max", 2, "fma", 1, "fmax{f}({x}, {y})", lambda np: np.maximum,
                lambda np: lambda a, b, y: (np.where(a >= b, 1.0, 0.0), np.where(a >= b, 0.0, 1.0)),
                grad=("where({x} >= {y}, 1, 0)", "where({x} >= {y}, 0, 1)")),
    Elementwise("min", 2, "fma", 1, "fmin{f}({x}, {y})", lambda np: np.minimum,
                lambda np: lambda a, b, y: (np.where(a <= b, 1.0, 0.0), np.where(a <= b, 0.0, 1.0)),
                grad=("where({x} <= {y}, 1, 0)", "where({x} <= {y}, 0, 1)")),
)}


def function(name: str) -> Elementwise | None:
    """The table's entry for an ``Apply.fn``, or None (an operator, or no function)."""
    return FUNCTIONS.get(name)


def names(arity: int | None = None, unit: str | None = None) -> list[str]:
    """The functions' names in table order, of one arity and one unit when given."""
    return [e.name for e in FUNCTIONS.values() if (arity is None or e.arity == arity) and (unit is None or e.unit == unit)]


def float64(entry: Elementwise) -> Callable:
    """The entry's float64 definition, with NumPy (imported here, on first use)."""
    return _resolve(entry, "float64")


def tile(entry: Elementwise) -> Callable:
    """What the NumPy backend evaluates on a tile: the entry's tile definition, else its float64 one."""
    return _resolve(entry, "tile" if entry.tile is not None else "float64")


def derivative(entry: Elementwise) -> Callable:
    """The entry's derivative, ``(*args, result) -> one partial per argument``, with NumPy."""
    return _resolve(entry, "derivative")


@functools.cache
def _resolve(entry: Elementwise, field: str) -> Callable:
    # Keyed by the entry itself (frozen, hashable): an entry replaced at run time, as the tests
    # do, resolves afresh.
    import numpy

    return getattr(entry, field)(numpy)
