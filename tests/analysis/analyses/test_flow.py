"""Gradient-flow network analysis over crafted histories in a real DuckDB file."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from analysis.analyses.flow import build_flow_visualization
from analysis.analyses.flow.models import (
    ColorScheme,
    EdgeType,
    ExplodingSeverity,
    FlowDirection,
    GradientFlowVisualization,
    GradientVisualizationConfig,
    NodeType,
    RecoveryPotential,
    VanishingSeverity,
)
from analysis.read.connect import StoreError
from tests.analysis.crafted import open_read, write_history


def flow_of(path: Path, run: str = "r", **kw: object) -> GradientFlowVisualization:
    con = open_read(path)
    try:
        return build_flow_visualization(con, run, **kw)  # type: ignore[arg-type]
    finally:
        con.close()


def test_layer_flow_metrics_by_hand(tmp_path: Path) -> None:
    """Norms 1, 2, 4: consistency 1 / (1 + (1/1 + 2/2)/2) = 1/2; bottleneck 1 - 1/(7/3)
    = 4/7; information flow rate (1 + 2)/3 = 1; per-step scores 1, 1 - 1/3, 1 - 2/6."""
    path = write_history(tmp_path / "s.duckdb", np.array([[1.0, 2.0, 4.0]]), steps=[5, 6, 7])
    report = flow_of(path)
    flow = report.layer_flows[0]
    assert flow.flow_consistency == pytest.approx(0.5)
    assert flow.bottleneck_score == pytest.approx(4 / 7)
    assert flow.information_flow_rate == pytest.approx(1.0)
    assert flow.gradient_magnitudes == [1.0, 2.0, 4.0]
    assert [d.step for d in flow.gradient_directions] == [5, 6, 7]
    assert [d.consistency_score for d in flow.gradient_directions] == pytest.approx(
        [1.0, 2 / 3, 2 / 3]
    )
    assert flow.samples == 3
    assert report.steps == 3 and report.layers == 1
    # A single layer: no edges, the node has no neighbour.
    assert report.flow_network.edges == []
    assert report.flow_network.nodes[0].connectivity == 0
    assert report.flow_network.nodes[0].influence_score == pytest.approx((7 / 3) * 0.5)


def test_temporal_window_limits_the_series_not_the_statistics(tmp_path: Path) -> None:
    norms = np.arange(1.0, 11.0)[None, :]
    path = write_history(tmp_path / "s.duckdb", norms)
    report = flow_of(path, config=GradientVisualizationConfig(temporal_window=4))
    flow = report.layer_flows[0]
    assert flow.gradient_magnitudes == [7.0, 8.0, 9.0, 10.0]
    assert flow.gradient_directions[0].consistency_score == pytest.approx(1 - 1 / 13)
    assert flow.information_flow_rate == pytest.approx(9 / 10)  # all ten samples


def test_directions_alternating_rising_falling_flat(tmp_path: Path) -> None:
    t = np.arange(60.0)
    norms = np.vstack([
        np.where(t % 2 == 0, 1.0, 3.0),  # alternating
        1.0 + 0.05 * t,                  # rising
        10.0 - 0.1 * t,                  # falling
        np.zeros(60),                    # flat zero
    ])
    path = write_history(tmp_path / "s.duckdb", norms, names=["alt", "up", "down", "flat"])
    report = flow_of(path)
    directions = {f.layer_name: f.flow_direction for f in report.temporal_flows}
    assert directions == {
        "alt": FlowDirection.OSCILLATING,
        "up": FlowDirection.FORWARD,
        "down": FlowDirection.BACKWARD,
        "flat": FlowDirection.STAGNANT,
    }
    latest = {f.layer_name: f for f in report.temporal_flows}
    assert latest["alt"].step == 59 and latest["alt"].gradient_magnitude == 3.0
    # stability 1 / (1 + CV): the alternating window has mean 2, std 1.
    assert latest["alt"].stability_score == pytest.approx(1 / (1 + 0.5))
    assert latest["flat"].stability_score == 1.0


def test_short_noisy_window_is_stagnant(tmp_path: Path) -> None:
    """Four alternating samples are too few to tell an oscillation from noise."""
    path = write_history(tmp_path / "s.duckdb", np.array([[1.0, 3.0, 1.0, 3.0]]))
    assert flow_of(path).temporal_flows[0].flow_direction is FlowDirection.STAGNANT


def test_flat_zero_layer_is_a_dead_zone_and_blocks_its_edge(tmp_path: Path) -> None:
    norms = np.vstack([np.zeros(20), np.full(20, 2.0), np.full(20, 1.0)])
    path = write_history(tmp_path / "s.duckdb", norms, names=["in", "mid", "out"],
                         numel=[10, 20, 30])
    report = flow_of(path)
    assert len(report.dead_zones) == 1
    zone = report.dead_zones[0]
    assert zone.affected_layers == ["in"]
    assert zone.dead_duration == 20
    assert zone.recovery_potential is RecoveryPotential.NONE
    assert zone.intervention_required
    assert zone.affected_parameters == 10
    edges = report.flow_network.edges
    assert [(e.from_layer, e.to_layer) for e in edges] == [("out", "mid"), ("mid", "in")]
    assert edges[1].edge_type is EdgeType.BLOCKED and edges[1].blocked_fraction == 1.0
    assert edges[1].flow_strength == 0.0
    nodes = {n.layer_name: n for n in report.flow_network.nodes}
    assert nodes["in"].node_type is NodeType.BOTTLENECK
    assert nodes["out"].node_type is NodeType.SOURCE
    assert [n.connectivity for n in report.flow_network.nodes] == [1, 2, 1]
    metrics = report.flow_network.network_metrics
    assert metrics.network_connectivity == pytest.approx(0.5)
    assert metrics.bottleneck_density == pytest.approx(1 / 3)
    # The all-zero layer also vanishes (mean |g| 0 < threshold), as a Critical region.
    assert [r.affected_layers for r in report.vanishing_regions] == [["in"]]
    assert report.vanishing_regions[0].severity_level is VanishingSeverity.CRITICAL


@pytest.mark.parametrize(
    ("alive_steps", "expected"),
    [
        ([19], RecoveryPotential.HIGH),       # alive again at the end
        ([14], RecoveryPotential.MEDIUM),     # alive in the later half, dead at the end
        ([2], RecoveryPotential.LOW),         # alive only in the earlier half
    ],
)
def test_recovery_potential(tmp_path: Path, alive_steps: list[int],
                            expected: RecoveryPotential) -> None:
    dead = np.zeros(20)
    dead[alive_steps] = 1.0
    norms = np.vstack([dead, np.ones(20)])
    report = flow_of(write_history(tmp_path / "s.duckdb", norms))
    (zone,) = report.dead_zones
    assert zone.recovery_potential is expected
    assert zone.intervention_required is (expected is not RecoveryPotential.HIGH)
    assert zone.dead_duration == 19


def test_adjacent_tiny_layers_form_one_vanishing_region(tmp_path: Path) -> None:
    """Layers 1-3 are tiny (mean |g| 1e-11, four decades below 1e-7): one region whose
    extent sums their numel; layer 5 (5e-8, within a decade) is a separate Mild region."""
    names = [f"blocks.{i}" for i in range(7)]
    numel = [100, 10, 20, 40, 100, 7, 100]
    mean = np.full((7, 12), 1e-3)
    mean[1:4] = 1e-11
    mean[5] = 5e-8
    norms = mean * np.sqrt(np.array(numel, float))[:, None]
    path = write_history(tmp_path / "s.duckdb", norms, names=names, numel=numel, mean_abs=mean)
    report = flow_of(path)
    regions = report.vanishing_regions
    assert [r.affected_layers for r in regions] == [names[1:4], [names[5]]]
    first, second = regions
    assert first.extent.start_layer == "blocks.1" and first.extent.end_layer == "blocks.3"
    assert first.extent.affected_parameters == 70
    assert first.extent.duration_steps == 12
    assert first.severity_level is VanishingSeverity.CRITICAL
    assert second.severity_level is VanishingSeverity.MILD
    assert second.extent.affected_parameters == 7
    assert first.region_id == "vanishing_1" and second.region_id == "vanishing_2"
    assert first.mitigation_suggestions
    assert report.exploding_regions == [] and report.dead_zones == []


def test_vanishing_needs_half_the_steps(tmp_path: Path) -> None:
    mean = np.full((2, 10), 1e-3)
    mean[0, :4] = 1e-9  # 40 % of the steps: not a vanishing layer
    mean[1, :5] = 1e-9  # 50 %: vanishing; duration 5
    norms = mean * 10.0
    report = flow_of(write_history(tmp_path / "s.duckdb", norms, mean_abs=mean))
    assert [r.affected_layers for r in report.vanishing_regions] == [["layer1"]]
    assert report.vanishing_regions[0].extent.duration_steps == 5


def test_norms_only_rows_fall_back_to_rms(tmp_path: Path) -> None:
    """Without mean |g| the per-element RMS decides: RMS = 1e-9 < 1e-7 vanishes."""
    norms = np.vstack([np.full(6, 1e-8), np.full(6, 1.0)])  # numel 100: RMS 1e-9 and 0.1
    report = flow_of(write_history(tmp_path / "s.duckdb", norms, norms_only=True))
    assert [r.affected_layers for r in report.vanishing_regions] == [["layer0"]]


def test_exploding_regions_and_severity(tmp_path: Path) -> None:
    peak = np.full((5, 8), 1.0)
    peak[1, 3] = 5e4        # 1.7 decades above 1e3: Moderate
    peak[2, 5] = 2e3        # adjacent: same region, duration counts both steps
    peak[4, 6] = 1e7        # 4 decades: Critical
    bad = np.zeros((5, 8), np.int64)
    norms = peak * 3.0
    report = flow_of(write_history(tmp_path / "s.duckdb", norms, max_abs=peak, nonfinite=bad))
    regions = report.exploding_regions
    assert [r.affected_layers for r in regions] == [["layer1", "layer2"], ["layer4"]]
    assert regions[0].severity_level is ExplodingSeverity.MODERATE
    assert regions[0].extent.duration_steps == 2
    assert regions[1].severity_level is ExplodingSeverity.CRITICAL
    bad[0, 0] = 3
    path = write_history(tmp_path / "t.duckdb", norms, max_abs=peak, nonfinite=bad)
    regions = flow_of(path).exploding_regions
    assert regions[0].affected_layers == ["layer0", "layer1", "layer2"]
    assert regions[0].severity_level is ExplodingSeverity.CRITICAL
    assert any("NaN/Inf" in s for s in regions[0].mitigation_suggestions)


def test_edges_follow_backprop_order_with_per_element_gains(tmp_path: Path) -> None:
    """Per-element gain = (n_to / sqrt(numel_to)) / (n_from / sqrt(numel_from))."""
    numel = [4, 1, 1]
    rms = np.vstack([np.full(10, 1.0), np.full(10, 0.5), np.full(10, 0.25)])
    norms = rms * np.sqrt(np.array(numel, float))[:, None]
    report = flow_of(write_history(tmp_path / "s.duckdb", norms, numel=numel,
                                   names=["emb", "hidden", "head"]))
    edges = report.flow_network.edges
    assert [(e.from_layer, e.to_layer) for e in edges] == [("head", "hidden"), ("hidden", "emb")]
    assert [e.flow_strength for e in edges] == pytest.approx([2.0, 2.0])
    assert all(e.edge_type is EdgeType.STRONG for e in edges)
    assert [e.flow_consistency for e in edges] == pytest.approx([1.0, 1.0])
    assert report.critical_paths == []
    nodes = [n.node_type for n in report.flow_network.nodes]
    assert nodes == [NodeType.SINK, NodeType.NORMAL, NodeType.SOURCE]
    assert report.flow_network.network_metrics.overall_flow_efficiency == pytest.approx(2.0)


def test_weak_stretch_is_a_critical_path(tmp_path: Path) -> None:
    """RMS per layer (model order) 0.01, 0.1, 1, 1, 1: the gain from layer 2 to 1 and from
    1 to 0 is 0.1, so the path 2 -> 1 -> 0 keeps 1 % of the gradient."""
    rms = np.array([0.01, 0.1, 1.0, 1.0, 1.0])[:, None] * np.ones((5, 10))
    names = ["l0", "l1", "l2", "l3", "l4"]
    report = flow_of(write_history(tmp_path / "s.duckdb", rms * 10.0, names=names))
    (path,) = report.critical_paths
    assert path.layers == ["l2", "l1", "l0"]
    assert path.path_length == 3
    assert path.total_flow_strength == pytest.approx(0.01)
    assert path.criticality_score == pytest.approx(0.99)
    assert path.optimization_potential == pytest.approx(3 / 5)
    assert path.path_id == "path_1"


def test_intermittent_edge(tmp_path: Path) -> None:
    """The receiving layer's gain swings between 0.05 and 4 (std above mean)."""
    t = np.arange(40)
    receiving = np.where(t % 4 == 0, 4.0, 0.05)
    norms = np.vstack([receiving, np.ones(40)])
    report = flow_of(write_history(tmp_path / "s.duckdb", norms))
    (edge,) = report.flow_network.edges
    assert edge.edge_type is EdgeType.INTERMITTENT
    assert edge.flow_consistency < 0.5


