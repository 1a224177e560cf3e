"""``gradstream analyze``: crafted stores, the demo's runs through the real broker, and
weight statistics sent by real producers."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import duckdb
import numpy as np
import pytest
import typer
from typer.testing import CliRunner

from deploy.cli.analyze import register
from tests.analysis.crafted import write_history


def strict_json(text: str) -> dict:
    def reject(value: str) -> float:
        raise ValueError(f"non-standard JSON constant {value}")

    return json.loads(text, parse_constant=reject)


@pytest.fixture
def app() -> typer.Typer:
    app = typer.Typer()
    register(app)

    @app.callback()
    def _root() -> None:  # keep "analyze" a subcommand of this test app
        """test root"""

    return app


@pytest.fixture
def crafted(tmp_path: Path) -> Path:
    t = np.arange(40)
    norms = np.vstack([np.zeros(40), np.where(t % 2 == 0, 1.0, 3.0), np.full(40, 2.0)])
    norms[2, 30] = 5e3
    weights = {(i, s): np.random.default_rng(i + s).normal(0, 1, 50) for i in range(3)
               for s in (0, 39)}
    return write_history(tmp_path / "c.duckdb", norms, names=["in", "mid", "out"],
                         numel=[50, 50, 50], weights=weights, max_abs=norms)


def invoke(app: typer.Typer, *args: str) -> object:
    return CliRunner().invoke(app, ["analyze", *args])


@pytest.mark.parametrize("kind", ["flow", "enhanced", "explosion", "weights"])
def test_every_kind_as_json_and_table(app: typer.Typer, crafted: Path, kind: str) -> None:
    result = invoke(app, "--db", str(crafted), "--kind", kind, "--format", "json")
    assert result.exit_code == 0, result.output
    document = strict_json(result.stdout)
    assert document["run_id"] == "r"
    table = invoke(app, "--db", str(crafted), "--kind", kind)
    assert table.exit_code == 0, table.output
    assert "run r" in table.stdout
    if kind == "flow":
        assert document["dead_zones"][0]["affected_layers"] == ["in"]
        assert "dead_zone_1" in table.stdout
    elif kind == "enhanced":
        names = [d["layer_name"] for d in document["layer_details"]]
        assert names == ["in", "mid", "out"]
        assert document["network_level_analysis"]["overall_gradient_health"] == "Critical"
        assert "optimisation priorities" in table.stdout
    elif kind == "explosion":
        assert [x["layer_name"] for x in document["exploding_layers"]] == ["out"]
        assert document["first_explosion_step"] == 30
        # 5e3 is 5 x the threshold (Medium); one layer of three (> 0.3) makes it High.
        assert document["exploding_layers"][0]["severity"] == "Medium"
        assert document["overall_severity"] == "High" and "High" in table.stdout
    else:
        assert document["distribution"]["step"] == 39
        assert document["drift"]["from_step"] == 0
        assert "weight drift" in table.stdout


def test_options_reach_the_analyses(app: typer.Typer, crafted: Path) -> None:
    result = invoke(app, "--db", str(crafted), "--kind", "explosion", "--threshold", "1.5",
                    "--format", "json", "--to-step", "20")
    document = strict_json(result.stdout)
    assert document["threshold"] == 1.5 and document["to_step"] == 20
    assert [x["layer_name"] for x in document["exploding_layers"]] == ["mid", "out"]
    flow = strict_json(invoke(app, "--db", str(crafted), "--kind", "flow", "--window", "5",
                              "--color-scheme", "ColorBlind", "--format", "json").stdout)
    assert flow["visualization_config"]["temporal_window"] == 5
    assert flow["visualization_config"]["color_scheme"] == "ColorBlind"
    assert len(flow["layer_flows"][1]["gradient_magnitudes"]) == 5
    enhanced = strict_json(invoke(app, "--db", str(crafted), "--kind", "enhanced", "--window",
                                  "10", "--interaction-window", "1", "--alpha", "0.05",
                                  "--format", "json").stdout)
    assert (enhanced["convergence_window"], enhanced["interaction_window"]) == (10, 1)
    assert enhanced["alpha"] == 0.05
    assert len(enhanced["network_level_analysis"]["layer_interactions"]) == 2


@pytest.mark.parametrize("kind", ["flow", "enhanced", "explosion", "weights"])
def test_reference_rules_option(app: typer.Typer, crafted: Path, kind: str) -> None:
    """``--option rules=reference`` reaches every analysis (JSON and table); an unknown
    rule set is refused before the store is read."""
    result = invoke(app, "--db", str(crafted), "--kind", kind, "--option", "rules=reference",
                    "--format", "json")
    assert result.exit_code == 0, result.output
    document = strict_json(result.stdout)
    rules = (document["visualization_config"]["rules"] if kind == "flow"
             else document["rules"])
    assert rules == "reference"
    if kind == "explosion":
        # 5e3 against the running mean of the peaks (0 + 3 + 5e3) / 3: r = 3.0, Low
        # (gradstream: 5 x the threshold, Medium).
        assert document["exploding_layers"][0]["severity"] == "Low"
    table = invoke(app, "--db", str(crafted), "--kind", kind, "--option", "rules=reference")
    assert table.exit_code == 0, table.output
    assert "reference" in table.stdout
    bad = invoke(app, "--db", str(crafted), "--kind", kind, "--option", "rules=tukey")
    assert bad.exit_code != 0


def test_enhanced_depth_and_stability_threshold(app: typer.Typer, crafted: Path) -> None:
    document = strict_json(invoke(
        app, "--db", str(crafted), "--kind", "enhanced", "--option", "depth=Basic",
        "--option", "stability_threshold=0.5", "--format", "json").stdout)
    assert document["analysis_depth"] == "Basic"
    assert document["network_level_analysis"]["layer_interactions"] == []
    stab = document["network_level_analysis"]["stability_assessment"]
    assert stab["stability_threshold"] == 0.5
    assert stab["above_stability_threshold"] == (stab["overall_stability"] > 0.5)
    bad = invoke(app, "--db", str(crafted), "--kind", "enhanced", "--option",
                 "depth=Everything")
    assert bad.exit_code != 0


def test_errors_tell_what_to_do(app: typer.Typer, crafted: Path, tmp_path: Path) -> None:
    missing = invoke(app, "--db", str(tmp_path / "nope.duckdb"), "--kind", "flow")
    assert missing.exit_code == 1 and "does not exist" in missing.output
    unknown = invoke(app, "--db", str(crafted), "--kind", "flow", "--run", "zzz")
    assert unknown.exit_code == 1 and "unknown run 'zzz'" in unknown.output
    bad_range = invoke(app, "--db", str(crafted), "--kind", "enhanced", "--from-step", "9",
                       "--to-step", "3")
    assert bad_range.exit_code == 1 and "from_step 9 is after to_step 3" in bad_range.output
    empty = invoke(app, "--db", str(crafted), "--kind", "enhanced", "--from-step", "500")
    assert empty.exit_code == 1 and "no gradient rows" in empty.output
    plain = write_history(tmp_path / "plain.duckdb", np.ones((1, 3)))
    no_weights = invoke(app, "--db", str(plain), "--kind", "weights")
    assert no_weights.exit_code == 1 and "weight_stats=True" in no_weights.output
    bad_kind = invoke(app, "--db", str(crafted), "--kind", "everything")
    assert bad_kind.exit_code != 0


def test_registered_on_the_gradstream_command() -> None:
    from deploy.cli import app as root

    result = CliRunner().invoke(root, ["analyze", "--help"])
    assert result.exit_code == 0, result.output
    for option in ("--kind", "--run", "--from-step", "--to-step", "--format", "--db"):
        assert option in result.output


# -- the demo's runs, through the real broker ----------------------------------------------


@pytest.fixture(scope="module")
def demo_store(kafka_bootstrap: str, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """`gradstream demo` (2 ranks) trains the vanishing and the exploding scenario through
    Kafka into a fresh DuckDB file; returns the file and the run ids by scenario."""
    from deploy.cli import app as root

    out = tmp_path_factory.mktemp("demo")
    result = CliRunner().invoke(
        root, ["demo", "--ranks", "2", "--scenario", "vanishing", "--scenario", "exploding",
               "--out", str(out), "--no-heatmap", "--bootstrap-servers", kafka_bootstrap],
    )
    assert result.exit_code == 0, result.output
    db = out / "demo.duckdb"
    con = duckdb.connect(str(db), read_only=True)
    runs = {r.split("-")[1]: r for (r,) in con.execute("SELECT run_id FROM runs").fetchall()}
    con.close()
    return {"db": db, **runs}


def analyze_json(app: typer.Typer, db: Path, run: str, kind: str) -> dict:
    result = invoke(app, "--db", str(db), "--run", run, "--kind", kind, "--format", "json")
    assert result.exit_code == 0, result.output
    return strict_json(result.stdout)


def test_demo_vanishing_run(app: typer.Typer, demo_store: dict) -> None:
    """12 sigmoid layers: the gradient shrinks layer after layer going back, so the layers
    at the input end form one vanishing region and backpropagation only attenuates."""
    db, run = demo_store["db"], demo_store["vanishing"]
    flow = analyze_json(app, db, run, "flow")
    (region,) = flow["vanishing_regions"]
    assert region["affected_layers"][:2] == ["layers.0.weight", "layers.0.bias"]
    assert "layers.12.weight" not in region["affected_layers"]
    con = duckdb.connect(str(db), read_only=True)
    numel = dict(con.execute("SELECT name, numel FROM layers WHERE run_id = ?", [run]).fetchall())
    con.close()
    assert region["extent"]["affected_parameters"] == sum(
        numel[n] for n in region["affected_layers"])
    assert flow["exploding_regions"] == [] and flow["dead_zones"] == []
    gains = [e["flow_strength"] for e in flow["flow_network"]["edges"]]
    assert np.prod(gains) < 1e-4  # per-element gradient lost across the network
    path = flow["critical_paths"][0]
    assert "layers.0.bias" in path["layers"] and path["criticality_score"] > 0.99

    enhanced = analyze_json(app, db, run, "enhanced")
    net = enhanced["network_level_analysis"]
    assert net["overall_gradient_health"] != "Healthy"
    sources = {s["source_type"]: s for s in net["stability_assessment"]["instability_sources"]}
    assert set(sources) == {"GradientVanishing"}
    assert sources["GradientVanishing"]["affected_layers"] == region["affected_layers"]
    first = enhanced["optimization_priorities"][0]
    assert first["urgency_level"] == "High"
    by_name = {d["layer_name"]: d for d in enhanced["layer_details"]}
    means = [by_name[f"layers.{i}.weight"]["gradient_statistics"]["mean"] for i in range(13)]
    assert means == sorted(means)  # larger gradients nearer the loss

    explosion = analyze_json(app, db, run, "explosion")
    assert explosion["exploding_layers"] == [] and explosion["overall_severity"] == "Low"

    # Every rank sent its replica of the weights: statistics count each weight once; the
    # layers nearest the input, whose gradients vanished, barely move (stalled), the
    # output layer moves most.
    weights = analyze_json(app, db, run, "weights")
    assert weights["first_nonfinite_step"] is None
    for layer in weights["distribution"]["layer_analyses"]:
        assert layer["statistics"]["count"] == numel[layer["layer_name"]]
    drift = weights["drift"]
    stalled = drift["stalled_layer_names"]
    assert stalled[0] == "layers.0.weight"
    assert stalled == [f"layers.{i}.weight" for i in range(len(stalled))]  # input side
    assert set(stalled) <= set(region["affected_layers"])
    ratio = {x["layer_name"]: x["mean_update_ratio"] for x in drift["layer_drifts"]}
    assert ratio["layers.12.weight"] > 1e4 * ratio["layers.0.weight"]


def test_demo_exploding_run(app: typer.Typer, demo_store: dict) -> None:
    """Learning rate warmed up to 4.0: every layer explodes, then overflows to NaN/Inf."""
    db, run = demo_store["db"], demo_store["exploding"]
    explosion = analyze_json(app, db, run, "explosion")
    assert explosion["overall_severity"] == "Critical"
    assert explosion["explosion_ratio"] > 0.5
    first = explosion["first_explosion_step"]
    assert first is not None and first > 5  # it trained for a while first
    assert explosion["clip_norm_suggestion"] is not None
    assert explosion["clip_norm_suggestion"] < explosion["threshold"]
    assert any(x["nonfinite_steps"] > 0 for x in explosion["exploding_layers"])

    flow = analyze_json(app, db, run, "flow")
    (region,) = flow["exploding_regions"]
    assert region["severity_level"] == "Critical"
    assert region["affected_layers"][0] == "layers.0.weight"
    assert region["extent"]["duration_steps"] >= 60 - first - 1

    enhanced = analyze_json(app, db, run, "enhanced")
    net = enhanced["network_level_analysis"]
    assert net["overall_gradient_health"] == "Critical"
    assert net["convergence_indicators"]["convergence_trend"] == "Diverging"
    kinds = {s["source_type"] for s in net["stability_assessment"]["instability_sources"]}
    assert {"GradientExplosion", "Chaos"} <= kinds
    assert enhanced["optimization_priorities"][0]["urgency_level"] == "Critical"

    # The first non-finite gradients are applied by that step's update: the weights turn
    # NaN/Inf one step later, and the weight analysis calls the distribution Critical.
    weights = analyze_json(app, db, run, "weights")
    con = duckdb.connect(str(db), read_only=True)
    (nonfinite,) = con.execute("SELECT min(step) FROM layer_stats WHERE run_id = ? AND "
                               "nonfinite > 0", [run]).fetchone()
    con.close()
    assert weights["first_nonfinite_step"] == nonfinite + 1
    assert weights["distribution"]["distribution_health"]["status"] == "Critical"
    drift = weights["drift"]
    assert drift["severity"] == "High" and "layers.0.weight" in drift["affected_layer_names"]
    before = strict_json(invoke(app, "--db", str(db), "--run", run, "--kind", "weights",
                                "--to-step", str(nonfinite), "--format", "json").stdout)
    assert before["first_nonfinite_step"] is None
    assert before["drift"]["stalled_layers"] == []  # the exploding layers all move
    assert before["drift"]["max_drift"] > 0.1  # weights grew by more than 10 %


@pytest.mark.parametrize("layout", ["sharded", "replicated"])
def test_weight_statistics_from_real_producers(app: typer.Typer, kafka_bootstrap: str,
                                               tmp_path: Path, unique_name: str,
                                               layout: str) -> None:
    """Two ranks each hold half of every weight tensor (sharded, FSDP-like) or all of it
    (replicated, DDP-like); their weight statistics go through Kafka and the worker; the
    analysis equals NumPy on the whole tensors, counted once."""
    from consumer.settings import ConsumerSettings
    from consumer.worker import Worker
    from producer import GradientProducer

    settings = ConsumerSettings(
        bootstrap_servers=kafka_bootstrap, topic=f"wts-{unique_name}",
        dlq_topic=f"wts-dlq-{unique_name}", group_id=f"wts-{unique_name}",
        db=str(tmp_path / "w.duckdb"),
    )
    worker = Worker(settings)
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    run_id = f"wts-{unique_name}"
    rng = np.random.default_rng(4)
    full = {"w": rng.normal(0.0, 0.5, 400).astype(np.float32),
            "b": np.r_[np.zeros(30), rng.normal(0, 1, 30)].astype(np.float32)}
    history = []
    try:
        assert worker.wait_ready(60)
        producers = [GradientProducer(run_id, rank=r, world_size=2,
                                      bootstrap_servers=kafka_bootstrap, topic=settings.topic,
                                      weight_stats=True) for r in range(2)]
        for p in producers:
            p.start_run({"w": 400, "b": 60})
        weights = {k: v.copy() for k, v in full.items()}
        for step in range(4):
            grads = {k: rng.normal(0, 0.1, v.size).astype(np.float32) for k, v in weights.items()}
            history.append({k: v.copy() for k, v in weights.items()})
            for r, p in enumerate(producers):
                if layout == "sharded":
                    p.record_step(
                        step, {k: np.array_split(g, 2)[r] for k, g in grads.items()},
                        weights={k: np.array_split(v, 2)[r] for k, v in weights.items()})
                else:
                    p.record_step(step, grads, weights=weights, replicated=True)
            weights = {k: (v - 0.5 * grads[k]).astype(np.float32) for k, v in weights.items()}
        for p in producers:
            p.finish_run()
            p.close()
        assert worker.wait_for_runs([run_id], 60)
    finally:
        worker.stop()
        thread.join(30)
    report = analyze_json(app, Path(settings.db), run_id, "weights")
    dist = report["distribution"]
    assert dist["step"] == 3
    layers = {x["layer_name"]: x["statistics"] for x in dist["layer_analyses"]}
    for name, stats in layers.items():
        w = history[3][name].astype(np.float64)
        d = w - w.mean()
        assert stats["mean"] == pytest.approx(w.mean(), abs=1e-9)
        assert stats["std_dev"] == pytest.approx(w.std(), rel=1e-9)
        assert stats["skewness"] == pytest.approx((d**3).mean() / w.std() ** 3, rel=1e-6,
                                                  abs=1e-9)
        assert stats["kurtosis"] == pytest.approx((d**4).mean() / w.var() ** 2 - 3, rel=1e-6)
        assert (stats["min"], stats["max"]) == (pytest.approx(w.min()), pytest.approx(w.max()))
        assert stats["count"] == w.size
    drift = report["drift"]
    assert (drift["from_step"], drift["to_step"]) == (0, 3)
    for layer in drift["layer_drifts"]:
        a = history[0][layer["layer_name"]].astype(np.float64)
        b = history[3][layer["layer_name"]].astype(np.float64)
        true = np.linalg.norm(b - a) / np.linalg.norm(a)
        assert layer["relative_norm_change"] == pytest.approx(
            (np.linalg.norm(b) - np.linalg.norm(a)) / np.linalg.norm(a), rel=1e-6)
        # |norm change| <= true drift <= recorded update path
        assert abs(layer["relative_norm_change"]) <= true + 1e-9
        assert layer["relative_path_length"] >= true - 1e-9
