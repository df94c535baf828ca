"""The algebra of sizes: exact polynomials over size symbols, which the whole spine computes in.

A diagram's sizes are symbols (``q``, ``d``, a tile ``g_q``) or integers, and everything napkin
derives from them (FLOPs, extents, trip counts, transfers, memory) is a sum of products of those
symbols with rational coefficients (floats where a bandwidth or a rate enters, as sympy keeps a
Float). This module holds exactly that algebra and prints it as sympy does; napkin needs no
sympy (whose import alone took longer than napkin's start-up budget). An :class:`Expr` is kept
in one canonical form, a dict from monomials to coefficients, so equality is structural and
expansion is free.

A monomial multiplies *atoms* with rational exponents:

* :class:`Symbol`: a size (positive integer) or another positive quantity (an opaque box's FLOPs);
* :class:`Ceiling`, :class:`Max`, :class:`Min`: of expressions, kept when symbolic and evaluated
  when numeric (``Max`` drops an argument another provably bounds, as sympy's does);
* :class:`Root`: an integer to a fractional power (``2^0.5``), so numbers stay exact;
* :class:`Group`: a sum under a power that is not a natural number (``1/(q + 1)``).

``oo`` (infinity) is a value for ``where(..., -inf)`` only; it takes no arithmetic. Beyond the
ring operations: :func:`cancel` (a quotient as one fraction: a report's intensity),
:func:`lambdify` (the tuner's compiled scorer) and :func:`limit_at_infinity` (the paper's H0).

Deliberately not here: simplification beyond the canonical form (a common factor that is a sum
is not found), solving and calculus. For a user's own analysis ``sympy.sympify(expr)`` converts
any :class:`Expr` (``_sympy_``) and :func:`as_expr` reads sympy back; sympy is imported then,
by the caller, never by napkin.
"""

from __future__ import annotations

import math
from fractions import Fraction
from functools import total_ordering

Number = int | Fraction | float  # a float is inexact, as sympy's Float: a bandwidth, a rate


def _number(value) -> Number:
    """A coefficient in its one form: an integral Fraction is an int; a float stays a float."""
    if isinstance(value, Fraction) and value.denominator == 1:
        return value.numerator
    return value


def _from_python(value) -> "Expr":
    if isinstance(value, Expr):
        return value
    if isinstance(value, bool):
        return Integer(int(value))
    if isinstance(value, int):
        return Integer(value)
    if isinstance(value, Fraction):
        return Rational(value)
    if isinstance(value, float):
        if math.isnan(value):
            raise ValueError("nan is not a size")
        if math.isinf(value):
            return oo if value > 0 else NEG_OO
        return Expr({(): value} if value else {})
    if isinstance(value, str):
        return parse(value)
    if _is_sympy(value):  # from a stage (or a user) that computed in sympy
        return _from_sympy(value)
    if hasattr(value, "__index__"):
        return Integer(value.__index__())
    raise TypeError(f"not a size expression: {value!r}")


def _from_sympy(value) -> "Expr":
    """A sympy expression in this algebra, symbol assumptions kept; sympy's other functions refused."""
    if value.is_Symbol:
        return Symbol(value.name, positive=bool(value.is_positive), integer=bool(value.is_integer))
    if value.is_Rational:
        return Rational(Fraction(int(value.p), int(value.q)))
    if value.is_Float:
        return _from_python(float(value))
    if value.is_infinite and value.is_number:
        return oo if value.is_positive else NEG_OO
    args = [_from_sympy(a) for a in value.args]
    name = type(value).__name__
    if value.is_Add:
        return Add(*args)
    if value.is_Mul:
        return Mul(*args)
    if value.is_Pow:
        return args[0] ** args[1]
    functions = {"ceiling": ceiling, "Max": Max.of, "Min": Min.of}
    if name in functions:
        return functions[name](*args)
    raise TypeError(f"not a size expression: {value} ({name} is beyond napkin's size algebra)")


def as_expr(value) -> "Expr":
    """An :class:`Expr` of an int, Fraction, float, text, sympy expression or Expr (the
    expression itself: its canonical form is always expanded)."""
    return _from_python(value)


def as_number(expr):
    """The value of a size expression as a Python int (or float), or None when it has symbols."""
    expr = as_expr(expr)
    if expr.is_number:
        return int(expr) if expr.is_integer else float(expr)
    return None


def _is_sympy(value) -> bool:
    return type(value).__module__.startswith("sympy")


# ---- expressions ------------------------------------------------------------------------------