def test_model_order_not_name_order(tmp_path: Path) -> None:
    names = ["z.embed", "m.block", "a.head"]
    report = flow_of(write_history(tmp_path / "s.duckdb", np.ones((3, 5)), names=names))
    assert [f.layer_name for f in report.layer_flows] == names
    assert [n.layer_name for n in report.flow_network.nodes] == names
    assert [t.layer_name for t in report.temporal_flows] == names


def test_sparse_sampling_uses_each_layers_own_samples(tmp_path: Path) -> None:
    """A layer recorded every other step: consecutive samples are its own (1 -> 2 -> 4)."""
    norms = np.array([[1.0, np.nan, 2.0, np.nan, 4.0], [1.0, 1.0, 1.0, 1.0, 1.0]])
    report = flow_of(write_history(tmp_path / "s.duckdb", norms))
    sparse = report.layer_flows[0]
    assert sparse.samples == 3
    assert sparse.flow_consistency == pytest.approx(0.5)
    assert [d.step for d in sparse.gradient_directions] == [0, 2, 4]


def test_step_range_and_config_sections(tmp_path: Path) -> None:
    norms = np.vstack([np.r_[np.zeros(10), np.ones(10)], np.ones(20)])
    path = write_history(tmp_path / "s.duckdb", norms)
    late = flow_of(path, from_step=10)
    assert late.dead_zones == [] and late.steps == 10 and late.from_step == 10
    early = flow_of(path, to_step=9)
    assert early.dead_zones[0].recovery_potential is RecoveryPotential.NONE
    config = GradientVisualizationConfig(show_problem_regions=False, show_temporal_flows=False,
                                         color_scheme=ColorScheme.COLOR_BLIND)
    hidden = flow_of(path, config=config)
    assert hidden.dead_zones == [] and hidden.temporal_flows == []
    assert hidden.visualization_config.palette["Bottleneck"] == "#d55e00"


