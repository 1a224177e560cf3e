/* gradstream heatmap renderer, shared by the offline animation and the live dashboard.
 *
 * A grid is the JSON of analysis.plots.grid.GradientGrid.to_json(): rows = layers in model
 * order, columns = recorded steps (or bins of them); log_norm[r][c] = log10 of the maximum
 * gradient L2 norm in the cell (null: no data or norm 0), flags[r][c] = bit set of
 * schemas.flags.FLAG_BITS (vanishing, exploding, non-finite, no data, norm 0), which the
 * page sends with its data and hands to useFlagBits before drawing: the bits have one
 * definition, in Python, and none here.
 * Colours: palette = hex colours of matplotlib's viridis, low to high; flag colours from
 * analysis.plots.colors.FLAG_COLORS. No external resources: works offline.
 */
(function (global) {
  "use strict";

  // The flag bits by name (schemas.flags.FLAG_BITS), filled by useFlagBits; one object,
  // so that GradHeatmap.FLAG always shows the bits in use.
  const FLAG = {};
  const NEEDED = ["VANISHING", "EXPLODING", "NONFINITE", "NO_DATA", "ZERO"];
  // Later entries are drawn over earlier ones (set by useFlagBits).
  let MARKS = [];

  /* Take the flag bits the page received (schemas.flags.FLAG_BITS: name -> bit); call it
   * once before drawing. Throws when a bit the renderer draws is missing. */
  function useFlagBits(bits) {
    for (const name of NEEDED) {
      if (!bits || !Number.isInteger(bits[name])) {
        throw new Error("flag bit " + name + " missing: the page must send " +
                        "schemas.flags.FLAG_BITS as flag_bits");
      }
    }
    for (const key of Object.keys(FLAG)) delete FLAG[key];
    Object.assign(FLAG, bits);
    MARKS = [
      [FLAG.ZERO, "zero"], [FLAG.VANISHING, "vanishing"],
      [FLAG.EXPLODING, "exploding"], [FLAG.NONFINITE, "nonfinite"],
    ];
    return FLAG;
  }
  // Cells at least this many CSS pixels wide and tall get hollow marks (norm colour stays
  // visible inside); smaller cells are filled with the flag colour (same rule as the PNG).
  const MIN_MARK_PX = 6;

  function hexToRgb(hex) {
    const v = parseInt(hex.slice(1), 16);
    return [(v >> 16) & 255, (v >> 8) & 255, v & 255];
  }

  /* Finite range [lo, hi] of grid.log_norm (widened by 0.5 each way when flat). */
  function normRange(grid) {
    let lo = Infinity, hi = -Infinity;
    for (const row of grid.log_norm) {
      for (const v of row) {
        if (v !== null) { if (v < lo) lo = v; if (v > hi) hi = v; }
      }
    }
    if (lo === Infinity) return [0, 1];
    if (lo === hi) return [lo - 0.5, hi + 0.5];
    return [lo, hi];
  }

  /* Colour of log10 norm v on the palette over [lo, hi], as [r, g, b]. */
  function paletteRgb(palette, v, lo, hi) {
    const t = Math.min(1, Math.max(0, (v - lo) / (hi - lo)));
    return palette[Math.round(t * (palette.length - 1))];
  }

  function fitCanvas(canvas) {
    const ratio = global.devicePixelRatio || 1;
    const w = Math.max(1, Math.round(canvas.clientWidth * ratio));
    const h = Math.max(1, Math.round(canvas.clientHeight * ratio));
    if (canvas.width !== w || canvas.height !== h) { canvas.width = w; canvas.height = h; }
    return ratio;
  }

  const LABEL_FONT_PX = 11;

  /* Plot area of the cells in device pixels: left of it the layer names, under it the
   * step ticks (CSS-pixel margins scaled by the device pixel ratio). */
  function plotArea(canvas, grid, ratio) {
    const cssW = canvas.width / ratio;
    let left = 0;
    if (grid.rows.length) {
      const ctx = canvas.getContext("2d");
      ctx.font = LABEL_FONT_PX + "px system-ui, sans-serif";
      let widest = 0;
      for (const name of grid.rows) widest = Math.max(widest, ctx.measureText(name).width);
      left = Math.min(Math.ceil(widest) + 8, Math.round(cssW * 0.3));
    }
    const bottom = LABEL_FONT_PX + 8;
    return { x: left * ratio, y: 0, w: canvas.width - left * ratio,
             h: canvas.height - bottom * ratio, ratio: ratio };
  }

  function drawAxes(ctx, grid, area) {
    const R = grid.rows.length, C = grid.col_first_step.length, ratio = area.ratio;
    ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
    ctx.fillStyle = "#333";
    ctx.font = LABEL_FONT_PX + "px system-ui, sans-serif";
    ctx.textAlign = "right";
    ctx.textBaseline = "middle";
    const rowH = area.h / R / ratio, every = Math.max(1, Math.ceil(LABEL_FONT_PX / rowH));
    const maxW = area.x / ratio - 6;
    for (let r = 0; r < R; r += every) {
      let name = grid.rows[r].replace(/[\u0000-\u001f\u007f]/g, "\u00B7");
      while (name.length > 1 && ctx.measureText(name).width > maxW) {
        name = name.slice(0, -2) + "\u2026";
      }
      ctx.fillText(name, area.x / ratio - 4, (area.y + (r + 0.5) * area.h / R) / ratio);
    }
    ctx.textAlign = "center";
    ctx.textBaseline = "top";
    const ticks = Math.max(1, Math.min(C, Math.floor(area.w / ratio / 80)));
    for (let i = 0; i < ticks; i++) {
      const c = Math.round(i * (C - 1) / Math.max(1, ticks - 1));
      let x = (area.x + (c + 0.5) * area.w / C) / ratio;
      ctx.textAlign = "center";
      if (ticks > 1 && i === 0) { ctx.textAlign = "left"; x = area.x / ratio; }
      if (ticks > 1 && i === ticks - 1) { ctx.textAlign = "right"; x = (area.x + area.w) / ratio; }
      ctx.fillText(String(grid.col_first_step[c]), x, (area.y + area.h) / ratio + 3);
    }
    ctx.setTransform(1, 0, 0, 1, 0, 0);
  }

  /* Draw the grid on canvas (sized by CSS), layer names on the left and steps below.
   * opts: palette (hex[]), flagColors ({key: hex}), cursor (column index to outline,
   * optional), highlight (row index, optional). Returns the colour range used, [lo, hi]. */
  function drawHeatmap(canvas, grid, opts) {
    const ratio = fitCanvas(canvas);
    const ctx = canvas.getContext("2d");
    const R = grid.rows.length, C = grid.col_first_step.length;
    ctx.setTransform(1, 0, 0, 1, 0, 0);
    ctx.clearRect(0, 0, canvas.width, canvas.height);
    const range = normRange(grid);
    if (R === 0 || C === 0) return range;
    const area = plotArea(canvas, grid, ratio);
    canvas.gradstreamArea = area;
    drawAxes(ctx, grid, area);
    ctx.save();
    ctx.translate(area.x, area.y);
    const palette = opts.palette.map(hexToRgb);
    const flagRgb = {};
    for (const key in opts.flagColors) flagRgb[key] = hexToRgb(opts.flagColors[key]);
    const cw = area.w / C, rh = area.h / R;
    const hollow = Math.min(cw, rh) / ratio >= MIN_MARK_PX;
    // One pixel per cell, then scaled up without smoothing: O(R x C), fast for 1e6 cells.
    const img = new ImageData(C, R);
    const px = img.data;
    for (let r = 0; r < R; r++) {
      const logRow = grid.log_norm[r], flagRow = grid.flags[r];
      for (let c = 0; c < C; c++) {
        const f = flagRow[c], v = logRow[c];
        let rgb = flagRgb.no_data;
        if (v !== null) rgb = paletteRgb(palette, v, range[0], range[1]);
        if (!hollow) {
          for (const [bit, key] of MARKS) if (f & bit) rgb = flagRgb[key];
        } else if (f & FLAG.ZERO) {
          rgb = flagRgb.zero;
        }
        const i = (r * C + c) * 4;
        px[i] = rgb[0]; px[i + 1] = rgb[1]; px[i + 2] = rgb[2]; px[i + 3] = 255;
      }
    }
    const off = document.createElement("canvas");
    off.width = C; off.height = R;
    off.getContext("2d").putImageData(img, 0, 0);
    ctx.imageSmoothingEnabled = false;
    ctx.drawImage(off, 0, 0, area.w, area.h);
    if (hollow) {
      ctx.lineWidth = Math.max(1.5 * ratio, Math.min(cw, rh) / 8);
      for (const [bit, key] of MARKS) {
        if (bit === FLAG.ZERO) continue;
        ctx.strokeStyle = opts.flagColors[key];
        for (let r = 0; r < R; r++) {
          const flagRow = grid.flags[r];
          for (let c = 0; c < C; c++) {
            if (flagRow[c] & bit) {
              ctx.strokeRect(c * cw + 0.15 * cw, r * rh + 0.15 * rh, 0.7 * cw, 0.7 * rh);
            }
          }
        }
      }
    }
    if (opts.highlight !== undefined && opts.highlight !== null && opts.highlight < R) {
      ctx.strokeStyle = "#ffffff";
      ctx.lineWidth = 2 * ratio;
      ctx.strokeRect(1, opts.highlight * rh + 1, area.w - 2, rh - 2);
    }
    if (opts.cursor !== undefined && opts.cursor !== null && opts.cursor < C) {
      ctx.strokeStyle = "#ff9800";
      ctx.lineWidth = Math.max(2 * ratio, Math.min(cw, 6 * ratio));
      ctx.strokeRect(opts.cursor * cw, 0, Math.max(cw, 1), area.h);
    }
    ctx.restore();
    return range;
  }

  /* The (row, col) under a mouse event on the canvas, or null. */
  function cellAt(canvas, grid, event) {
    const box = canvas.getBoundingClientRect();
    const R = grid.rows.length, C = grid.col_first_step.length;
    const area = canvas.gradstreamArea;
    if (!R || !C || !area) return null;
    const x = (event.clientX - box.left) * area.ratio - area.x;
    const y = (event.clientY - box.top) * area.ratio - area.y;
    const col = Math.floor(x / area.w * C);
    const row = Math.floor(y / area.h * R);
    if (row < 0 || row >= R || col < 0 || col >= C) return null;
    return { row: row, col: col };
  }

  /* 10^v in exponent notation, e.g. "3.162e-2" (v = log10 norm, null = none). */
  function normText(v) {
    return v === null ? "-" : Math.pow(10, v).toExponential(3);
  }

  /* Words for a cell's flags, e.g. "exploding, non-finite". */
  function flagWords(f) {
    const out = [];
    if (f & FLAG.VANISHING) out.push("vanishing");
    if (f & FLAG.EXPLODING) out.push("exploding");
    if (f & FLAG.NONFINITE) out.push("non-finite");
    if (f & FLAG.ZERO) out.push("norm 0");
    if (f & FLAG.NO_DATA) out.push("no data");
    return out.join(", ");
  }

  /* "step 12" or "steps 10-19 (10 recorded)" for column c. */
  function stepsText(grid, c) {
    const a = grid.col_first_step[c], b = grid.col_last_step[c];
    return a === b ? "step " + a : "steps " + a + "\u2013" + b + " (" + grid.col_frames[c] +
      " recorded)";
  }

  /* Fill a legend element with swatches of the flag colours and the norm scale. */
  function fillLegend(el, grid, opts, range) {
    el.textContent = "";
    const items = [
      ["vanishing", "vanishing (mean |g| < " + grid.vanishing_threshold + ")"],
      ["exploding", "exploding (max |g| > " + grid.exploding_threshold + ")"],
      ["nonfinite", "non-finite (NaN/Inf)"], ["zero", "norm 0"], ["no_data", "no data"],
    ];
    for (const [key, text] of items) {
      const span = document.createElement("span");
      span.className = "swatch";
      const box = document.createElement("i");
      box.style.background = opts.flagColors[key];
      span.appendChild(box);
      span.appendChild(document.createTextNode(text));
      el.appendChild(span);
    }
    const scale = document.createElement("span");
    scale.className = "scale";
    const bar = document.createElement("i");
    bar.style.background = "linear-gradient(to right," + opts.palette.filter(
      (_, i) => i % 16 === 0 || i === opts.palette.length - 1).join(",") + ")";
    scale.appendChild(document.createTextNode("log10 norm " + range[0].toFixed(2) + " "));
    scale.appendChild(bar);
    scale.appendChild(document.createTextNode(" " + range[1].toFixed(2)));
    el.appendChild(scale);
  }

  global.GradHeatmap = {
    FLAG: FLAG, useFlagBits: useFlagBits, drawHeatmap: drawHeatmap, cellAt: cellAt, normRange: normRange,
    paletteRgb: paletteRgb, hexToRgb: hexToRgb, flagWords: flagWords, stepsText: stepsText,
    fillLegend: fillLegend, fitCanvas: fitCanvas, normText: normText,
  };
})(window);
