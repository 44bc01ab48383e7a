"""The base of every section of params.yaml, wherever its schema lives.

Each package owns the schema of the keys it reads (data/options.py, models/options.py,
objectives/__init__.py, config/sections.py); training.config composes them into one
`Config`. A shared base keeps their rules alike: a typo is an error, and a validated
section never changes.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    # extra="forbid" turns a typo in params.yaml into an error instead of a silent default.
    model_config = ConfigDict(extra="forbid", frozen=True)