def test_errors(tmp_path: Path) -> None:
    path = write_history(tmp_path / "s.duckdb", np.ones((1, 3)))
    with pytest.raises(StoreError, match="unknown run"):
        flow_of(path, run="nope")
    with pytest.raises(StoreError, match="from_step"):
        flow_of(path, from_step=5, to_step=2)
    with pytest.raises(StoreError, match="no gradient rows"):
        flow_of(path, from_step=100)


def test_report_is_strict_json(tmp_path: Path) -> None:
    norms = np.vstack([np.zeros(8), np.linspace(1, 2, 8), np.full(8, 3.0)])
    report = flow_of(write_history(tmp_path / "s.duckdb", norms))

    def reject(value: str) -> float:
        raise ValueError(f"non-standard JSON constant {value}")

    document = json.loads(report.model_dump_json(), parse_constant=reject)
    assert set(document) >= {"layer_flows", "temporal_flows", "flow_network", "critical_paths",
                             "vanishing_regions", "exploding_regions", "dead_zones",
                             "visualization_config"}
    assert all(math.isfinite(n["gradient_strength"]) for n in document["flow_network"]["nodes"])


# -- the reference's rules (rules="reference"), answers worked out by hand from its formulas


def reference_case(tmp_path: Path) -> GradientFlowVisualization:
    norms = np.array([
        [1.0, 2.0, 4.0, 8.0],          # a: flow rate 7/4 > 1 -> Amplifier; rising -> Forward
        [1e-3] * 4,                    # b: sum 0.004 < 0.01 -> Sink; flat -> Stagnant
        [5.0, 5.0, 6.0, 4.0],          # c: Normal; 5, 6, 4 falls with a reversal -> Oscillating
        [20.0, 20.0, 20.0, 19.5],      # d: a norm > 10 -> Source; 20, 20, 19.5 -> Backward
        [10.0, 10.0, 10.0, 0.1],       # e: bottleneck 1 - 0.1 / 7.525 > 0.8 -> Bottleneck
        [1e-6] * 4,                    # f: mean 1e-6 < 1e-5 -> vanishing, Moderate
        [0.0, 0.0, 0.0, 1e-3],         # g: 3 of 4 below 1e-8 -> dead zone, Medium
        [50.0, 150.0, 50.0, 50.0],     # h: max 150 > 100 -> exploding, Moderate
    ])
    path = write_history(tmp_path / "s.duckdb", norms, names=list("abcdefgh"))
    return flow_of(path, config=GradientVisualizationConfig(rules="reference"))


