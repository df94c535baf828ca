"""How napkin prints its counts: as JSON values and as the cells of a table.

Both the model (cost, tune) and the CLI print counts that may be symbolic, so the helpers live
here, below both. Deliberately not here: tables, units or layout (each report lays out its own).
sympy is imported when an expression needs it, so that importing this module stays cheap.
"""

from __future__ import annotations

import math

from .errors import NapkinError

# Python prints at most 4300 digits (~14,000 bits) of an int; sizes are bounded so that no count
# gets near (check.MAX_SIZE), and json_value says so if one ever does.
MAX_JSON_BITS = 13_000


def json_value(expr):
    """A number when the expression is numeric, else a string sympy.sympify parses."""
    if expr is None:
        return None
    if isinstance(expr, (bool, float)):
        return expr
    if not isinstance(expr, int):
        import sympy

        expr = sympy.sympify(expr)
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
    import sympy

    value = sympy.sympify(value)
    if value.is_number:
        number = float(value)
        if not math.isfinite(number):
            # Beyond float64: sizes are bounded (check.MAX_SIZE) so that no count gets here,
            # but a table must still print; sympy's own float has no exponent limit.
            return str(sympy.N(value, 4))
        if number == int(number) and abs(number) < 1e15:
            return f"{int(number):,}"
        return f"{number:.4g}"
    return str(value)