@total_ordering
class Expr:
    """A polynomial in atoms: ``terms`` maps a monomial (a sorted tuple of (atom, exponent)) to its coefficient."""

    __slots__ = ("_terms", "_hash", "__weakref__")
    is_Symbol = False

    def __init__(self, terms: dict):
        self._terms = terms
        self._hash = None

    @property
    def terms(self) -> dict:
        return self._terms

    # -- what it is
    @property
    def is_number(self) -> bool:
        return not self.free_symbols

    @property
    def is_Number(self) -> bool:
        return self.value is not None

    @property
    def is_Rational(self) -> bool:
        return self.rational is not None

    @property
    def is_Integer(self) -> bool:
        r = self.rational
        return r is not None and isinstance(r, int)

    @property
    def is_infinite(self) -> bool:
        return False

    @property
    def is_integer(self) -> bool | None:
        """True for an integer, False for another number, None when unknown (as sympy says)."""
        r = self.rational
        if r is not None:
            return isinstance(r, int)
        if self.is_number:
            return False if not float(self).is_integer() else None
        if all(isinstance(c, int) and all(isinstance(e, int) and e > 0 and a.is_integer for a, e in m)
               for m, c in self.terms.items()):
            return True
        return None

    @property
    def is_positive(self) -> bool | None:
        if self.is_number:
            return float(self) > 0 if self.rational is None else self.rational > 0
        if all(c > 0 for c in self.terms.values()) and all(a.is_positive for m in self.terms for a, _ in m):
            return True
        if all(c < 0 for c in self.terms.values()) and all(a.is_positive for m in self.terms for a, _ in m):
            return False
        return None

    @property
    def is_negative(self) -> bool | None:
        return (-self).is_positive

    @property
    def is_nonnegative(self) -> bool | None:
        if not self.terms:
            return True
        return self.is_positive

    @property
    def rational(self) -> int | Fraction | None:
        """The value when the expression is a rational number, else None."""
        value = self.value
        return None if isinstance(value, float) else value

    @property
    def value(self) -> Number | None:
        """The value when the expression is a rational number or a float, else None."""
        terms = self.terms
        if not terms:
            return 0
        if len(terms) == 1 and () in terms:
            return terms[()]
        return None

    @property
    def free_symbols(self) -> set:
        found = set()
        for monomial in self.terms:
            for atom, _ in monomial:
                found |= atom.free_symbols
        return found

    def has(self, *things) -> bool:
        """Whether any of ``things`` (expressions) is this expression or one of its atoms, at any depth."""
        atoms = {atom for monomial in self.terms for atom, _ in monomial}
        return any(isinstance(thing, Expr) and (thing == self or any(thing == a or any(arg.has(thing) for arg in a.args) for a in atoms))
                   for thing in things)

    @property
    def args(self) -> tuple:
        """sympy's view: the terms of a sum, the factors of a product, nothing of a number."""
        terms = self.terms
        if self.value is not None:
            return ()
        if len(terms) > 1:
            return tuple(_build({m: c}) for m, c in terms.items())
        ((monomial, coefficient),) = terms.items()
        factors = [number(coefficient)] if coefficient != 1 else []
        return tuple(factors + [_power(atom, e) for atom, e in monomial])

    # -- arithmetic
    def __add__(self, other):
        other = _operand(other)
        if other is NotImplemented:
            return NotImplemented
        terms = dict(self.terms)
        for monomial, coefficient in other.terms.items():
            _accumulate(terms, monomial, coefficient)
        return _build(terms)

    __radd__ = __add__

    def __neg__(self):
        return _build({m: -c for m, c in self.terms.items()})

    def __pos__(self):
        return self

    def __sub__(self, other):
        other = _operand(other)
        if other is NotImplemented:
            return NotImplemented
        return self + (-other)

    def __rsub__(self, other):
        other = _operand(other)
        if other is NotImplemented:
            return NotImplemented
        return other + (-self)

    def __mul__(self, other):
        other = _operand(other)
        if other is NotImplemented:
            return NotImplemented
        terms: dict = {}
        for m1, c1 in self.terms.items():
            for m2, c2 in other.terms.items():
                factor, monomial = _multiply_monomials(m1, m2)
                _accumulate(terms, monomial, factor * c1 * c2)
        return _build(terms)

    __rmul__ = __mul__

    def __truediv__(self, other):
        if isinstance(other, _Infinity) or isinstance(other, float) and math.isinf(other):
            return ZERO  # a finite amount over an infinite bandwidth takes no time
        other = _operand(other)
        if other is NotImplemented:
            return NotImplemented
        return self * other ** -1

    def __rtruediv__(self, other):
        other = _operand(other)
        if other is NotImplemented:
            return NotImplemented
        return other * self ** -1

    def __pow__(self, exponent):
        exponent = _operand(exponent)
        if exponent is NotImplemented:
            return NotImplemented
        e = exponent.rational
        if e is None:
            raise NotImplementedError(f"napkin's size algebra takes rational exponents only, not {exponent}")
        return _raise(self, e)

    def __rpow__(self, base):
        base = _operand(base)
        if base is NotImplemented:
            return NotImplemented
        return base ** self

    def __mod__(self, other):
        a, b = self.rational, _from_python(other).rational
        if a is None or b is None:
            raise TypeError(f"{self} % {other}: both must be rational numbers")
        return Rational(Fraction(a) % Fraction(b))

    def __abs__(self):
        return -self if self.is_negative else self

    # -- numbers
    def __float__(self) -> float:
        r = self.rational
        if r is not None:
            return float(r)
        if not self.is_number:
            raise TypeError(f"cannot convert {self} to float: it has symbols")
        return math.fsum(float(c) * math.prod(float(a) ** float(e) for a, e in m) for m, c in self.terms.items())

    def __int__(self) -> int:
        r = self.rational
        if r is not None:
            return int(r)
        return int(float(self))

    def __index__(self) -> int:
        r = self.rational
        if not isinstance(r, int):
            raise TypeError(f"{self} is not an integer")
        return r

    def __bool__(self) -> bool:
        return bool(self.terms)

    # -- comparison and identity
    def __eq__(self, other):
        if isinstance(other, Expr):
            return self is other or self.terms == other.terms  # an atom's one term never equals a canonical sum's
        if isinstance(other, (int, Fraction, float)) and not isinstance(other, bool):
            value = self.value
            return value == other if value is not None else isinstance(other, float) and self.is_number and float(self) == other
        if _is_sympy(other):
            return self._sympy_() == other
        return NotImplemented

    def __hash__(self):
        if self._hash is None:
            value = self.value
            self._hash = hash(value) if value is not None else hash(frozenset(self.terms.items()))
        return self._hash

    def __lt__(self, other):
        return self._compare(other) < 0

    def __gt__(self, other):
        return self._compare(other) > 0

    def _compare(self, other) -> float:
        if other is oo:
            return -1
        if other is NEG_OO:
            return 1
        other = _from_python(other)
        difference = self - other
        r = difference.rational
        if r is not None:
            return r
        if difference.is_number:
            return float(difference)
        raise TypeError(f"cannot determine the truth value of {self} < {other}: it has symbols")

    # -- substitution
    def subs(self, mapping=None, value=None) -> "Expr":
        """Replace symbols (keys: Symbols or their names) by values, re-evaluating functions of them."""
        if value is not None:
            mapping = {mapping: value}
        if isinstance(mapping, (list, tuple)):
            mapping = dict(mapping)
        if not mapping:
            return self
        by_name = {}
        for key, val in mapping.items():
            name = key if isinstance(key, str) else getattr(key, "name", None)
            if name is None:
                raise TypeError(f"subs takes symbols, not {key!r}")
            by_name[name] = _from_python(val)
        return self._replace(by_name)

    def _replace(self, by_name: dict) -> "Expr":
        total = ZERO
        for monomial, coefficient in self.terms.items():
            term = number(coefficient)
            for atom, e in monomial:
                term = term * _raise(atom._replace(by_name), e)
            total = total + term
        return total

    def coeff(self, symbol) -> "Expr":
        """The coefficient of ``symbol`` to the first power (sympy's ``coeff``)."""
        total = {}
        for monomial, coefficient in self.terms.items():
            if (symbol, 1) in monomial:
                rest = tuple(f for f in monomial if f != (symbol, 1))
                total[rest] = _number(total.get(rest, 0) + coefficient)
        return _build({m: c for m, c in total.items() if c})

    # -- conversion and printing
    def _sympy_(self):
        import sympy

        def power(atom, e):
            e = sympy.Rational(e.numerator, e.denominator) if isinstance(e, Fraction) else sympy.Integer(e)
            return sympy.Pow(atom._sympy_(), e)

        return sympy.Add(*(sympy.Mul(_sympy_number(c), *(power(a, e) for a, e in m)) for m, c in self.terms.items()))

    def __str__(self) -> str:
        return _print_sum(self)

    def __repr__(self) -> str:
        return str(self)


