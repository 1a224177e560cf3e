"""Where the Apache Iceberg table set of a store is found: the contract between the process
that writes it (``consumer.outputs.iceberg``) and the readers (``analysis.read.iceberg``).

A store's tables live in a SQL catalog (pyiceberg's ``SqlCatalog``: a SQLAlchemy URL,
SQLite for one machine, PostgreSQL for a team) under one namespace, and their files in a
warehouse (``file://`` or ``s3://``). pyiceberg's SQL catalog keeps the tables of several
catalogs in one database, keyed by the catalog's name, so every process (and any other
engine) opens it under :data:`CATALOG_NAME`. S3 access comes from the standard AWS
environment variables (:data:`S3_ENVIRONMENT`).

Standard library only: every package may import it.
"""

from __future__ import annotations

from collections.abc import Mapping

CATALOG_NAME = "gradstream"
"""The SQL catalog's name: the ``catalog_name`` column of pyiceberg's ``iceberg_tables``
table, which keys the tables of one catalog inside a shared database."""

DEFAULT_NAMESPACE = "gradstream"
"""The namespace of a store's tables when none is named (the project's name: one namespace
holds one store's table set)."""

S3_ENVIRONMENT: dict[str, str] = {
    "AWS_ENDPOINT_URL": "s3.endpoint",
    "AWS_ACCESS_KEY_ID": "s3.access-key-id",
    "AWS_SECRET_ACCESS_KEY": "s3.secret-access-key",
    "AWS_SESSION_TOKEN": "s3.session-token",
    "AWS_REGION": "s3.region",
}
"""Standard AWS environment variables (AWS SDKs and CLI, "Environment variables to
configure the AWS CLI") -> the pyiceberg FileIO property that takes each (pyiceberg
configuration, "S3")."""


def s3_properties(environ: Mapping[str, str]) -> dict[str, str]:
    """pyiceberg FileIO properties from the AWS variables set in ``environ``
    (:data:`S3_ENVIRONMENT`); unset or empty variables are left out."""
    return {prop: environ[var] for var, prop in S3_ENVIRONMENT.items() if environ.get(var)}


COMMITTED_LAST: tuple[str, ...] = ("frames", "runs", "kafka_offsets")
"""Tables a write commits after every other table of the write, in this order (Iceberg has
no transaction over several tables): a ``frames`` row claims its rows stored, ``runs``
holds the counters after the batch, the offsets come last so that they are never ahead of
the data. A reader pins these tables' snapshots first, in the reverse order, so every
other table it reads afterwards holds at least the rows they claim."""
