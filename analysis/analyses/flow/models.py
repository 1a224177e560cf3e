"""Report models of the gradient-flow network analysis (per-layer flow, flow network,
critical paths, regions, dead zones).

Field names follow the reference (trustformers-debug, module
``gradient_debugger::visualization``); the formula of every field is in its class docstring
and in :mod:`analysis.analyses.flow`. Collections keyed by layer name in the reference (``HashMap``)
are lists in model order here, each entry carrying its ``layer_name``.

Differences from the reference: the classes below state gradstream's rule and, where it
differs, the reference's; ``GradientVisualizationConfig.rules = "reference"`` applies the
reference's rules (:mod:`analysis.analyses.flow.reference`). The full list with reasons
is in :mod:`analysis.analyses.flow` and ``analysis/REFERENCE_DIFFERENCES.md``. Fields added here:
``layer_index``, ``samples``, ``blocked_fraction``, ``GradientDeadZone.affected_parameters``
and the report's run/range header; ``GradientVisualizationConfig`` adds ``alpha`` and
``rules``.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True)


class GradientDirection(_Model):
    """One sample of a layer's gradient flow.

    - ``step``: optimiser step of the sample.
    - ``magnitude``: ``grad_norm`` (L2 norm of the layer's finite gradient elements, merged
      over ranks).
    - ``consistency_score``: ``1 - |n_t - n_{t-1}| / (n_t + n_{t-1})`` against the layer's
      previous sample (as in the reference); 1.0 for the first sample in the range and for
      two zeros.

    The reference's ``direction_vector`` is left out: it is a placeholder (``vec![norm]``) and a
    gradient's direction needs the gradient vectors (or inner products between steps),
    which per-layer telemetry does not carry.
    """

    step: int
    magnitude: float
    consistency_score: float


class GradientLayerFlow(_Model):
    """Gradient flow of one layer over the step range (``GradientLayerFlow``).

    With ``n_1..n_N`` the layer's norms in step order:

    - ``gradient_magnitudes`` / ``gradient_directions``: the last ``temporal_window``
      samples (the visualisation window of the config; the statistics below use all N).
    - ``flow_consistency``: ``1 / (1 + mean_t |n_t - n_{t-1}| / n_{t-1})`` (as in the
      reference; a zero followed by non-zero counts as an infinite change, zero-to-zero as
      none); 1.0 for N < 2.
    - ``bottleneck_score``: ``1 - min(min_t n_t / mean_t n_t, 1)``; 1.0 if the mean is 0.
    - ``information_flow_rate``: ``sum_t |n_t - n_{t-1}| / N`` (norm units per step).
    - ``samples``: N; ``layer_index``: model-order index.
    """

    layer_name: str
    layer_index: int
    samples: int
    gradient_magnitudes: list[float]
    gradient_directions: list[GradientDirection]
    flow_consistency: float
    bottleneck_score: float
    information_flow_rate: float


class FlowDirection(StrEnum):
    """Where a layer's gradient magnitude is heading over the temporal window.

    Tested in this order; each layer at level ``alpha / L`` (Bonferroni over the L
    layers, so that the chance of any noise-only class in the whole model is ``alpha``):

    - ``Oscillating``: more direction reversals than an i.i.d. series would show
      (turning-point test, ``z`` above the two-sided critical value); an alternating
      series is the extreme.
    - ``Forward``: the least-squares slope of the norm against the step is significantly
      positive (t-test): the flow is strengthening (the reference's ``trend > 0``).
    - ``Backward``: significantly negative: the flow is weakening.
    - ``Stagnant``: neither: no reversal pattern and no trend beyond noise (including a
      constant, e.g. all-zero, layer, and windows of fewer than 3 samples).

    Reference (``rules="reference"``): from the last three samples only, ``trend = latest
    - oldest``: Stagnant if ``|trend| < 1e-6``, Forward if positive, else Oscillating if
    the two steps change sign, else Backward; Forward with fewer than three samples.
    Not the default: the sign of one difference of a noisy series is a coin toss, and
    1e-6 is in norm units.
    """

    FORWARD = "Forward"
    BACKWARD = "Backward"
    OSCILLATING = "Oscillating"
    STAGNANT = "Stagnant"


class TemporalGradientFlow(_Model):
    """A layer's latest flow state (``TemporalGradientFlow``).

    - ``step``: the layer's last step in the range (the reference: the ``current_step``
      argument); ``gradient_magnitude``: its norm there.
    - ``flow_direction``: :class:`FlowDirection` over the last ``temporal_window`` samples.
    - ``stability_score``: ``1 / (1 + std / mean)`` of the norm over the window (one over
      one plus the coefficient of variation; the reference's ``1 / (1 + variance)`` depends on
      the units of the norm); 1.0 for a constant window.
    """

    step: int
    layer_name: str
    gradient_magnitude: float
    flow_direction: FlowDirection
    stability_score: float


class NodeType(StrEnum):
    """Role of a layer in the flow network (first match wins).

    Gains are per-element: ``rms = grad_norm / sqrt(numel)``, edge gain
    ``g_t = rms_to / rms_from`` along backpropagation. With the edges' mean log gains
    and their Tukey fences (Q1 - 1.5 IQR, Q3 + 1.5 IQR):

    - ``Bottleneck``: the edge into this layer is Blocked or its mean log gain is below
      the lower fence: the gradient shrinks here far more than across other edges.
    - ``Amplifier``: the mean log gain into this layer is above the upper fence.
    - ``Source``: no incoming edge: the last layer in model order, where backpropagation
      starts.
    - ``Sink``: no outgoing edge: the first layer in model order, where it ends.
    - ``Normal``: otherwise.

    Reference (``rules="reference"``): from each layer's own series, Bottleneck if
    ``bottleneck_score > 0.8``, Amplifier if ``information_flow_rate > 1``, Sink if the sum
    of its norms is below 0.01, Source if a norm exceeds 10, else Normal. Not the default:
    the cut-offs are in norm units (they move with model size and loss scale), the sum grows
    with the number of steps, and no rule looks at the neighbours that make a node a
    bottleneck of a flow.
    """

    SOURCE = "Source"
    SINK = "Sink"
    BOTTLENECK = "Bottleneck"
    AMPLIFIER = "Amplifier"
    NORMAL = "Normal"


class FlowNode(_Model):
    """One layer as a node of the flow network (``FlowNode``).

    - ``gradient_strength``: mean of the layer's norms over the range (as in the reference).
    - ``connectivity``: edges of the flow network touching the node (its degree: 1 at the
      ends of the chain, 2 inside, 0 for a one-layer network); the reference's placeholder is
      the number of layers.
    - ``influence_score``: ``gradient_strength x flow_consistency`` (as in the reference).
    """

    layer_name: str
    layer_index: int
    node_type: NodeType
    gradient_strength: float
    connectivity: int
    influence_score: float


class EdgeType(StrEnum):
    """Kind of an edge (first match wins):

    - ``Blocked``: the receiving layer's gradient is exactly zero in at least half of the
      steps both layers report: no gradient passes this edge.
    - ``Intermittent``: ``flow_consistency < 1/2``, i.e. the per-step gain's standard
      deviation exceeds its mean: transmission comes and goes.
    - ``Strong``: ``flow_strength >= 1``: the per-element gradient does not shrink across
      the edge.
    - ``Weak``: ``flow_strength < 1``: it shrinks.

    Reference (``rules="reference"``, strength and consistency the means of the two
    layers' flow rate and flow consistency): Strong if strength > 1 and consistency > 0.8,
    Weak if strength < 0.1 or consistency < 0.3, Intermittent if consistency < 0.6, else
    Blocked (a fall-through that calls a moderate, consistent edge Blocked). Not the
    default: the mean of two layers' own variation says nothing about what passes between
    them.
    """

    STRONG = "Strong"
    WEAK = "Weak"
    INTERMITTENT = "Intermittent"
    BLOCKED = "Blocked"


class FlowEdge(_Model):
    """Edge between consecutive layers in backpropagation order (reverse model order):
    ``from_layer`` is layer ``i + 1``, ``to_layer`` layer ``i``.

    Over the steps where both layers report and have a non-zero gradient, with the
    per-element gain ``g_t = (n_to,t / sqrt(numel_to)) / (n_from,t / sqrt(numel_from))``:

    - ``flow_strength``: geometric mean of ``g_t`` (0.0 when no such step).
    - ``flow_consistency``: ``1 / (1 + std(g) / mean(g))`` (0.0 when no such step).
    - ``edge_type``: :class:`EdgeType`.
    - ``blocked_fraction``: share of the common steps with ``n_to = 0``.
    """

    from_layer: str
    to_layer: str
    flow_strength: float
    flow_consistency: float
    edge_type: EdgeType
    blocked_fraction: float


class NetworkMetrics(_Model):
    """Network-level flow metrics (``NetworkMetrics``).

    - ``overall_flow_efficiency``: mean ``flow_strength`` of the edges (as in the reference); 0
      without.
    - ``network_connectivity``: share of edges that are not Blocked (the reference's
      ``edges / (n (n-1))`` is a constant ``1 / n`` for a chain); 0 without edges.
    - ``bottleneck_density``: Bottleneck nodes / nodes (as in the reference).
    - ``flow_stability``: mean ``flow_consistency`` of the edges (as in the reference); 0
      without.
    - ``information_propagation_speed``: ``overall_flow_efficiency x
      network_connectivity`` (the reference's product, of measured factors).
    """

    overall_flow_efficiency: float
    network_connectivity: float
    bottleneck_density: float
    flow_stability: float
    information_propagation_speed: float


class GradientFlowNetwork(_Model):
    """Nodes (model order), edges (backpropagation order) and their metrics."""

    nodes: list[FlowNode]
    edges: list[FlowEdge]
    network_metrics: NetworkMetrics


class CriticalGradientPath(_Model):
    """A maximal run of consecutive non-Strong edges (Weak, Intermittent or Blocked) along
    backpropagation: a stretch where the gradient loses strength.

    - ``layers``: the layers along the path in backpropagation order;
      ``path_length``: their count.
    - ``total_flow_strength``: product of the edges' ``flow_strength``: the end-to-end
      per-element gain across the path (the reference sums them).
    - ``bottleneck_layers``: Bottleneck nodes on the path.
    - ``criticality_score``: ``1 - min(total_flow_strength, 1)``: the share of the
      per-element gradient magnitude lost across the path (reference placeholder: 0.8).
    - ``optimization_potential``: parameters (``numel``) of the path's layers / all
      parameters of the layers analysed: the share of the model a fix would reach.
    """

    path_id: str
    layers: list[str]
    path_length: int
    total_flow_strength: float
    bottleneck_layers: list[str]
    criticality_score: float
    optimization_potential: float


class RegionExtent(_Model):
    """Where a region lies: first and last layer (model order), parameters of its layers
    (sum of ``numel`` from RunStarted; the reference's placeholder is 1000) and
    ``duration_steps`` (definition per region kind)."""

    start_layer: str
    end_layer: str
    affected_parameters: int
    duration_steps: int


class VanishingSeverity(StrEnum):
    """Orders of magnitude the region's typical per-element gradient lies below the run's
    vanishing threshold: ``d = log10(threshold / typical)``, Mild ``d < 1``, Moderate
    ``d < 2``, Severe ``d < 3``, Critical ``d >= 3`` or gradients exactly zero."""

    MILD = "Mild"
    MODERATE = "Moderate"
    SEVERE = "Severe"
    CRITICAL = "Critical"


class ExplodingSeverity(StrEnum):
    """Orders of magnitude the region's largest gradient element lies above the run's
    exploding threshold: ``d = log10(peak / threshold)``, Mild ``d < 1``, Moderate
    ``d < 2``, Severe ``d < 3``, Critical ``d >= 3`` or any NaN/Inf gradient."""

    MILD = "Mild"
    MODERATE = "Moderate"
    SEVERE = "Severe"
    CRITICAL = "Critical"


class VanishingRegion(_Model):
    """Adjacent layers (model order) each vanishing in at least half of its steps (a step
    vanishes when ``mean_abs_grad < vanishing_threshold`` with no NaN/Inf, the run's frame
    rule; reference, ``rules="reference"``: one region per layer whose mean norm is below
    1e-5, Critical below 1e-7, else Moderate. Not the default: health, report and alerts
    judge vanishing by the run's threshold, and the analyses must agree with them).
    ``severity_level`` from the median over the layers of their geometric-mean
    per-element magnitude; ``extent.duration_steps``: steps at which every layer of the
    region that reported was vanishing."""

    region_id: str
    affected_layers: list[str]
    severity_level: VanishingSeverity
    extent: RegionExtent
    mitigation_suggestions: list[str]


class ExplodingRegion(_Model):
    """Adjacent layers (model order) each exploding (``max_abs_grad >
    exploding_threshold``) or non-finite in at least one step (reference: one region per
    layer whose largest norm is above 100, Critical above 1000, else Moderate).
    ``severity_level`` from the region's largest gradient element;
    ``extent.duration_steps``: steps at which at least one layer of the region exploded
    or was non-finite."""

    region_id: str
    affected_layers: list[str]
    severity_level: ExplodingSeverity
    extent: RegionExtent
    mitigation_suggestions: list[str]


class RecoveryPotential(StrEnum):
    """Whether a dead zone shows signs of coming back ("alive" = some layer of the zone
    has a non-zero gradient at that step):

    - ``High``: alive at the zone's last step in the range (it recovered on its own).
    - ``Medium``: dead at the last step but alive at some step of the later half of the
      range.
    - ``Low``: alive only in the earlier half.
    - ``None``: never alive in the range.
    """

    HIGH = "High"
    MEDIUM = "Medium"
    LOW = "Low"
    NONE = "None"


class GradientDeadZone(_Model):
    """Adjacent layers each with an exactly zero gradient (``grad_norm = 0``, no NaN/Inf)
    in at least half of its steps (reference: one zone per layer with norms below 1e-8 in
    more than half of its samples, recovery Low above 90 % else Medium, intervention above
    80 %).

    - ``dead_duration``: steps at which every layer of the zone that reported was dead.
    - ``recovery_potential``: :class:`RecoveryPotential`.
    - ``intervention_required``: the zone is dead at its last step (not High).
    - ``affected_parameters``: sum of the layers' ``numel``.
    """

    zone_id: str
    affected_layers: list[str]
    dead_duration: int
    recovery_potential: RecoveryPotential
    intervention_required: bool
    affected_parameters: int


class ColorScheme(StrEnum):
    """Colour scheme of renderings."""

    DEFAULT = "Default"
    HIGH_CONTRAST = "HighContrast"
    COLOR_BLIND = "ColorBlind"
    MONOCHROME = "Monochrome"


class GradientVisualizationConfig(_Model):
    """How the visualisation data is computed and drawn (the reference defaults).

    - ``show_temporal_flows`` / ``show_critical_paths`` / ``show_problem_regions``: compute
      (and draw) those sections; a hidden section is an empty list.
    - ``color_scheme``: :class:`ColorScheme`; ``palette`` gives its colours (hex) for
      node types, edge types and severities. ColorBlind is the Okabe-Ito palette (Okabe &
      Ito 2008, "Color Universal Design").
    - ``temporal_window``: samples per layer in ``gradient_magnitudes`` /
      ``gradient_directions`` and behind each ``flow_direction`` / ``stability_score``.
    - ``flow_threshold``: drawing cut-off: nodes whose ``gradient_strength`` is below this
      fraction of the strongest node's are drawn dimmed.
    - ``alpha``: significance level of the statistical tests (direction classes).
    - ``rules``: ``"gradstream"`` (default) or ``"reference"``: the reference's rules for
      flow directions, stability scores, node and edge types, network connectivity,
      regions and dead zones (:mod:`analysis.analyses.flow.reference`). Not a field of the
      reference's config.
    """

    show_temporal_flows: bool = True
    show_critical_paths: bool = True
    show_problem_regions: bool = True
    color_scheme: ColorScheme = ColorScheme.DEFAULT
    temporal_window: int = Field(default=50, ge=1)
    flow_threshold: float = Field(default=0.01, ge=0.0, le=1.0)
    alpha: float = Field(default=0.01, gt=0.0, lt=1.0)
    rules: Literal["gradstream", "reference"] = "gradstream"

    @property
    def palette(self) -> dict[str, str]:
        """Colour (``#rrggbb``) per category name of the chosen scheme."""
        return PALETTES[self.color_scheme]


_CATEGORIES = (
    "Source", "Sink", "Bottleneck", "Amplifier", "Normal",
    "Strong", "Weak", "Intermittent", "Blocked",
    "Mild", "Moderate", "Severe", "Critical",
)

_COLOURS: dict[ColorScheme, tuple[str, ...]] = {
    ColorScheme.DEFAULT: (
        "#1f77b4", "#7f7f7f", "#d62728", "#ff7f0e", "#2ca02c",
        "#2ca02c", "#bcbd22", "#ff7f0e", "#d62728",
        "#bcbd22", "#ff7f0e", "#d62728", "#8c0000",
    ),
    ColorScheme.HIGH_CONTRAST: (
        "#0000ff", "#808080", "#ff0000", "#ff00ff", "#00ff00",
        "#00ff00", "#ffff00", "#ff00ff", "#ff0000",
        "#ffff00", "#ff8000", "#ff0000", "#ff0000",
    ),
    ColorScheme.COLOR_BLIND: (
        "#0072b2", "#999999", "#d55e00", "#e69f00", "#009e73",
        "#009e73", "#f0e442", "#e69f00", "#d55e00",
        "#f0e442", "#e69f00", "#d55e00", "#cc79a7",
    ),
    ColorScheme.MONOCHROME: (
        "#ffffff", "#808080", "#404040", "#e0e0e0", "#c0c0c0",
        "#ffffff", "#a0a0a0", "#808080", "#404040",
        "#c0c0c0", "#a0a0a0", "#808080", "#606060",
    ),
}
"""Hex colours of each scheme, in the order of ``_CATEGORIES``."""

PALETTES: dict[ColorScheme, dict[str, str]] = {
    scheme: dict(zip(_CATEGORIES, colours, strict=True)) for scheme, colours in _COLOURS.items()
}
"""Colours of every :class:`ColorScheme` for the categories of node types, edge types and
severities."""


class GradientFlowVisualization(_Model):
    """The gradient-flow network analysis (``GradientFlowVisualization``) of one run over an
    inclusive step range.

    ``layer_flows`` and ``flow_network.nodes`` are in model order (``layer_index``),
    ``temporal_flows`` too; ``flow_network.edges`` in backpropagation order; regions and
    zones in model order of their first layer; critical paths by decreasing criticality.
    ``steps``: steps with data; ``layers``: layers with data in the range.
    ``ignore_layers``: the patterns applied (the run's own, then the reader's);
    ``layers_excluded``: the layers of the range they match, whose vanishing, exploding
    and dead flags count nowhere here (as in ``gradstream report``).
    """

    run_id: str
    from_step: int | None
    to_step: int | None
    steps: int
    layers: int
    layer_flows: list[GradientLayerFlow]
    temporal_flows: list[TemporalGradientFlow]
    flow_network: GradientFlowNetwork
    critical_paths: list[CriticalGradientPath]
    vanishing_regions: list[VanishingRegion]
    exploding_regions: list[ExplodingRegion]
    dead_zones: list[GradientDeadZone]
    visualization_config: GradientVisualizationConfig
    ignore_layers: list[str] = []
    layers_excluded: list[str] = []