def _sympy_number(value):
    import sympy

    if isinstance(value, float):
        return sympy.Float(value)
    if isinstance(value, Fraction):
        return sympy.Rational(value.numerator, value.denominator)
    return sympy.Integer(value)


def _operand(value):
    """An operand of arithmetic, or NotImplemented (sympy's own objects then do the arithmetic;
    inf takes none)."""
    if isinstance(value, Expr):
        return value
    if isinstance(value, (int, Fraction)) or isinstance(value, float) and math.isfinite(value):
        return _from_python(value)
    return NotImplemented


def _accumulate(terms: dict, monomial: tuple, coefficient: Number) -> None:
    """Add coefficient * monomial to ``terms`` in place, dropping the monomial where it cancels."""
    total = terms.get(monomial, 0) + coefficient
    if total:
        terms[monomial] = _number(total)
    else:
        terms.pop(monomial, None)


def _build(terms: dict) -> Expr:
    """The canonical expression of ``terms``: an atom alone is the atom itself."""
    if len(terms) == 1:
        ((monomial, coefficient),) = terms.items()
        if coefficient == 1 and len(monomial) == 1 and monomial[0][1] == 1:
            return monomial[0][0]
    return Expr(terms)


def number(value: Number) -> Expr:
    """The constant expression of an int, a Fraction or a float."""
    value = _number(value)
    return Expr({(): value} if value else {})


def Integer(value: int) -> Expr:
    value = int(value)
    return Expr({(): value} if value else {})


def Rational(value, denominator=None) -> Expr:
    value = Fraction(value) if denominator is None else Fraction(value, denominator)
    return Expr({(): _number(value)} if value else {})


ZERO = Integer(0)
ONE = Integer(1)


def Add(*values) -> Expr:
    """The sum of expressions or numbers (sympy's spelling)."""
    result = ZERO
    for v in values:
        result = result + v
    return result


def Mul(*values) -> Expr:
    """The product of expressions or numbers (sympy's spelling)."""
    result = ONE
    for v in values:
        result = result * v
    return result


def _multiply_monomials(m1: tuple, m2: tuple) -> tuple[Number, tuple]:
    """(numeric factor, monomial) of m1 * m2: exponents of one atom add; integer powers of a Root leave it."""
    if not m1:
        return 1, m2
    if not m2:
        return 1, m1
    exponents = dict(m1)
    for atom, e in m2:
        total_e = exponents.get(atom, 0) + e
        if total_e:
            exponents[atom] = _number(Fraction(total_e))
        else:
            del exponents[atom]
    factor = _normalise_roots(exponents)
    return factor, tuple(sorted(exponents.items(), key=lambda item: item[0]._order))


def _normalise_roots(exponents: dict) -> Number:
    """Keep each Root's exponent in (0, 1), moving whole powers into the returned factor
    (sqrt(2)^3 = 2*sqrt(2), 2^(-1/2) = sqrt(2)/2), so equal numbers have one form."""
    factor: Number = 1
    for atom in [a for a in exponents if isinstance(a, Root)]:
        e = Fraction(exponents[atom])
        whole = math.floor(e)
        if whole:
            factor = _number(Fraction(factor) * Fraction(atom.base) ** whole)
            e -= whole
            if e:
                exponents[atom] = _number(e)
            else:
                del exponents[atom]
    return factor


