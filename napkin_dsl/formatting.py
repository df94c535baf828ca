"""How napkin prints its counts: as JSON values and as the cells of a table.

Both the model (cost, tune) and the CLI print counts that may be symbolic, so the helpers live
here, below both. Deliberately not here: tables, units or layout (each report lays out its own).
Counts are expressions of napkin's size algebra (``algebra.py``), ints or floats.
"""

from __future__ import annotations

import decimal
import math

from . import algebra
from .errors import NapkinError

# Python prints at most 4300 digits (~14,000 bits) of an int; sizes are bounded so that no count
# gets near (check.MAX_SIZE), and json_value says so if one ever does.
MAX_JSON_BITS = 13_000


def json_value(expr):
    """A number when the expression is numeric, else its text (which algebra.parse, and sympy.sympify, read)."""
    if expr is None:
        return None
    if isinstance(expr, (bool, float)):
        return expr
    if not isinstance(expr, int):
        if not hasattr(expr, "is_number"):  # not an expression (or a Ratio) already
            expr = algebra.as_expr(expr)
        if not expr.is_number:
            return str(expr)
        if not expr.is_integer:
            return float(expr)
    value = int(expr)
    if value.bit_length() > MAX_JSON_BITS:
        raise NapkinError(f"a count of {value.bit_length():,} bits is too large to print as JSON", hint="use realistic sizes")
    return value


def format_count(value) -> str:
    """A count as a table shows it: "-" for none, integers with thousands separators, else 4 digits."""
    if value is None:
        return "-"
    if not hasattr(value, "is_number"):
        value = algebra.as_expr(value)
    if value.is_number:
        try:
            number = float(value)
        except OverflowError:
            number = math.inf
        if not math.isfinite(number):
            # Beyond float64: sizes are bounded (check.MAX_SIZE) so that no count gets here,
            # but a table must still print.
            return format(decimal.Decimal(int(value)), ".3e")
        if number == int(number) and abs(number) < 1e15:
            return f"{int(number):,}"
        return f"{number:.4g}"
    return str(value)
