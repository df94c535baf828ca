"""The dtypes napkin knows: their sizes, aliases and families, defined once.

Layer 0: every stage reads these facts (the checker, the layouts, instruction selection, the
printers, the backends), so they live below all of them and import nothing of napkin's.
"""

from __future__ import annotations

DTYPE_BYTES = {
    "f64": 8, "f32": 4, "f16": 2, "bf16": 2, "fp8e4m3": 1, "fp8e5m2": 1, "i32": 4, "i64": 8,
}
DTYPE_ALIASES = {"fp8": "fp8e4m3"}
# Integer dtypes hold values computed from integer arrays only (the checker refuses a float
# value stored in one: napkin has no cast, and a store would silently round it).
INTEGER_DTYPES = ("i32", "i64")


# The 8-bit floats (OCP 8-bit floating point, v1.0): E4M3 has exponent bias 7, 3 mantissa bits,
# no infinity and one NaN pattern per sign (S.1111.111), so its largest value is 1.75 * 2^8 = 448;
# E5M2 has bias 15, 2 mantissa bits, infinities (S.11111.00) and NaNs, largest finite value
# 1.75 * 2^15 = 57344. Both have subnormals (2^-9 and 2^-16 the least). A kernel with an input of
# one is quantized; tensor cores take them on sm_89 and later.
FP8_DTYPES = ("fp8e4m3", "fp8e5m2")
# Napkin converts to an fp8 dtype *saturating* (PTX's cvt.rn.satfinite, the OCP spec's saturating
# mode), wherever a value is stored in one, in the reference and every backend: round to nearest
# even, then a finite value beyond the largest (and an infinity) becomes the largest of its sign;
# NaN stays NaN. (A plain ml_dtypes cast is not saturating: e4m3fn casts 465 to NaN and e5m2
# casts 61440 to inf.) So a quantized output ``O8 = O / sO`` with ``sO = amax / 448`` never
# overflows, whatever the last bit of ``amax / 448``.
FP8_MAX = {"fp8e4m3": 448.0, "fp8e5m2": 57344.0}


def canonical_dtype(name: str) -> str:
    return DTYPE_ALIASES.get(name, name)