def _power(atom, e) -> Expr:
    return _build({((atom, e),): 1}) if e != 0 else ONE


def _raise(base: Expr, e: Number) -> Expr:
    """base ** e for a rational e: a monomial's exponents scale; a natural power of a sum expands;
    any other power of a sum is a :class:`Group` atom."""
    if e == 0:
        return ONE
    if e == 1:
        return base
    terms = base.terms
    if not terms:
        if e < 0:
            raise ZeroDivisionError("division by zero in a size expression")
        return ZERO
    if len(terms) == 1:
        ((monomial, coefficient),) = terms.items()
        result = _rational_power(coefficient, e)
        factors = {}
        for atom, exponent in monomial:
            factors[atom] = _number(Fraction(exponent) * Fraction(e))
        factor = _normalise_roots(factors)
        return result * _build({tuple(sorted(factors.items(), key=lambda item: item[0]._order)): factor})
    if isinstance(e, int) and e > 0:
        result = ONE
        for _ in range(e):
            result = result * base
        return result
    return _power(Group(base), e)


def _rational_power(coefficient: Number, e: Number) -> Expr:
    """coefficient ** e, exact: a fractional power of an integer that is no perfect power is a Root."""
    if isinstance(coefficient, float):
        return Expr({(): float(coefficient) ** float(e)})
    c = Fraction(coefficient)
    e = Fraction(e)
    if e.denominator == 1:
        return Rational(c ** e.numerator)
    if c < 0:
        raise ValueError(f"({coefficient})^({e}) is not a real number")
    result = ONE
    for part, sign in ((c.numerator, 1), (c.denominator, -1)):
        if part == 1:
            continue
        outside, inside = _split_root(part, e.denominator)
        result = result * Rational(Fraction(outside) ** (sign * e.numerator))
        if inside != 1:
            exponents = {Root(inside): _number(sign * e)}
            factor = _normalise_roots(exponents)
            result = result * _build({tuple(exponents.items()): factor})
    return result


def _split_root(n: int, k: int) -> tuple[int, int]:
    """(a, b) with n = a**k * b, taking out the k-th powers of the primes below 1000 and a
    remaining perfect k-th power (sqrt(8) = 2*sqrt(2))."""
    outside, inside = 1, n
    for p in range(2, 1000):
        if p * p > inside:
            break
        while inside % p**k == 0:
            inside //= p**k
            outside *= p
    root = round(inside ** (1 / k)) if inside < 2**1000 else None
    if root is not None and root > 1 and root**k == inside:
        return outside * root, 1
    return outside, inside


# ---- atoms -------------------------------------------------------------------------------------


class Atom(Expr):
    """A factor of monomials. ``_order`` sorts atoms in a monomial (any fixed total order)."""

    __slots__ = ("_order",)

    @property
    def terms(self) -> dict:
        return {((self, 1),): 1}

    @property
    def rational(self):
        return None

    def __eq__(self, other):
        if isinstance(other, Atom):
            return self is other or (type(other) is type(self) and self._order == other._order)
        if isinstance(other, Expr):
            return False
        if isinstance(other, (int, Fraction, float)):
            return False
        if _is_sympy(other):
            return self._sympy_() == other
        return NotImplemented

    def __hash__(self):
        return hash(self._order)

    @property
    def free_symbols(self) -> set:
        return set().union(*(a.free_symbols for a in self.args))

    def _replace(self, by_name):
        raise NotImplementedError


class Symbol(Atom):
    """A named quantity: a size is positive and an integer (``positive=True, integer=True``), a
    bandwidth or an opaque box's FLOPs positive only, an index neither."""

    __slots__ = ("name", "_positive", "_integer")
    is_Symbol = True

    def __init__(self, name: str, positive: bool = False, integer: bool = False):
        self.name = name
        self._positive = positive
        self._integer = integer
        self._order = (0, name, positive, integer)
        self._hash = None

    @property
    def is_positive(self):
        return True if self._positive else None

    @property
    def is_integer(self):
        return True if self._integer else None

    @property
    def is_number(self):
        return False

    @property
    def free_symbols(self):
        return {self}

    @property
    def args(self):
        return ()

    def _replace(self, by_name):
        return by_name.get(self.name, self)

    def _sympy_(self):
        import sympy

        return sympy.Symbol(self.name, **{k: True for k, v in (("positive", self._positive), ("integer", self._integer)) if v})

    def __str__(self):
        return self.name

    def __reduce__(self):
        return (Symbol, (self.name, self._positive, self._integer))


class _Based(Atom):
    """An atom that stands for its ``base`` under the power its monomial gives it."""

    __slots__ = ("base",)

    def __float__(self):
        return float(self.base)

    def __str__(self):
        return str(self.base)

    def __reduce__(self):
        return (type(self), (self.base,))


class Root(_Based):
    """A positive integer that is no perfect power, under a fractional exponent (``sqrt(2)``)."""

    __slots__ = ()

    def __init__(self, base: int):
        self.base = base
        self._order = (1, base)
        self._hash = None

    @property
    def free_symbols(self):
        return set()

    @property
    def args(self):
        return ()

    @property
    def is_positive(self):
        return True

    @property
    def is_integer(self):
        return True

    def _replace(self, by_name):
        return Integer(self.base)

    def _sympy_(self):
        import sympy

        return sympy.Integer(self.base)


