"""Producer configuration (pydantic-settings): arguments, else ``GRADSTREAM_*`` / ``KAFKA_*``
environment variables, else these defaults."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator
from pydantic_settings import NoDecode

from producer.flight_recorder import DEFAULT_MAX_BYTES
from schemas.kafka_settings import KafkaClientSettings
from schemas.topics import DEFAULT_SUMMARIES_TOPIC


class ProducerSettings(KafkaClientSettings):
    """Settings of :class:`producer.GradientProducer`.

    Kafka settings suit many small messages: ``acks=all`` with idempotence (no duplicates,
    no reordering per rank on retry), zstd compression, a short ``linger_ms`` so a step's
    message leaves within milliseconds. ``queue_size`` bounds the summaries waiting for
    the sender thread; when full, ``record_step`` waits at most ``enqueue_timeout_s``
    (default 0: never) for room, then the oldest pending summary is dropped and counted.

    Selection: ``include`` / ``exclude`` are glob patterns (``fnmatch``, e.g.
    ``"encoder.*"``) on layer names; a layer is watched when it matches an include pattern
    (or there are none) and no exclude pattern. ``every_n_steps`` sends the steps divisible
    by n. From the environment, patterns are comma-separated:
    ``GRADSTREAM_INCLUDE="encoder.*,decoder.*"``.

    ``mode``: ``"full"`` (default) sends per layer sum |g|, sum g^2, max |g| and the
    non-finite count; ``"norms"`` (``GRADSTREAM_MODE=norms``) sends only sum g^2 and the
    non-finite count: 40% fewer bytes per layer and, with the PyTorch adapter, one norm
    kernel per layer instead of three. In norms mode the consumer flags a layer vanishing
    when its RMS ``sqrt(sum g^2 / numel)`` is below the vanishing threshold (then
    mean |g| <= RMS is too) and exploding when its RMS exceeds the exploding threshold
    (then max |g| >= RMS does too): every flag is certain, but a layer whose few large
    elements cross the threshold while its RMS does not is missed (``consumer.frames``).

    Richer statistics, off by default (their cost is measured by
    ``bench/producer_overhead.py``): ``exp_histogram`` sends each layer's base-2 exponent
    histogram (how much of the gradient would underflow in fp16/bf16); ``weight_stats``
    sends sum w^2 of the weights passed to ``record_step(..., weights=...)`` and the
    squared norm of the update since the previous recorded step, for which the producer
    keeps one float32 copy of the watched weights.

    ``wire_format``: ``"binary"`` (default) sends each StepSummary in the columnar binary
    form (``schemas.wire.encode_binary``: typed little-endian buffers in a safetensors
    container, about a third smaller than JSON and decoded without parsing numbers);
    ``"json"`` (``GRADSTREAM_WIRE_FORMAT=json``) sends JSON, e.g. for consumers older than
    this build. RunStarted and RunFinished are always JSON.

    Local view (the statistics of a rank's own gradient before the cross-rank reduction,
    given as ``record_step(..., local_gradients=...)``, ``record_summaries`` with
    ``summaries.local`` or ``record_local``): ``local_view="recorder"`` (default,
    ``GRADSTREAM_LOCAL_VIEW``) keeps it in the rank's flight recorder
    (:mod:`producer.flight_recorder`): the last ``local_view_steps`` entries (and at most
    ``local_view_max_bytes`` bytes of them), sent as ``LocalSummary`` messages only when a
    local trigger fires (NaN/Inf, a max |g| above the run's exploding threshold, a total
    norm above ``spike_factor`` times the median of the previous ones), and every
    ``local_view_sample_every`` steps (0: never) the newest entry as a sparse baseline.
    ``local_view="every_step"`` sends it every step inside the StepSummary (the local
    view of schema 1.3; ``record_local`` then sends a ``LocalSummary`` per step).

    ``partition_key``: how records are keyed on the summaries topic
    (``producer.transport.kafka.record_key``; ``GRADSTREAM_PARTITION_KEY``). ``"run"``
    (default): every message carries the run id, so a run lands in one partition and one
    worker merges all of it, in step order per rank: what the single-process
    ``gradstream consume --db`` mode wants (its health window and streak rules follow the
    run's steps as they arrive). ``"step"``: a StepSummary is keyed ``run_id/step``, so all
    ranks and parts of one step share a partition (one worker merges each frame) while
    the steps of one run spread over the partitions and the workers of a consumer group;
    meant for scale-out workers (``gradstream consume --frames-topic``), where the store
    writer puts the frames of a run back in step order before the per-run ordered work.
    RunStarted, RunFinished and LocalSummary keep the run-id key in both modes.

    Message size: a StepSummary larger than the cluster's limit (the topic's
    ``max.message.bytes``, read once when connecting; ``message_max_bytes`` when it cannot
    be read), and never larger than ``max_request_size``, is split into several messages
    holding disjoint layer ranges, which the consumer merges. A record refused as too
    large would otherwise break an idempotent producer for every later send.
    """

    topic: str = DEFAULT_SUMMARIES_TOPIC
    acks: Literal["all", "1", "0"] = "all"
    enable_idempotence: bool = True
    compression_type: Literal["zstd", "lz4", "gzip", "none"] = "zstd"
    linger_ms: int = Field(default=0, ge=0)
    batch_size: int = Field(default=256 * 1024, gt=0)
    max_request_size: int = Field(default=20 * 1024 * 1024, gt=0)
    delivery_timeout_ms: int = Field(default=120_000, gt=0)
    request_timeout_ms: int = Field(default=30_000, gt=0)
    max_block_ms: int = Field(default=60_000, gt=0)
    queue_size: int = Field(default=1024, gt=0)
    enqueue_timeout_s: float = Field(default=0.0, ge=0)
    close_timeout_s: float = Field(default=30.0, ge=0)
    include: Annotated[list[str], NoDecode] = Field(default_factory=list)
    exclude: Annotated[list[str], NoDecode] = Field(default_factory=list)
    every_n_steps: int = Field(default=1, gt=0)
    mode: Literal["full", "norms"] = "full"
    exp_histogram: bool = False
    weight_stats: bool = False
    wire_format: Literal["binary", "json"] = "binary"
    message_max_bytes: int = Field(default=1024 * 1024, gt=0)
    local_view: Literal["recorder", "every_step"] = "recorder"
    local_view_steps: int = Field(default=32, gt=0)
    local_view_max_bytes: int = Field(default=DEFAULT_MAX_BYTES, gt=0)
    local_view_sample_every: int = Field(default=0, ge=0)
    spike_factor: float = Field(default=10.0, gt=1.0, allow_inf_nan=False)
    partition_key: Literal["run", "step"] = "run"

    @field_validator("include", "exclude", mode="before")
    @classmethod
    def _patterns(cls, value: object) -> object:
        """Accept a comma-separated string (environment) as well as a list."""
        if isinstance(value, str):
            return [p.strip() for p in value.split(",") if p.strip()]
        return value
