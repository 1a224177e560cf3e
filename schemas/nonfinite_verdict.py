"""The non-finite verdict option: how a NaN/Inf gradient counts in a run's health
(``--nonfinite-rule``, ``GRADSTREAM_NONFINITE_RULE``).

Defined once here, with nothing but the standard library, so that the command line can
offer the same choices without loading pydantic or NumPy (``schemas`` re-exports its wire
models lazily). :mod:`schemas.health` applies the verdict and re-exports these names.
"""

from __future__ import annotations

from typing import Literal, get_args

NonfiniteVerdict = Literal["critical", "reference"]
"""How a NaN/Inf gradient counts in the run's health (``--nonfinite-rule``)."""

NONFINITE_VERDICTS: tuple[NonfiniteVerdict, ...] = get_args(NonfiniteVerdict)
"""The non-finite verdict options, in the order of :data:`NonfiniteVerdict`:

- ``"critical"`` (default; gradstream's addition to the reference's rule,
  trustformers-debug ``gradient_flow``): a layer with NaN/Inf gradient elements makes its
  frame an issue frame and the run Critical, whatever else the frame shows.
- ``"reference"``: the reference's verdicts exactly. It has no non-finite
  rule; its values decide: a NaN element makes mean |g| and the norm NaN (NaN is never
  below the vanishing threshold) and is ignored by max |g|, so a layer with NaN only is
  neither vanishing nor exploding; an Inf element makes max |g| inf, so the layer is
  exploding. Needs the NaN/Inf split of each non-finite layer (the wire's ``nan``
  count): the live consumer keeps the ``"critical"`` verdict for a layer whose split
  is unknown, and the stored-run report refuses such a range with an error.
"""


def check_nonfinite_verdict(verdict: str) -> NonfiniteVerdict:
    """``verdict`` if it is one of :data:`NONFINITE_VERDICTS`.

    Args:
        verdict: the option's value as given (``--nonfinite-rule``, a setting, a query
            parameter).

    Raises:
        ValueError: any other value (the message lists the valid ones).
    """
    if verdict not in NONFINITE_VERDICTS:
        raise ValueError(
            f"nonfinite_rule must be one of {', '.join(NONFINITE_VERDICTS)}, got {verdict!r}")
    return verdict  # type: ignore[return-value]