class Group(_Based):
    """A sum under a power that is not a natural number: ``1/(q + 1)`` is Group(q + 1)^-1."""

    __slots__ = ()

    def __init__(self, base: Expr):
        self.base = base
        self._order = (2, tuple(sorted((tuple((a._order, e) for a, e in m), c) for m, c in base.terms.items())))
        self._hash = None

    @property
    def args(self):
        return (self.base,)

    @property
    def free_symbols(self):
        return self.base.free_symbols

    @property
    def is_positive(self):
        return self.base.is_positive

    @property
    def is_integer(self):
        return self.base.is_integer

    def _replace(self, by_name):
        return self.base._replace(by_name)

    def _sympy_(self):
        return self.base._sympy_()


class Function(Atom):
    """An atom applying a function to expressions; subclasses evaluate numeric arguments."""

    __slots__ = ("_args",)
    name = ""

    def __init__(self, args: tuple):
        self._args = args
        self._order = (3, self.name, tuple(sorted(str(a) for a in args)))
        self._hash = None

    @property
    def args(self):
        return self._args

    @property
    def is_positive(self):
        return True if all(a.is_positive for a in self._args) else None

    @property
    def is_integer(self):
        return True if all(a.is_integer for a in self._args) else None

    def __float__(self):
        return float(self._replace({}))

    def _replace(self, by_name):
        return type(self).of(*(a._replace(by_name) for a in self._args))

    def _sympy_(self):
        import sympy

        return getattr(sympy, self.sympy_name)(*(a._sympy_() for a in self._args))

    def __str__(self):
        return f"{self.sympy_name}({', '.join(str(a) for a in self._print_order())})"

    def _print_order(self):
        return self._args

    def __reduce__(self):
        return (type(self).of, self._args)


class Ceiling(Function):
    name = sympy_name = "ceiling"
    is_integer = True

    @classmethod
    def of(cls, value) -> Expr:
        value = _from_python(value)
        r = value.rational
        if r is not None:
            return Integer(math.ceil(r))
        if value.is_number:
            return Integer(math.ceil(float(value)))
        # Integer terms leave the ceiling: ceiling(d/2 + 1) = ceiling(d/2) + 1.
        whole = _build({m: c for m, c in value.terms.items() if _build({m: c}).is_integer})
        rest = value - whole
        if not rest.terms:
            return value
        if rest.is_number:
            return whole + Integer(math.ceil(float(rest)))
        if rest.is_positive and provably_at_least(ONE, rest):
            return whole + ONE  # 0 < rest <= 1, as sympy finds for ceiling(1/(2*g))
        return whole + cls((rest,))


def ceiling(value) -> Expr:
    return Ceiling.of(value)


def provably_at_least(large: Expr, small: Expr) -> bool:
    """Whether large >= small for every value of the symbols (all positive; sizes integers >= 1).

    Sufficient, not complete: each positive-integer atom a (a size, a ceiling) is written as
    1 + a' with a' >= 0; then every term must be >= 0 (a non-negative coefficient over positive
    atoms), except negative terms of integer atoms under negative powers only (each at least its
    coefficient), which the constant term must cover."""
    difference = large - small
    if difference.is_number:
        return float(difference) >= 0
    shifted = _shift_integers(difference)
    debt = 0
    for monomial, coefficient in shifted.terms.items():
        if not monomial:
            continue
        if not all(a.is_positive for a, _ in monomial):
            return False
        if coefficient >= 0:
            continue
        if all(e < 0 and a.is_integer for a, e in monomial):
            debt += coefficient
            continue
        return False
    return shifted.terms.get((), 0) + debt >= 0


def _shift_integers(expr: Expr) -> Expr:
    """expr with each positive-integer atom a replaced by a + 1 (the atom then stands for a - 1 >= 0)."""
    result = ZERO
    for monomial, coefficient in expr.terms.items():
        term = number(coefficient)
        for atom, e in monomial:
            if isinstance(atom, Group):
                base = _shift_integers(atom.base)
            elif atom.is_positive and atom.is_integer and not isinstance(atom, Root):
                base = atom + 1
            else:
                base = atom
            term = term * _raise(base, e)
        result = result + term
    return result


class _Lattice(Function):
    """Max or Min: nested ones flatten, numbers fold, an argument another bounds is dropped."""

    largest: bool  # Max keeps the largest argument, Min the smallest

    @classmethod
    def pick(cls, numbers):
        return (max if cls.largest else min)(numbers, key=float)

    @classmethod
    def beats(cls, winner, loser) -> bool:
        """Whether ``winner`` provably makes ``loser`` redundant."""
        return provably_at_least(winner, loser) if cls.largest else provably_at_least(loser, winner)

    @classmethod
    def of(cls, *values) -> Expr:
        flat: list[Expr] = []
        for value in values:
            value = _from_python(value)
            flat.extend(value.args if isinstance(value, cls) else (value,))
        distinct = list(dict.fromkeys(flat))
        numbers = [v for v in distinct if v.is_number]
        if numbers:
            best = cls.pick(numbers)
            distinct = [v for v in distinct if not v.is_number] + [best]
        kept = [v for i, v in enumerate(distinct)
                if not any(j != i and cls.beats(other, v) and not (cls.beats(v, other) and j > i) for j, other in enumerate(distinct))]
        if len(kept) == 1:
            return kept[0]
        return cls(tuple(kept))

    def _print_order(self):
        return sorted(self._args, key=_sort_key)


