"""MLflow search filters built from values, never by pasting a value into the text.

MLflow's filter grammar has no escape inside a quoted string: `name='it''s'` and
`name='it\\'s'` match nothing, and a backslash before the closing quote swallows it. A
value is therefore quoted with the quote it does not contain (MLflow takes `"` as well as
`'` around a string), and one it cannot be written with at all (both quotes, or a
backslash) is refused, naming it, rather than searched for wrongly. The config refuses
such names before training; this is the guard for every other way a value arrives
(a run id read back, a model name from an older params.yaml).
"""

from __future__ import annotations

import re

from training.errors import TrackingError

_KEY = re.compile(r"[A-Za-z_][\w.]*")


def quoted(value: str) -> str:
    """`value` as a string literal of MLflow's filter grammar."""
    if "\\" in value or re.search(r"[\x00-\x1f\x7f]", value):
        raise TrackingError(
            f"{value!r} cannot be searched for in MLflow: its filters have no escapes for "
            "a backslash or a control character; rename it without them"
        )
    if "'" not in value:
        return f"'{value}'"
    if '"' not in value:
        return f'"{value}"'
    raise TrackingError(
        f"{value!r} cannot be searched for in MLflow: its filters have no escapes, and "
        "the value holds both kinds of quote; rename it without quotes"
    )


def equals(**terms: str) -> str:
    """A filter matching every `key = value` given, e.g. equals(name=n, run_id=r)."""
    clauses = []
    for key, value in terms.items():
        if not _KEY.fullmatch(key):  # keys come from code, never from a user
            raise ValueError(f"not an MLflow filter key: {key!r}")
        clauses.append(f"{key} = {quoted(value)}")
    return " and ".join(clauses)
