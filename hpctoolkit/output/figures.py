"""How a figure reads on a line for people: the one home of its rounding.

Every human line (the roles' `[hpctoolkit...]` lines, the launcher's last line, the CLIs' reports,
`python -m hpctoolkit.status`) rounds through here: a loss or an acceptance length to 3 decimals,
seconds to 0.1, a rate to what a person compares. The JSON records (`summary.json`, `evaluate.json`,
the progress records) keep full precision. Pure standard library: `train` uses it on the GPU machine.
"""

from __future__ import annotations

import math

MISSING = "-"


def figure(x: object, digits: int = 3) -> str:
    """A loss, an acceptance length, a ratio: `digits` decimals; an int as it is; None as `-`."""
    if x is None:
        return MISSING
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return str(x)
    if isinstance(x, int):
        return str(x)
    if not math.isfinite(x):
        return str(x)
    return f"{x:.{digits}f}"


def seconds(x: object) -> str:
    """A wall time, to 0.1 s: `12.3s`."""
    if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x):
        return f"{x:.1f}s"
    return MISSING if x is None else str(x)


def rate(x: object) -> str:
    """Samples or tokens per second: 3 significant figures below 100, whole numbers above."""
    if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x):
        return f"{x:.0f}" if abs(x) >= 100 else f"{x:.3g}"
    return MISSING if x is None else str(x)


def duration(x: object) -> str:
    """A time to come (an ETA): `42s`, `3m05s`, `2h07m`; whole seconds (an estimate)."""
    if not isinstance(x, (int, float)) or isinstance(x, bool) or not math.isfinite(x):
        return MISSING if x is None else str(x)
    s = max(0, round(x))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"
