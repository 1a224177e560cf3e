"""RunStarted.ignore_layers on the wire (schema 1.5, older messages still valid) and the
pattern matching of schemas.health.match_layers."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from schemas.health import match_layers
from schemas.wire import RunStarted, decode_message, encode_message


def started(**over: object) -> dict[str, object]:
    return {"type": "run_started", "schema_version": "1.4", "run_id": "r", "world_size": 1,
            "layer_names": ["a.key.bias", "a.key.weight", "b[0]"], "numel": [1, 2, 3],
            "start_time": 1.0, **over}


def test_older_run_started_without_ignore_layers_is_valid() -> None:
    msg = decode_message(json.dumps(started()).encode())
    assert isinstance(msg, RunStarted) and msg.ignore_layers == []


def test_ignore_layers_round_trips_and_is_validated() -> None:
    msg = RunStarted.model_validate(started(ignore_layers=["*.key.bias"]))
    back = decode_message(encode_message(msg))
    assert isinstance(back, RunStarted) and back.ignore_layers == ["*.key.bias"]
    with pytest.raises(ValidationError, match="ignore_layers"):
        RunStarted.model_validate(started(ignore_layers=[""]))


def test_match_layers_is_fnmatch_on_whole_names() -> None:
    names = ["a.key.bias", "a.key.weight", "b[0]", "A.KEY.BIAS"]
    assert match_layers(names, ["*.key.bias"]).tolist() == [True, False, False, False]
    assert match_layers(names, ["a.*"]).tolist() == [True, True, False, False]
    assert match_layers(names, ["b[[]0]"]).tolist() == [False, False, True, False]
    assert match_layers(names, ["key"]).tolist() == [False] * 4  # whole name only
    assert not match_layers(names, []).any()