class Max(_Lattice):
    name = sympy_name = "Max"
    largest = True


class Min(_Lattice):
    name = sympy_name = "Min"
    largest = False


# ---- quotients ------------------------------------------------------------------------------------


class Ratio:
    """A quotient of two polynomials that share no monomial or integer factor, kept apart so that
    it prints as one fraction: ``(257*d*q*x + 64*d*q + 325*q*x)/(256*d*q + 256*d*x)``."""

    __slots__ = ("numerator", "denominator")
    is_number = False

    def __init__(self, numerator: Expr, denominator: Expr):
        self.numerator = numerator
        self.denominator = denominator

    @property
    def free_symbols(self) -> set:
        return self.numerator.free_symbols | self.denominator.free_symbols

    def subs(self, mapping) -> Expr:
        return self.numerator.subs(mapping) / self.denominator.subs(mapping)

    def __eq__(self, other):
        return isinstance(other, Ratio) and (self.numerator, self.denominator) == (other.numerator, other.denominator)

    def __hash__(self):
        return hash((self.numerator, self.denominator))

    def __str__(self) -> str:
        def part(expr: Expr, alone: bool) -> str:
            text = str(expr)
            return text if alone else f"({text})"

        n, d = self.numerator, self.denominator
        d_alone = isinstance(d, Atom) or len(d.terms) == 1 and len(d.args) == 1  # q, q**2, Max(q, x)
        return f"{part(n, len(n.terms) == 1)}/{part(d, d_alone)}"

    __repr__ = __str__


def cancel(numerator, denominator) -> Expr | Ratio:
    """numerator / denominator as one fraction, their common monomial and integer factors
    divided out, fractions cleared and the denominator's leading sign positive: sympy's ``cancel``
    where the polynomials' greatest common divisor is a monomial (as FLOPs over bytes are); a
    common factor that is a sum stays."""
    n, d = _from_python(numerator), _from_python(denominator)
    if len(n.terms) <= 1 and len(d.terms) <= 1:
        return n / d
    coefficients = list(n.terms.values()) + list(d.terms.values())
    if any(isinstance(c, float) for c in coefficients):
        return n / d
    scale = math.lcm(*(Fraction(c).denominator for c in coefficients))
    monomials = list(n.terms) + list(d.terms)
    atoms = {atom for m in monomials for atom, _ in m}
    common = ONE
    for atom in atoms:
        lowest = min(dict(m).get(atom, 0) for m in monomials)
        if lowest:
            common = common * _power(atom, lowest)
    n, d = n * scale / common, d * scale / common
    content = math.gcd(*(int(c) for c in list(n.terms.values()) + list(d.terms.values())))
    n, d = n / content, d / content
    if next(iter(_ordered_terms(d)[0].terms.values())) < 0:
        n, d = -n, -d
    return n / d if d.is_number else Ratio(n, d)


# ---- numeric functions ------------------------------------------------------------------------------


def lambdify(symbols, exprs):
    """One compiled Python function of the symbols' values (positional, in order) that returns
    each expression's value as a float (a list for a list): the tuner's scorer, evaluated for
    every candidate, so it is Python source compiled once rather than a walk of the terms."""
    names = {s.name if isinstance(s, Symbol) else str(s): f"_{i}" for i, s in enumerate(symbols)}
    many = isinstance(exprs, (list, tuple))
    codes = [_python(_from_python(e), names) for e in (exprs if many else [exprs])]
    body = f"[{', '.join(codes)}]" if many else codes[0]
    source = f"def scorer({', '.join(names.values())}):\n    return {body}\n"
    scope = {"_ceil": math.ceil}
    exec(compile(source, "<napkin scorer>", "exec"), scope)  # noqa: S102 - napkin's own expressions
    return scope["scorer"]


def _python(expr: Expr, names: dict) -> str:
    """Python source of an expression over the variables ``names`` (symbol name -> variable)."""
    terms = []
    for monomial, coefficient in expr.terms.items():
        factors = [repr(float(coefficient))] if coefficient != 1 or not monomial else []
        for atom, e in monomial:
            base = _python_atom(atom, names)
            factors.append(base if e == 1 else f"{base}**{float(e)!r}" if isinstance(e, Fraction) else f"{base}**{e}")
        terms.append("*".join(factors))
    return f"({' + '.join(terms) or '0.0'})"


def _python_atom(atom, names: dict) -> str:
    if isinstance(atom, Symbol):
        if atom.name not in names:
            raise ValueError(f"{atom.name} is not a variable of the function (variables: {', '.join(names) or 'none'})")
        return names[atom.name]
    if isinstance(atom, Root):
        return repr(float(atom.base))
    if isinstance(atom, Group):
        return _python(atom.base, names)
    arguments = ", ".join(_python(a, names) for a in atom.args)
    return {"ceiling": f"_ceil({arguments})", "Max": f"max({arguments})", "Min": f"min({arguments})"}[atom.name]