def test_reference_node_types_and_directions(tmp_path: Path) -> None:
    report = reference_case(tmp_path)
    assert [n.node_type.value for n in report.flow_network.nodes] == [
        "Amplifier", "Sink", "Normal", "Source", "Bottleneck", "Sink", "Bottleneck",
        "Amplifier"]
    assert [t.flow_direction.value for t in report.temporal_flows] == [
        "Forward", "Stagnant", "Oscillating", "Backward", "Backward", "Stagnant", "Forward",
        "Backward"]
    # a: 1 / (1 + population variance of 1, 2, 4, 8) = 1 / (1 + 7.1875).
    assert report.temporal_flows[0].stability_score == pytest.approx(1 / 8.1875)
    assert report.visualization_config.rules == "reference"


def test_reference_edges_and_connectivity(tmp_path: Path) -> None:
    """Edge b -> a: strength (7/4 + 0) / 2 = 0.875, consistency (1/2 + 1) / 2 = 0.75:
    neither Strong, Weak nor Intermittent, so the reference's fall-through Blocked. Edge
    c -> b: strength (0 + 3/4) / 2, consistency (1 + 1 / (1 + (0 + 1/5 + 2/6) / 3)) / 2."""
    report = reference_case(tmp_path)
    edges = {(e.from_layer, e.to_layer): e for e in report.flow_network.edges}
    ba = edges[("b", "a")]
    assert (ba.flow_strength, ba.flow_consistency) == pytest.approx((0.875, 0.75))
    assert ba.edge_type is EdgeType.BLOCKED
    cb = edges[("c", "b")]
    c_consistency = 1 / (1 + (0 + 1 / 5 + 2 / 6) / 3)
    assert cb.flow_strength == pytest.approx(0.375)
    assert cb.flow_consistency == pytest.approx((1 + c_consistency) / 2)
    # h -> g: strength (50 + 1e-3 / 4) / 2 > 1, consistency of g about 3e-5: Weak.
    assert edges[("h", "g")].edge_type is EdgeType.WEAK
    assert report.flow_network.network_metrics.network_connectivity == pytest.approx(7 / 56)


