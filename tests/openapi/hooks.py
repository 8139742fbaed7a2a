"""Schemathesis hooks for tests/tests/openapi.rs (loaded through SCHEMATHESIS_HOOKS).

A `wait` the sidecar accepts makes a request wait that long for a lock it may never get (a long
poll on a free on-demand lock, a key another generated owner holds). Valid waits above 100 ms
are sent as 100 ms so that the run takes seconds rather than hours; waits past the 5-minute
bound are sent as generated, so that their refusal is still tested.
"""

import re

import schemathesis

UNITS = {
    "nanos": 1e-9, "nsec": 1e-9, "ns": 1e-9,
    "usec": 1e-6, "us": 1e-6, "µs": 1e-6,
    "millis": 1e-3, "msec": 1e-3, "ms": 1e-3,
    "seconds": 1, "second": 1, "secs": 1, "sec": 1, "s": 1,
    "minutes": 60, "minute": 60, "mins": 60, "min": 60, "m": 60,
    "hours": 3600, "hour": 3600, "hrs": 3600, "hr": 3600, "h": 3600,
    "days": 86400, "day": 86400, "d": 86400,
    "weeks": 604800, "week": 604800, "wks": 604800, "wk": 604800, "w": 604800,
    "months": 2630016, "month": 2630016, "M": 2630016,
    "years": 31557600, "year": 31557600, "yrs": 31557600, "yr": 31557600, "y": 31557600,
}
PART = re.compile(r"([0-9]+(?:\.[0-9]+)?)([a-zA-Zµ]+)")
LONGEST_WAIT = 300.0
SHORT_WAIT = "100ms"


def seconds(value):
    """The duration `value` names, in seconds, or None when it is not one."""
    if value == "0":
        return 0.0
    total, end = 0.0, 0
    for part in PART.finditer(value):
        if part.start() != end or part.group(2) not in UNITS:
            return None
        total += float(part.group(1)) * UNITS[part.group(2)]
        end = part.end()
    return total if end == len(value) and end > 0 else None


@schemathesis.hook
def before_call(context, case, kwargs):
    query = case.query
    if not isinstance(query, dict):
        return
    wait = query.get("wait")
    if isinstance(wait, str):
        waited = seconds(wait)
        if waited is not None and 0.1 < waited <= LONGEST_WAIT:
            query["wait"] = SHORT_WAIT