def limit_at_infinity(expr: Expr, symbols) -> "Expr | _Infinity":
    """The expression as the given symbols (positive) grow without bound: a term with one of them
    under a negative power vanishes, one under a positive power makes the limit infinite."""
    names = {s.name for s in symbols}
    result, signs = ZERO, set()
    for monomial, coefficient in expr.terms.items():
        powers = [e for atom, e in monomial if isinstance(atom, Symbol) and atom.name in names]
        if any(a.free_symbols & set(symbols) for a, _ in monomial if not isinstance(a, Symbol)):
            raise NotImplementedError(f"the limit of {expr} when {', '.join(sorted(names))} grow: a function of them")
        if any(e < 0 for e in powers) and any(e > 0 for e in powers):
            raise NotImplementedError(f"the limit of {expr} when {', '.join(sorted(names))} grow: a term grows and falls")
        if any(e < 0 for e in powers):
            continue
        if powers:
            signs.add(1 if coefficient > 0 else -1)
            continue
        result = result + _build({monomial: coefficient})
    if len(signs) > 1:
        raise NotImplementedError(f"the limit of {expr} when {', '.join(sorted(names))} grow: infinity minus infinity")
    if signs:
        return oo if signs == {1} else NEG_OO
    return result


# ---- infinity ------------------------------------------------------------------------------------


class _Infinity:
    """``inf`` or ``-inf``: a value where() selects; it takes no arithmetic."""

    __slots__ = ("sign",)
    is_number = True
    is_Number = False
    is_infinite = True
    free_symbols: frozenset = frozenset()

    def __init__(self, sign: int):
        self.sign = sign

    def __neg__(self):
        return NEG_OO if self.sign > 0 else oo

    def __float__(self):
        return math.inf * self.sign

    def __str__(self):
        return "oo" if self.sign > 0 else "-oo"

    __repr__ = __str__

    def __eq__(self, other):
        if _is_sympy(other):
            return float(other) == float(self) if getattr(other, "is_infinite", False) else False
        return other is self or (isinstance(other, float) and other == float(self))

    def __hash__(self):
        return hash(float(self))

    def __lt__(self, other):
        return float(self) < float(other)

    def __gt__(self, other):
        return float(self) > float(other)

    def __le__(self, other):
        return float(self) <= float(other)

    def __ge__(self, other):
        return float(self) >= float(other)

    @property
    def is_positive(self):
        return self.sign > 0

    @property
    def is_negative(self):
        return self.sign < 0

    def _sympy_(self):
        import sympy

        return sympy.oo if self.sign > 0 else -sympy.oo

    def has(self, *things):
        return False


oo = _Infinity(1)
NEG_OO = _Infinity(-1)


# ---- printing as sympy does -------------------------------------------------------------------------

_NUMBER_CLASS = (1, 0, "Number")
_ONE_KEY = (_NUMBER_CLASS, (0, ()), (), Fraction(1))


def _number_key(value) -> tuple:
    return (_NUMBER_CLASS, (0, ()), (), Fraction(value))


def _class_key(atom) -> tuple:
    if isinstance(atom, Symbol):
        return (2, 0, "Symbol")
    if isinstance(atom, (Root,)):
        return _NUMBER_CLASS
    if isinstance(atom, Ceiling):
        return (4, 10000, "ceiling")
    if isinstance(atom, _Lattice):
        return (5, 0, atom.name)
    return (3, 1, "Add")  # a Group prints as its sum


def _atom_args_key(atom) -> tuple:
    if isinstance(atom, Symbol):
        return (1, (atom.name,))
    if isinstance(atom, Root):
        return (1, (str(atom.base),))
    if isinstance(atom, Group):
        keys = tuple(_sort_key(t) for t in _ordered_terms(atom.base))
        return (len(keys), keys)
    args = atom._print_order() if isinstance(atom, _Lattice) else atom.args
    keys = tuple(_sort_key(a) for a in args)
    return (len(keys), keys)


def _sort_key(expr) -> tuple:
    """sympy's ``default_sort_key`` of the expression, for the orderings its printer uses."""
    expr = _from_python(expr)
    r = expr.rational
    if r is not None:
        return _number_key(r)
    terms = expr.terms
    if len(terms) > 1:
        keys = tuple(_sort_key(t) for t in _ordered_terms(expr))
        return ((3, 1, "Add"), (len(keys), keys), _ONE_KEY, Fraction(1))
    ((monomial, coefficient),) = terms.items()
    coefficient_key = Fraction(coefficient)
    if len(monomial) == 1:
        atom, e = monomial[0]
        return (_class_key(atom), _atom_args_key(atom), _number_key(e), coefficient_key)
    factors = sorted((_power(a, e) for a, e in monomial), key=_sort_key)
    keys = tuple(_sort_key(f) for f in factors)
    return ((3, 0, "Mul"), (len(keys), keys), _ONE_KEY, coefficient_key)


def _generator(atom, e) -> tuple:
    """(generator, integer exponent) of atom^e as sympy's ``as_terms`` splits a power."""
    e = Fraction(e)
    return (atom, Fraction(1, e.denominator)), e.numerator


def _ordered_terms(expr: Expr) -> list:
    """The terms of a sum in the order sympy prints them (lex order over sorted generators)."""
    entries = []
    generators = set()
    for monomial, coefficient in expr.terms.items():
        powers = {}
        for atom, e in monomial:
            if isinstance(atom, Root):
                continue  # a number: part of the coefficient, which breaks ties below
            generator, k = _generator(atom, e)
            powers[generator] = k
            generators.add(generator)
        value = float(coefficient) * math.prod(float(a) ** float(e) for a, e in monomial if isinstance(a, Root))
        entries.append((powers, value, _build({monomial: coefficient})))
    order = sorted(generators, key=lambda g: _sort_key(_power(g[0], _number(g[1]))))
    def key(entry):
        powers, value, _ = entry
        return tuple(-powers.get(g, 0) for g in order), value
    ordered = [term for *_, term in sorted(entries, key=key)]
    if len(ordered) == 2:
        # sympy's special case: a positive number and a negative multiple of one factor print
        # number first (1 - 15*b/16).
        number = next((t for t in ordered if t.rational is not None), None)
        other = next((t for t in ordered if t is not number), None)
        if number is not None and number.rational > 0 and len(other.terms) == 1:
            ((monomial, coefficient),) = other.terms.items()
            if coefficient < 0 and len(monomial) == 1 and not isinstance(monomial[0][0], Root):
                return [number, other]
    return ordered


