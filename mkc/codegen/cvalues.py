"""Python → C++ value conversion: the one place where Python values become C++ source text.

Templates never format numbers themselves; every value they print went through one of these.
"""

from __future__ import annotations

import math
import re

_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_INT32 = (-(2**31), 2**31 - 1)


def c_int(v: int) -> str:
    """A 32-bit signed integer literal (raises on bool, non-integers and overflow)."""
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"c_int({v!r}): expected an int")
    if not _INT32[0] <= v <= _INT32[1]:
        raise ValueError(f"c_int({v}): does not fit a 32-bit int")
    return str(v)


def c_uint(v: int) -> str:
    """A 32-bit unsigned literal with the ``u`` suffix."""
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < 2**32:
        raise ValueError(f"c_uint({v!r}): expected an int in [0, 2^32)")
    return f"{v}u"


def c_float(v: float) -> str:
    """A finite float literal of type float that round-trips the float32 nearest to ``v``."""
    v = float(v)
    if not math.isfinite(v):
        raise ValueError(f"c_float({v}): expected a finite number")
    return f"{v!r}f" if ("e" in repr(v) or "." in repr(v)) else f"{v!r}.0f"


def c_bool(v: bool) -> str:
    if not isinstance(v, bool):
        raise TypeError(f"c_bool({v!r}): expected a bool")
    return "true" if v else "false"


def c_ident(name: str) -> str:
    """A C identifier, checked (names of opcodes, operand roles, arguments, constants)."""
    if not _IDENT.match(name):
        raise ValueError(f"c_ident({name!r}): not a C identifier")
    return name


def c_comment(text: str) -> str:
    """Text safe inside a ``//`` comment (one line, no trailing backslash)."""
    return " ".join(text.split()).rstrip("\\")
