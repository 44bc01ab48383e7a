"""The base of every section of params.yaml, wherever its schema lives, and the value
types the sections share.

Each package owns the schema of the keys it reads (data/options.py, models/options.py,
objectives/__init__.py, config/sections.py); training.config composes them into one
`Config`. A shared base keeps their rules alike: a typo is an error, a number is finite,
a whole number fits the 64-bit integers torch, numpy and Arrow take, and a validated
section never changes. The annotated types below carry the rest of what is refused, so
that every port, seed, count, name and URL is checked the same way wherever it appears.
"""

from __future__ import annotations

import re
from typing import Annotated, Any
from urllib.parse import urlsplit

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator

INT64_MAX = 2**63 - 1
# torch.manual_seed takes up to 2**64 - 1, numpy's legacy seeding (np.random.seed, which
# libraries a user's model may call use) only below 2**32: the tighter bound for every seed.
SEED_MAX = 2**32 - 1
ONE_YEAR_S = 365 * 24 * 3600.0  # datetime.timedelta overflows far above; no wait is longer

# Names that MLflow's registry and Prefect both take, and that are safe inside a filter:
# letters, digits, '_', '-', '.' and spaces, starting with a letter or digit.
_NAME = re.compile(r"[^\W_][\w .-]*")


def _a_name(name: str) -> str:
    if name and (not _NAME.fullmatch(name) or ".." in name):
        raise ValueError(
            f"{name!r} is not a name the model registry takes (nor Prefect): use letters, "
            "digits, '_', '-', '.' and spaces, starting with a letter or digit (no '/', "
            "':', quotes or '..'), e.g. gradline-digits"
        )
    return name


def _an_experiment(name: str) -> str:
    # MLflow experiments may be paths ("/Shared/team/run"); quotes and control characters
    # would still break a search filter or a shell that is handed the name.
    if re.search(r"['\"\\`\x00-\x1f\x7f]", name):
        raise ValueError(
            f"{name!r} is not an experiment name MLflow searches safely: leave out quotes, "
            "backslashes and control characters (letters, digits, '_', '-', '.', '/' and "
            "spaces are fine)"
        )
    return name


def _a_web_url(url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(
            f"{url!r} is not a web address: give an http:// or https:// URL with a host, "
            "e.g. http://127.0.0.1:5000 (it becomes a link in summaries)"
        )
    try:
        parts.port  # noqa: B018 - raises on a port outside 0..65535
    except ValueError as exc:
        raise ValueError(f"{url!r}: {exc}; give a port from 1 to 65535") from None
    return url


Name = Annotated[str, Field(min_length=1, max_length=256), AfterValidator(_a_name)]
OptionalName = Annotated[str, Field(max_length=256), AfterValidator(_a_name)]  # "" is none
ExperimentName = Annotated[str, Field(min_length=1, max_length=500), AfterValidator(_an_experiment)]
WebUrl = Annotated[str, AfterValidator(_a_web_url)]
Port = Annotated[int, Field(ge=1, le=65535)]
Seed = Annotated[int, Field(ge=0, le=SEED_MAX)]
Seconds = Annotated[float, Field(le=ONE_YEAR_S)]  # a wait or timeout, at most a year
Fraction = Annotated[float, Field(ge=0.0, le=1.0)]
ThreadCount = Annotated[int, Field(ge=1, le=1024)]  # per worker: more cores than any node
WorkerCount = Annotated[int, Field(le=1024)]  # processes on one node
RetryCount = Annotated[int, Field(ge=0, le=1000)]  # a bound, so a typo cannot retry forever


class Section(BaseModel):
    # extra="forbid" turns a typo in params.yaml into an error instead of a silent default;
    # allow_inf_nan=False refuses nan and inf for every float key (an infinite learning
    # rate trains a model of NaNs that would still be registered).
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    @field_validator("*", mode="after")
    @classmethod
    def _fits_int64(cls, value: Any) -> Any:
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > INT64_MAX:
            raise ValueError(f"{value} does not fit a 64-bit integer (at most {INT64_MAX})")
        return value