def _print_float(value: float) -> str:
    """A float as sympy prints a Float inside an expression: 15 significant digits, trailing
    zeros stripped, fixed notation for exponents -4 to 14 (0.00015, 123456.0), else 3.125e-15."""
    mantissa, exponent = f"{abs(value):.14e}".split("e")
    digits, power = mantissa.replace(".", ""), int(exponent)
    sign = "-" if value < 0 else ""
    if -5 < power < 15:
        whole = digits[: power + 1] if power >= 0 else "0"
        fraction = digits[power + 1 :] if power >= 0 else "0" * (-power - 1) + digits
        return f"{sign}{whole}.{fraction.rstrip('0') or '0'}"
    return f"{sign}{digits[0]}.{digits[1:].rstrip('0') or '0'}e{'+' if power > 0 else '-'}{abs(power)}"


def _print_sum(expr: Expr) -> str:
    r = expr.rational
    if r is not None:
        return str(r)
    if len(expr.terms) == 1:
        return _print_term(expr)
    pieces = []
    for term in _ordered_terms(expr):
        text = _print_term(term)
        if text.startswith("-"):
            pieces += ["-", text[1:]]
        else:
            pieces += ["+", text]
    sign = pieces.pop(0)
    return ("-" if sign == "-" else "") + " ".join(pieces)


def _print_factor(atom, e) -> str:
    """atom^e with e > 0 as sympy prints a factor."""
    base = str(atom)
    if isinstance(atom, Group):
        base = f"({base})"
    if e == 1:
        return base
    if e == Fraction(1, 2):
        return f"sqrt({str(atom)})"
    exponent = str(e) if isinstance(e, int) else f"({e})"
    return f"{base}**{exponent}"


def _print_term(term: Expr) -> str:
    """One monomial times its coefficient, as sympy's ``_print_Mul`` does."""
    ((monomial, coefficient),) = term.terms.items()
    if isinstance(coefficient, float):
        sign = "-" if coefficient < 0 else ""
        factors = sorted(monomial, key=lambda f: _sort_key(_power(*f)))
        numerator = [_print_float(abs(coefficient))] + [_print_factor(a, e) for a, e in factors if e > 0]
        denominator = [_print_factor(a, -e) for a, e in factors if e < 0]
        text = "*".join(numerator)
        if denominator:
            text += "/" + denominator[0] if len(denominator) == 1 else "/(" + "*".join(denominator) + ")"
        return sign + text
    c = Fraction(coefficient)
    sign = "-" if c < 0 else ""
    c = abs(c)
    if len(monomial) == 1 and c == 1 and not sign and monomial[0][1] < 0 and monomial[0][1] not in (-1, Fraction(-1, 2)):
        atom, e = monomial[0]
        return f"{_print_factor(atom, 1)}**({e})"  # a power alone: h**(-2), as sympy prints a Pow
    numerator, denominator = [], []
    if c.numerator != 1:
        numerator.append(str(c.numerator))
    if c.denominator != 1:
        denominator.append(str(c.denominator))
    factors = sorted(monomial, key=lambda f: _sort_key(_power(*f)))
    for atom, e in factors:
        if e > 0:
            numerator.append(_print_factor(atom, e))
        else:
            denominator.append(_print_factor(atom, -e))
    if not numerator:
        numerator = ["1"]
    text = "*".join(numerator)
    if len(denominator) == 1:
        text += "/" + denominator[0]
    elif denominator:
        text += "/(" + "*".join(denominator) + ")"
    return sign + text


# ---- parsing (for JSON round trips and tests) -------------------------------------------------------


def parse(text: str, symbol=None) -> Expr:
    """An expression from sympy-style text (``2*b*d*h*q*x + b*h*q*x``, ``Max(q, x)``): numbers,
    names (size symbols), + - * / ** ^, parentheses, ceiling/Max/Min/sqrt."""
    import ast

    symbol = symbol or (lambda name: Symbol(name, positive=True, integer=True))
    functions = {"ceiling": ceiling, "Max": Max.of, "Min": Min.of, "sqrt": lambda a: a ** Fraction(1, 2)}

    def walk(node):
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return _from_python(node.value)
        if isinstance(node, ast.Name):
            if node.id == "oo":
                return oo
            return symbol(node.id)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            inner = walk(node.operand)
            return -inner if isinstance(node.op, ast.USub) else inner
        if isinstance(node, ast.BinOp):
            left, right = walk(node.left), walk(node.right)
            ops = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
                   ast.Div: lambda a, b: a / b, ast.Pow: lambda a, b: a**b, ast.BitXor: lambda a, b: a**b}
            if type(node.op) in ops:
                return ops[type(node.op)](left, right)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in functions and not node.keywords:
            return functions[node.func.id](*(walk(a) for a in node.args))
        raise ValueError(f"not a size expression: {text!r}")

    try:
        tree = ast.parse(text.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"not a size expression: {text!r}") from None
    return walk(tree)
