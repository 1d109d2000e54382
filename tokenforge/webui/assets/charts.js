"use strict";
// Time-series line charts in SVG, drawn here (no chart library). A chart is created once and
// updated with the whole point list; it keeps an accessible summary (its latest values) in
// aria-label and in a visible legend, and counts its redraws in data-draws (tests read it).
(function () {
  const TF = (window.TF = window.TF || {});
  const SVG = "http://www.w3.org/2000/svg";
  const W = 320, H = 120, PAD = {l: 40, r: 8, t: 8, b: 18};

  function s(tag, attrs, ...children) { return TF.h(tag, Object.assign({ns: SVG}, attrs), ...children); }

  class LineChart {
    // series: [{key, label}] with key a field of each point or a function(point) -> number|null
    constructor(title, series, format) {
      this.title = title;
      this.series = series;
      this.format = format || ((v) => TF.fmt.num(v));
      this.draws = 0;
      this.svg = s("svg", {viewBox: `0 0 ${W} ${H}`, class: "chart-svg", role: "img", "aria-label": title,
        preserveAspectRatio: "none", focusable: "false"});
      this.legend = TF.h("ul", {class: "legend"});
      this.el = TF.h("figure", {class: "chart", "data-chart": title, tabindex: "0"},
        TF.h("figcaption", {}, title), this.svg, this.legend);
    }

    value(point, serie) {
      const v = typeof serie.key === "function" ? serie.key(point) : point[serie.key];
      return v === null || v === undefined || Number.isNaN(v) ? null : Number(v);
    }

    update(points) {
      TF.clear(this.svg);
      TF.clear(this.legend);
      const t0 = points.length ? points[0].t : 0, t1 = points.length ? points[points.length - 1].t : 1;
      let max = 0;
      for (const p of points) for (const serie of this.series) max = Math.max(max, this.value(p, serie) || 0);
      max = max > 0 ? max * 1.1 : 1;
      const x = (t) => PAD.l + (t1 > t0 ? (t - t0) / (t1 - t0) : 1) * (W - PAD.l - PAD.r);
      const y = (v) => H - PAD.b - (v / max) * (H - PAD.t - PAD.b);
      for (const frac of [0, 0.5, 1]) {
        const yy = y(max * frac);
        this.svg.append(s("line", {x1: PAD.l, x2: W - PAD.r, y1: yy, y2: yy, class: "grid"}));
        this.svg.append(s("text", {x: PAD.l - 4, y: yy + 3, class: "axis", "text-anchor": "end"}, this.format(max * frac)));
      }
      const span = Math.round(t1 - t0);
      this.svg.append(s("text", {x: PAD.l, y: H - 4, class: "axis"}, span > 0 ? "-" + span + " s" : ""));
      this.svg.append(s("text", {x: W - PAD.r, y: H - 4, class: "axis", "text-anchor": "end"}, "now"));
      const summary = [];
      this.series.forEach((serie, i) => {
        let d = "", pen = false, latest = null;
        for (const p of points) {
          const v = this.value(p, serie);
          if (v === null) { pen = false; continue; }
          d += (pen ? "L" : "M") + x(p.t).toFixed(1) + " " + y(v).toFixed(1);
          pen = true;
          latest = v;
        }
        this.svg.append(s("path", {d: d || "M0 0", class: "line s" + (i % 6), "data-series": serie.label}));
        summary.push(serie.label + " " + (latest === null ? "–" : this.format(latest)));
        this.legend.append(TF.h("li", {class: "s" + (i % 6)}, TF.h("span", {class: "swatch"}), serie.label + ": ",
          TF.h("b", {}, latest === null ? "–" : this.format(latest))));
      });
      this.svg.setAttribute("aria-label", this.title + ": " + summary.join(", "));
      this.draws += 1;
      this.el.dataset.draws = String(this.draws);
      this.el.dataset.points = String(points.length);
    }
  }

  TF.LineChart = LineChart;
})();
