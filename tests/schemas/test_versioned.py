"""The versioned-message base (schemas.versioned), shared by the wire and the alerts topic."""

from __future__ import annotations

import doctest

import pytest
from pydantic import ValidationError

import schemas.versioned
from schemas.alert import RunStatus
from schemas.wire import RunFinished


def test_doctests_run() -> None:
    result = doctest.testmod(schemas.versioned, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


def test_each_schema_checks_its_own_major_version() -> None:
    fields = {"run_id": "r", "rank": 0, "world_size": 1, "last_step": 1, "end_time": 1.0}
    assert RunFinished(schema_version="1.99", **fields).schema_version == "1.99"
    with pytest.raises(ValidationError, match=r"unsupported schema major version 2 "):
        RunFinished(schema_version="2.0", **fields)
    with pytest.raises(ValidationError, match=r"must look like 'MAJOR\.MINOR'"):
        RunFinished(schema_version="1", **fields)
    with pytest.raises(ValidationError, match=r"unsupported alert schema major version 3 "):
        RunStatus.model_validate({"schema_version": "3.0"})
