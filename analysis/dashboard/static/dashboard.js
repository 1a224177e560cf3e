/* gradstream live dashboard: polls the JSON endpoints of analysis.dashboard.server and
 * redraws the runs (health badges), the heatmap of the selected run with its loss curve
 * above it (same step columns), the alerts feed and the selected layer's norm series,
 * with download and analysis-report links for the selected run. All text from the store
 * goes in via textContent. */
(function () {
  "use strict";
  const config = JSON.parse(document.getElementById("config").textContent);
  const routes = config.routes;  // read name -> path, from the server's route table
  const H = window.GradHeatmap;
  H.useFlagBits(config.flag_bits);
  const opts = { palette: config.palette, flagColors: config.flag_colors };
  const paletteRgb = config.palette.map(H.hexToRgb);
  const $ = (id) => document.getElementById(id);
  const state = { run: null, picked: false, layer: null, grid: null, series: null,
                  scalars: null };
  // A link to one run (an alert's Alertmanager generatorURL or PagerDuty link): /?run=ID
  // selects that run once it is listed.
  const linkedRun = new URLSearchParams(window.location.search).get("run");

  $("db").textContent = config.db + (config.writer ? "  (this process writes it)" : "  (read-only)");

  async function getJSON(url) {
    const response = await fetch(url, { cache: "no-store" });
    const body = await response.json();
    if (!response.ok) throw new Error(body.error || ("HTTP " + response.status));
    return body;
  }
  const q = encodeURIComponent;

  function el(tag, cls, text) {
    const node = document.createElement(tag);
    if (cls) node.className = cls;
    if (text !== undefined) node.textContent = text;
    return node;
  }

  function badge(health) {
    const b = el("span", "badge", health);
    b.style.background = config.health_colors[health] || "#57606a";
    return b;
  }

  function renderRuns(runs) {
    const list = $("runs");
    list.textContent = "";
    $("no-runs").hidden = runs.length > 0;
    if (!state.picked && linkedRun !== null && runs.some((r) => r.run_id === linkedRun)) {
      selectRun(linkedRun, true);
    }
    if (!state.picked && runs.length && (state.run === null ||
        !runs.some((r) => r.run_id === state.run))) {
      selectRun(runs[0].run_id, false);
    }
    for (const run of runs) {
      const li = el("li");
      li.dataset.runId = run.run_id;
      li.dataset.health = run.health;
      li.dataset.frames = String(run.frames);
      if (run.run_id === state.run) li.className = "selected";
      const head = el("div");
      head.appendChild(badge(run.health));
      head.appendChild(el("span", "run-id", run.run_id));
      li.appendChild(head);
      const last = run.last_step === null ? "-" : run.last_step;
      const meta = run.frames + " frames, last step " + last + ", " + run.world_size +
        " ranks, " + run.num_layers + " layers, issue ratio " +
        (100 * run.issue_ratio).toFixed(1) + "%" + (run.alerts ? ", " + run.alerts +
        " alerts" : "") + (run.partial_frames ? ", " + run.partial_frames + " partial" : "") +
        (run.finished ? ", finished" : ", running");
      li.appendChild(el("div", "run-meta", meta));
      li.addEventListener("click", () => selectRun(run.run_id, true));
      list.appendChild(li);
    }
  }

  function selectRun(runId, byUser) {
    if (byUser) state.picked = true;
    if (state.run !== runId) {
      state.run = runId;
      state.layer = null;
      state.grid = null;
      state.series = null;
      state.scalars = null;
      $("layer-select").textContent = "";
      drawSeries();
      drawLoss();
    }
    for (const li of $("runs").children) {
      li.className = li.dataset.runId === runId ? "selected" : "";
    }
    updateExports();
    refresh();
  }

  function renderGrid(grid) {
    state.grid = grid;
    const canvas = $("heatmap");
    $("grid-title").textContent = "Gradient flow of " + grid.run_id +
      " (log10 gradient norm, layers in model order \u00D7 steps)";
    const cap = $("grid-caption");
    cap.textContent = grid.caption;
    cap.className = grid.steps_per_col > 1 || grid.layers_per_row > 1 ?
      "caption downsampled" : "caption";
    const rowOfLayer = state.layer === null ? null :
      grid.row_first_layer.findIndex((a, i) => a <= state.layer &&
        state.layer <= grid.row_last_layer[i]);
    const range = H.drawHeatmap(canvas, grid, Object.assign({ highlight: rowOfLayer }, opts));
    H.fillLegend($("legend"), grid, opts, range);
    const C = grid.col_first_step.length;
    canvas.dataset.columns = String(C);
    canvas.dataset.rows = String(grid.rows.length);
    canvas.dataset.frames = String(grid.n_frames);
    canvas.dataset.lastStep = C ? String(grid.col_last_step[C - 1]) : "";
    fillLayerSelect(grid);
  }

  function fillLayerSelect(grid) {
    const select = $("layer-select");
    if (select.options.length === grid.n_layers + 1) return;
    select.textContent = "";
    select.appendChild(el("option", "", "(click a heatmap row)")).value = "";
    // Names per layer come from the grid's rows when every row is one layer.
    for (let i = 0; i < grid.rows.length; i++) {
      const a = grid.row_first_layer[i], b = grid.row_last_layer[i];
      for (let l = a; l <= b; l++) {
        const label = a === b ? grid.rows[i] : "layer " + l + " (" + grid.rows[i] + ")";
        const opt = el("option", "", l + ": " + label);
        opt.value = String(l);
        select.appendChild(opt);
      }
    }
    select.value = state.layer === null ? "" : String(state.layer);
  }

  function renderAlerts(alerts) {
    const list = $("alerts");
    list.textContent = "";
    $("no-alerts").hidden = alerts.length > 0;
    for (const a of alerts) {
      const sev = String(a.severity).toLowerCase();
      const li = el("li", sev.includes("crit") ? "critical" : (sev.includes("warn") ? "warning" : ""));
      li.dataset.alertId = a.alert_id;
      li.dataset.runId = a.run_id;
      li.dataset.rule = a.rule;
      li.dataset.state = a.state;
      const when = a.created_at ? new Date(a.created_at * 1000).toLocaleTimeString() : "";
      li.appendChild(el("div", "alert-head", a.severity + " \u00B7 " + a.rule + " \u00B7 " +
        a.run_id + " step " + a.step + " \u00B7 " + a.state + " " + when));
      li.appendChild(el("div", "alert-msg", a.message));
      if (a.layers && a.layers.length) {
        li.appendChild(el("div", "muted", "layers: " + a.layers.join(", ") +
          (a.ranks && a.ranks.length ? "; ranks: " + a.ranks.join(", ") : "")));
      }
      list.appendChild(li);
    }
  }

  function drawSeries() {
    const canvas = $("series"), s = state.series;
    const ratio = H.fitCanvas(canvas);
    const ctx = canvas.getContext("2d");
    ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
    const W = canvas.clientWidth, Hh = canvas.clientHeight;
    ctx.clearRect(0, 0, W, Hh);
    $("layer-panel").dataset.layerIndex = s ? String(s.layer_index) : "";
    canvas.dataset.points = s ? String(s.first_step.length) : "0";
    $("series-caption").textContent = s ? s.layer_name + ": " + s.caption : "";
    if (!s || !s.first_step.length) return;
    const xs = s.first_step, logs = (arr) => arr.map((v) => (v !== null && v > 0 ?
      Math.log10(v) : null));
    const hi = logs(s.max_norm), lo = logs(s.min_norm);
    const finite = hi.concat(lo).filter((v) => v !== null);
    if (!finite.length) return;
    let y0 = Math.floor(Math.min.apply(null, finite)), y1 = Math.ceil(Math.max.apply(null, finite));
    if (y0 === y1) { y0 -= 1; y1 += 1; }
    const x0 = xs[0], x1 = Math.max(xs[xs.length - 1], x0 + 1);
    const L = 56, R = 12, T = 10, B = 26;
    const px = (x) => L + (x - x0) / (x1 - x0) * (W - L - R);
    const py = (y) => T + (1 - (y - y0) / (y1 - y0)) * (Hh - T - B);
    ctx.strokeStyle = "#d0d7de"; ctx.fillStyle = "#57606a"; ctx.lineWidth = 1;
    ctx.font = "11px system-ui, sans-serif"; ctx.textAlign = "right"; ctx.textBaseline = "middle";
    const yStep = Math.max(1, Math.ceil((y1 - y0) / 6));
    for (let y = y0; y <= y1; y += yStep) {
      ctx.beginPath(); ctx.moveTo(L, py(y)); ctx.lineTo(W - R, py(y)); ctx.stroke();
      ctx.fillText("1e" + y, L - 4, py(y));
    }
    ctx.textAlign = "center"; ctx.textBaseline = "top";
    for (let i = 0; i <= 5; i++) {
      const x = Math.round(x0 + (x1 - x0) * i / 5);
      ctx.fillText(String(x), px(x), Hh - B + 6);
    }
    if (s.steps_per_bin > 1) {  // min..max band of each bin
      ctx.fillStyle = "rgba(9,105,218,0.15)";
      ctx.beginPath();
      let started = false;
      for (let i = 0; i < xs.length; i++) {
        if (hi[i] === null) continue;
        if (!started) { ctx.moveTo(px(xs[i]), py(hi[i])); started = true; } else ctx.lineTo(px(xs[i]), py(hi[i]));
      }
      for (let i = xs.length - 1; i >= 0; i--) {
        if (lo[i] !== null) ctx.lineTo(px(xs[i]), py(lo[i]));
      }
      ctx.fill();
    }
    ctx.strokeStyle = "#0969da"; ctx.lineWidth = 1.5; ctx.beginPath();
    let pen = false;
    for (let i = 0; i < xs.length; i++) {
      if (hi[i] === null) { pen = false; continue; }
      if (!pen) { ctx.moveTo(px(xs[i]), py(hi[i])); pen = true; } else ctx.lineTo(px(xs[i]), py(hi[i]));
    }
    ctx.stroke();
    const marks = [[H.FLAG.VANISHING, "vanishing"], [H.FLAG.EXPLODING, "exploding"],
                   [H.FLAG.NONFINITE, "nonfinite"]];
    for (let i = 0; i < xs.length; i++) {
      for (const [bit, key] of marks) {
        if ((s.flags[i] & bit) && hi[i] !== null) {
          ctx.fillStyle = config.flag_colors[key];
          ctx.beginPath(); ctx.arc(px(xs[i]), py(hi[i]), 3.5, 0, 2 * Math.PI); ctx.fill();
        }
      }
    }
  }

  /* The loss curve above the heatmap, on the heatmap's step columns: each bin of
   * /api/scalars (the loss binned as the grid's columns, analysis.plots.scalars) is drawn at
   * the centre of the grid column holding its first step, so the two share the x axis; the
   * min..max band when a column covers several steps; NaN/Inf bins as magenta dots on the
   * top edge. Hidden when the run has no loss. */
  function drawLoss() {
    const canvas = $("loss"), g = state.grid, sc = state.scalars;
    const s = sc && sc.series ? sc.series.loss : null;
    const area = $("heatmap").gradstreamArea;
    const shown = Boolean(g && s && s.col.length && area && g.col_first_step.length);
    canvas.hidden = !shown;
    $("loss-caption").hidden = !shown;
    canvas.dataset.points = "0";
    canvas.dataset.nonfinite = "0";
    if (!shown) return;
    $("loss-caption").textContent = sc.caption;
    const ratio = H.fitCanvas(canvas);
    const ctx = canvas.getContext("2d");
    ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
    const W = canvas.clientWidth, Hh = canvas.clientHeight;
    ctx.clearRect(0, 0, W, Hh);
    const starts = g.col_first_step, C = starts.length;
    const column = (step) => {  // the last column whose first step is <= step
      let lo = 0, hi = C - 1;
      while (lo < hi) {
        const mid = (lo + hi + 1) >> 1;
        if (starts[mid] <= step) lo = mid; else hi = mid - 1;
      }
      return lo;
    };
    const x0 = area.x / area.ratio, cw = area.w / area.ratio / C;
    const xs = s.first_step.map((step) => x0 + (column(step) + 0.5) * cw);
    const finite = s.low.concat(s.high, s.mean).filter((v) => v !== null);
    let y0 = finite.length ? Math.min.apply(null, finite) : 0;
    let y1 = finite.length ? Math.max.apply(null, finite) : 1;
    if (y0 === y1) { y0 -= 0.5; y1 += 0.5; }
    const T = 8, B = 6;
    const py = (v) => T + (1 - (v - y0) / (y1 - y0)) * (Hh - T - B);
    // Grid lines with their values inside the plot (the margin left of it is sized for
    // the heatmap's layer names, maybe too narrow for numbers).
    ctx.strokeStyle = "#d0d7de"; ctx.fillStyle = "#57606a"; ctx.lineWidth = 1;
    ctx.font = "11px system-ui, sans-serif"; ctx.textAlign = "left"; ctx.textBaseline = "bottom";
    for (let i = 0; i <= 2; i++) {
      const v = y0 + (y1 - y0) * i / 2;
      ctx.beginPath(); ctx.moveTo(x0, py(v)); ctx.lineTo(x0 + C * cw, py(v)); ctx.stroke();
      ctx.fillText(Number(v.toPrecision(3)).toString(), x0 + 3, Math.max(12, py(v) - 1));
    }
    if (sc.steps_per_col > 1) {  // min..max band of each column
      ctx.fillStyle = "rgba(31,119,180,0.2)";
      for (let i = 0; i < xs.length; i++) {
        if (s.low[i] === null) continue;
        const top = py(s.high[i]);
        ctx.fillRect(xs[i] - cw / 2, top, cw, Math.max(1, py(s.low[i]) - top));
      }
    }
    ctx.strokeStyle = config.loss_color; ctx.lineWidth = 1.5; ctx.beginPath();
    let pen = false, points = 0, bad = 0;
    for (let i = 0; i < xs.length; i++) {
      const gap = i > 0 && column(s.first_step[i]) !== column(s.first_step[i - 1]) + 1;
      if (s.mean[i] === null || gap) pen = false;
      if (s.mean[i] === null) continue;
      points++;
      if (!pen) { ctx.moveTo(xs[i], py(s.mean[i])); pen = true; } else ctx.lineTo(xs[i], py(s.mean[i]));
    }
    ctx.stroke();
    ctx.fillStyle = config.flag_colors.nonfinite;
    for (let i = 0; i < xs.length; i++) {
      if (!s.nonfinite[i]) continue;
      bad += s.nonfinite[i];
      ctx.beginPath(); ctx.arc(xs[i], T / 2 + 1, 3.5, 0, 2 * Math.PI); ctx.fill();
    }
    canvas.dataset.points = String(points);
    canvas.dataset.nonfinite = String(bad);
    canvas.dataset.firstStep = String(s.first_step[0]);
    canvas.dataset.lastStep = String(s.last_step[s.last_step.length - 1]);
    canvas.dataset.plotLeft = String(x0);
    canvas.dataset.plotWidth = String(C * cw);
  }

  function selectLayer(index) {
    state.layer = index;
    $("layer-select").value = index === null ? "" : String(index);
    if (index === null) { state.series = null; drawSeries(); }
    if (state.grid) renderGrid(state.grid);
    refresh();
  }

  // The registered analyses (name, help), fetched once: one report link each.
  let analyses = [];
  getJSON(routes.analyses).then((body) => {
    analyses = body.analyses;
    updateExports();
  }).catch(() => {});

  function updateExports() {
    const box = $("exports"), reports = $("analyses");
    box.textContent = "";
    reports.textContent = "";
    if (state.run === null) return;
    let range = "";
    if ($("from-step").value !== "") range += "&from_step=" + q($("from-step").value);
    if ($("to-step").value !== "") range += "&to_step=" + q($("to-step").value);
    for (const fmt of config.export_formats) {
      const a = el("a", "export", fmt.toUpperCase());
      a.dataset.format = fmt;
      a.href = routes.export + "?run=" + q(state.run) + "&format=" + fmt + range;
      a.setAttribute("download", "");
      box.appendChild(a);
    }
    for (const analysis of analyses) {
      const a = el("a", "analysis", analysis.name);
      a.dataset.analysis = analysis.name;
      a.title = analysis.help;
      a.href = routes.analysis.replace("{name}", q(analysis.name)) + "?run=" + q(state.run) + range;
      a.target = "_blank";
      a.rel = "noopener";
      reports.appendChild(a);
    }
  }
  $("from-step").addEventListener("change", updateExports);
  $("to-step").addEventListener("change", updateExports);

  $("heatmap").addEventListener("click", (event) => {
    if (!state.grid) return;
    const cell = H.cellAt($("heatmap"), state.grid, event);
    if (cell) selectLayer(state.grid.row_first_layer[cell.row]);
  });
  $("heatmap").addEventListener("mousemove", (event) => {
    const g = state.grid;
    if (!g) return;
    const cell = H.cellAt($("heatmap"), g, event);
    if (!cell) return;
    const v = g.log_norm[cell.row][cell.col], words = H.flagWords(g.flags[cell.row][cell.col]);
    $("cell-info").textContent = g.rows[cell.row] + " \u00B7 " + H.stepsText(g, cell.col) +
      " \u00B7 " + (v === null ? "no norm" : "max norm " + H.normText(v)) +
      (words ? " \u00B7 " + words : "") + "  (click for this layer's series)";
  });
  $("layer-select").addEventListener("change", (event) => {
    const v = event.target.value;
    selectLayer(v === "" ? null : Number(v));
  });
  window.addEventListener("resize", () => {
    if (state.grid) renderGrid(state.grid);
    drawLoss();
    drawSeries();
  });

  let busy = false, pending = false, timer = null;
  async function refresh() {
    if (busy) { pending = true; return; }
    busy = true;
    clearTimeout(timer);
    const pill = $("status");
    try {
      const status = await getJSON(routes.status);
      const runs = (await getJSON(routes.runs)).runs;
      renderRuns(runs);
      const canvas = $("heatmap"), ratio = window.devicePixelRatio || 1;
      const jobs = [getJSON(routes.alerts + "?limit=50")];
      if (state.run !== null) {
        const maxSteps = Math.max(1, Math.round(canvas.clientWidth * ratio));
        jobs.push(getJSON(routes.grid + "?run=" + q(state.run) + "&max_steps=" + maxSteps +
          "&max_layers=" + Math.max(1, Math.round(canvas.clientHeight * ratio / 2))));
        jobs.push(getJSON(routes.scalars + "?run=" + q(state.run) + "&max_steps=" + maxSteps +
          "&names=" + q('["loss"]')));
        if (state.layer !== null) {
          jobs.push(getJSON(routes.layer + "?run=" + q(state.run) + "&layer=" + state.layer +
            "&max_points=" + Math.max(1, Math.round($("series").clientWidth * ratio))));
        }
      }
      const [alerts, grid, scalars, series] = await Promise.all(jobs);
      renderAlerts(alerts.alerts);
      if (grid && grid.run_id === state.run) renderGrid(grid);
      if (scalars && scalars.run_id === state.run) {
        state.scalars = scalars;
        drawLoss();
      }
      if (series && series.run_id === state.run && series.layer_index === state.layer) {
        state.series = series;
        drawSeries();
      }
      const counters = status.counters ? ", " + status.counters.frames + " frames stored" : "";
      pill.textContent = (status.writer ? "live" : "read-only") + counters + " \u00B7 " +
        new Date().toLocaleTimeString();
      pill.className = "pill ok";
      document.body.dataset.updates = String(Number(document.body.dataset.updates || 0) + 1);
    } catch (err) {
      pill.textContent = "error: " + err.message;
      pill.className = "pill error";
    } finally {
      busy = false;
      if (pending) { pending = false; refresh(); } else timer = setTimeout(refresh, config.refresh_ms);
    }
  }
  refresh();
})();