def test_reference_regions_one_per_layer(tmp_path: Path) -> None:
    report = reference_case(tmp_path)
    assert [(r.affected_layers, r.severity_level) for r in report.vanishing_regions] == [
        (["f"], VanishingSeverity.MODERATE)]
    assert [(r.affected_layers, r.severity_level) for r in report.exploding_regions] == [
        (["h"], ExplodingSeverity.MODERATE)]
    (zone,) = report.dead_zones
    assert zone.affected_layers == ["g"] and zone.dead_duration == 3
    assert zone.recovery_potential is RecoveryPotential.MEDIUM
    assert zone.intervention_required is False  # 3/4 is not above 0.8
    assert report.vanishing_regions[0].extent.affected_parameters == 100
    assert report.vanishing_regions[0].extent.duration_steps == 4


@pytest.mark.parametrize(
    ("norms", "severity"),
    [([5e-8] * 3, VanishingSeverity.CRITICAL), ([1e-7] * 3, VanishingSeverity.MODERATE),
     ([1e-5] * 3, None)],
)
def test_reference_vanishing_cut_offs(
    tmp_path: Path, norms: list[float], severity: VanishingSeverity | None
) -> None:
    """Mean norm < 1e-7: Critical; < 1e-5: Moderate; 1e-5 itself: no region."""
    path = write_history(tmp_path / "s.duckdb", np.array([norms, [1.0] * 3]))
    report = flow_of(path, config=GradientVisualizationConfig(rules="reference"))
    assert [r.severity_level for r in report.vanishing_regions] == (
        [severity] if severity else [])


def test_reference_dead_zone_cut_offs(tmp_path: Path) -> None:
    """10 samples: 10 zeros -> Low (> 0.9), intervention; 9 -> Medium (0.9 is not above
    0.9), intervention (> 0.8); 6 -> Medium, no intervention; 5 -> no zone (0.5)."""
    rows = []
    for zeros in (10, 9, 6, 5):
        rows.append([0.0] * zeros + [1.0] * (10 - zeros))
    path = write_history(tmp_path / "s.duckdb", np.array(rows))
    report = flow_of(path, config=GradientVisualizationConfig(rules="reference"))
    assert [(z.affected_layers[0], z.recovery_potential, z.intervention_required)
            for z in report.dead_zones] == [
        ("layer0", RecoveryPotential.LOW, True), ("layer1", RecoveryPotential.MEDIUM, True),
        ("layer2", RecoveryPotential.MEDIUM, False)]


def test_reference_direction_needs_three_samples(tmp_path: Path) -> None:
    path = write_history(tmp_path / "s.duckdb", np.array([[3.0, 1.0]]))
    report = flow_of(path, config=GradientVisualizationConfig(rules="reference"))
    assert report.temporal_flows[0].flow_direction is FlowDirection.FORWARD
    assert report.temporal_flows[0].stability_score == 1.0
