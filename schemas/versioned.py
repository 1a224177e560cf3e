"""The base of every versioned pydantic message: the wire (``schemas.wire``) and the alerts
topic (``schemas.alert``).

A message carries ``schema_version`` ``"MAJOR.MINOR"``. A reader accepts every minor version
of the major version it knows (unknown fields are ignored, so a newer minor version still
parses) and refuses any other major version. Messages are frozen.
"""

from __future__ import annotations

from typing import ClassVar

from pydantic import BaseModel, ConfigDict, field_validator


class VersionedMessage(BaseModel):
    """A frozen pydantic model with a checked ``schema_version``.

    Subclasses set :attr:`schema_major` (the major version this build reads),
    :attr:`schema_label` (how the error names the schema) and the default of
    ``schema_version`` (the version this build writes).

    Raises:
        pydantic.ValidationError: (validation) ``schema_version`` is not ``"MAJOR.MINOR"``
            or names another major version.

    >>> class Note(VersionedMessage):
    ...     schema_major: ClassVar[int] = 2
    ...     schema_version: str = "2.0"
    >>> Note(schema_version="2.7").schema_version
    '2.7'
    >>> Note(schema_version="3.0")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    pydantic_core._pydantic_core.ValidationError: ...unsupported schema major version 3 ...
    """

    model_config = ConfigDict(extra="ignore", frozen=True)

    schema_major: ClassVar[int]
    """The major version this build reads."""
    schema_label: ClassVar[str] = "schema"
    """The schema's name in error messages ("schema", "alert schema")."""

    schema_version: str

    @field_validator("schema_version")
    @classmethod
    def _known_major(cls, value: str) -> str:
        major, _, minor = value.partition(".")
        if not (major.isdigit() and minor.isdigit()):
            raise ValueError(f"schema_version must look like 'MAJOR.MINOR', got {value!r}")
        if int(major) != cls.schema_major:
            raise ValueError(
                f"unsupported {cls.schema_label} major version {major} "
                f"(this build reads {cls.schema_major}.x)"
            )
        return value
