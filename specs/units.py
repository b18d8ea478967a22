"""Numbers for the console in the unit their magnitude calls for (issue 25: "peak 0.0 GiB" on
local_cpu): bytes in GiB / MiB / KiB / B, seconds in s / ms / µs / ns. Pure; the planners' summary
lines use these so a CPU-sized run reads as plainly as a GPU-sized one."""
from __future__ import annotations

#: binary byte units, largest first: the first whose size the magnitude reaches is shown
BYTE_UNITS = (("GiB", float(1 << 30)), ("MiB", float(1 << 20)), ("KiB", float(1 << 10)))
#: time units, largest first (seconds per unit)
TIME_UNITS = (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6))


def size_text(nbytes: float, digits: int = 2) -> str:
    """``nbytes`` in its own unit: 8.5e9 -> '7.92 GiB', 1_163_264 -> '1.11 MiB'; under 1 KiB
    whole bytes ('512 B')."""
    for unit, scale in BYTE_UNITS:
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.{digits}f} {unit}"
    return f"{nbytes:.0f} B"


def time_text(seconds: float, digits: int = 3) -> str:
    """``seconds`` in its own unit with ``digits`` significant digits (more for whole seconds past
    them): 0.102 -> '102 ms', 8.718 -> '8.72 s', 3.2e-5 -> '32.0 µs', 0.99996 -> '1.00 s'; 0 ->
    '0 s'; under 1 µs in whole nanoseconds."""
    if seconds == 0:
        return "0 s"
    rounded = float(f"{seconds:.{digits}g}")  # round first: 0.99996 s is 1.00 s, not 1000 ms
    for unit, scale in TIME_UNITS:
        if abs(rounded) >= scale:
            decimals = max(digits - len(str(int(abs(rounded / scale)))), 0)
            return f"{seconds / scale:.{decimals}f} {unit}"
    return f"{seconds * 1e9:.0f} ns"
