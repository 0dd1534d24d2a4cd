"""The rules every field of the experiment config follows (``pipeline.config.schema``'s sections): no
unknown key, numbers the libraries take (finite, 32-bit integers), model names timm can build, locations
that can be used, and no value that holds a secret echoed back in an error.
"""
from __future__ import annotations

import difflib
import math
from typing import Any

from pydantic import BaseModel, ConfigDict, field_validator
from pydantic_core import PydanticCustomError

from pipeline.uris import location_problem

# The largest integer any config value may hold: torch, numpy, numba (ffcv's loaders) and Optuna
# all take 32-bit counts and seeds; a larger one overflows inside a worker, long after validation.
MAX_INT = 2**31 - 1

# Error type of a value that must not be echoed back (it holds a secret).
SECRET_VALUE_ERROR = "secret_value"


def number_problem(value: Any) -> str | None:
    """Why a number inside a free-form value (``model.args``) cannot be passed on, else None."""
    if isinstance(value, float) and not math.isfinite(value):
        return f"{value} is not a finite number"
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_INT:
        return f"{value} is outside +-{MAX_INT}, the 32-bit range torch, numpy and ffcv take"
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return next((problem for item in value if (problem := number_problem(item))), None)
    return None


class Section(BaseModel):
    """A config section: unknown keys are errors (a misspelt key must never be silently ignored); values are
    re-validated when assigned so a config never holds an invalid value. inf and nan are refused in every
    float field (lr=1e400 would train, then "diverge")."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @field_validator("*", mode="after")
    @classmethod
    def _numbers_fit_the_libraries(cls, value: Any) -> Any:
        problem = number_problem(value)
        if problem:
            raise ValueError(problem)
        return value


def check_registered(name: str) -> str:
    """``name`` if timm (with vitsweep's variants) can build it, else a ValueError with close names."""
    import timm

    import models  # noqa: F401  (registers vitsweep's variants)

    if not timm.is_model(name):
        close = difflib.get_close_matches(name, timm.list_models(), n=5, cutoff=0.6)
        hint = f"; did you mean one of {close}" if close else ""
        raise ValueError(f"{name!r} is not a registered model{hint} (see `vitsweep models list`)")
    return name


def refuse_secretly(problem: str | None) -> None:
    """A validation error for ``problem`` that echoes neither the value nor the input: it may hold a secret."""
    if problem:
        raise PydanticCustomError(SECRET_VALUE_ERROR, problem)


def check_file(location: str | None) -> str | None:
    refuse_secretly(location_problem(location, kind="file"))
    return location


def check_directory(location: str | None) -> str | None:
    refuse_secretly(location_problem(location, kind="directory"))
    return location


def check_location(location: str | None) -> str | None:
    """A file or a directory (``model.init_from`` names either)."""
    refuse_secretly(location_problem(location))
    return location
