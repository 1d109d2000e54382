"use strict";
// The dashboard: polls GET /ui/api/stats once a second (only the samples since the last poll)
// and draws the server's state, or, behind `tokenforge router`, its replicas.
(function () {
  const TF = (window.TF = window.TF || {});
  const h = TF.h;
  const KEEP = 600;
  const ms = (v) => (v === null || v === undefined ? "–" : TF.fmt.num(v * 1000, 0) + " ms");

  function card(label, id) {
    return h("div", {class: "card"}, h("div", {class: "card-label"}, label), h("div", {class: "card-value", id: "card-" + id}, "–"));
  }
  function setCard(id, text) { const el = TF.$("#card-" + id); if (el) el.textContent = text; }
  function table(head, rows, attrs) {
    return h("div", {class: "table-wrap"}, h("table", attrs || {}, h("thead", {}, h("tr", {}, head.map((c) => h("th", {scope: "col"}, c)))),
      h("tbody", {}, rows.map((r) => h("tr", {}, r.map((c) => h("td", {}, c)))))));
  }

  class Dashboard {
    constructor(root) {
      this.root = root;
      this.samples = [];
      this.since = 0;
      this.kind = null;
      this.charts = [];
      this.status = h("p", {class: "muted", id: "dash-status", role: "status"}, "Loading…");
      TF.clear(root).append(h("div", {class: "dashboard"}, this.status, this.body = h("div")));
      this.poll();
    }

    async poll() {
      try {
        const data = await TF.getJSON("/ui/api/stats?since=" + this.since);
        this.samples = this.samples.concat(data.samples).slice(-KEEP);
        if (this.samples.length) this.since = this.samples[this.samples.length - 1].t;
        if (data.kind !== this.kind) this.layout(data);
        this.draw(data);
        this.status.textContent = "Live · updated " + new Date().toLocaleTimeString() + " · every " + data.interval + " s";
      } catch (e) {
        this.status.textContent = "Cannot read /ui/api/stats: " + (e.status ? e.status + " " : "") + e.message;
      }
      this.timer = setTimeout(() => this.poll(), 1000);
    }

    layout(data) {
      this.kind = data.kind;
      this.charts = [];
      TF.clear(this.body);
      if (data.kind === "router") return this.layoutRouter(data);
      const chart = (title, series, fmt) => { const c = new TF.LineChart(title, series, fmt); this.charts.push(c); return c.el; };
      this.body.append(
        h("h2", {}, "Server ", h("span", {class: "muted", id: "dash-model"}, data.info.model)),
        h("div", {class: "cards"}, card("Running", "running"), card("Waiting", "waiting"), card("KV cache used", "kv"),
          card("Prefix-cache hits (1 min)", "prefix"), card("Tokens/s in", "tps-in"), card("Tokens/s out", "tps-out"),
          card("Preemptions", "preempt"), card("Uptime", "uptime")),
        h("div", {class: "charts"},
          chart("Requests", [{key: "running", label: "running"}, {key: "waiting", label: "waiting"}], (v) => TF.fmt.num(v, 0)),
          chart("KV cache usage", [{key: "kv_usage", label: "used"}], TF.fmt.pct),
          chart("Tokens/s", [{key: "prompt_tps", label: "in (prompt)"}, {key: "gen_tps", label: "out (generated)"}], (v) => TF.fmt.num(v, 0)),
          chart("TTFT over the last minute", [{key: "ttft_p50", label: "p50"}, {key: "ttft_p90", label: "p90"}, {key: "ttft_p99", label: "p99"}], ms),
          chart("TPOT (time between tokens)", [{key: "tpot_p50", label: "p50"}, {key: "tpot_p90", label: "p90"}, {key: "tpot_p99", label: "p99"}], ms),
          chart("Prefix-cache hit rate", [{key: "prefix_hit_rate", label: "hits / lookups"}], TF.fmt.pct)),
        h("div", {class: "panels"},
          h("section", {class: "panel-box"}, h("h3", {}, "KV tiers"), this.tiers = h("div", {id: "kv-tiers"})),
          h("section", {class: "panel-box"}, h("h3", {}, "Finished requests"), this.finished = h("div", {id: "finished"})),
          h("section", {class: "panel-box"}, h("h3", {}, "Start-up phases"), this.phases = h("div", {id: "phases"})),
          h("section", {class: "panel-box wide"}, h("h3", {}, "Model and flags"), this.flags = h("div", {id: "flags"}))));
      this.renderInfo(data.info);
    }

    renderInfo(info) {
      const phases = Object.entries(info.startup_phases || {});
      const total = info.startup_phases && info.startup_phases.total;
      TF.clear(this.phases).append(phases.length ? h("ul", {class: "bars"}, phases.map(([name, s]) => {
        const bar = h("span", {class: "bar"});
        bar.style.width = total ? Math.max(1, (100 * s) / total).toFixed(1) + "%" : "0";
        return h("li", {}, h("span", {class: "bar-label"}, name), h("span", {class: "bar-track"}, bar), h("span", {}, TF.fmt.num(s, 2) + " s"));
      })) : h("p", {class: "muted"}, "Not reported by this engine."));
      const flat = [];
      for (const [section, fields] of Object.entries(info.flags || {})) {
        for (const [key, value] of Object.entries(fields)) flat.push([section + "." + key, JSON.stringify(value)]);
      }
      const changed = new Set(info.changed || []);
      TF.clear(this.flags).append(
        table(["", ""], [["model", info.model], ["version", info.version || "–"], ["checksum", (info.checksum || "–").slice(0, 16)],
          ["max_model_len", String(info.max_model_len)], ["tokenforge", info.tokenforge]], {class: "kv"}),
        h("p", {}, "Flags changed from their defaults:"),
        table(["flag", "value"], flat.filter(([k]) => changed.has(k)), {id: "changed-flags"}),
        h("details", {}, h("summary", {}, "All engine flags"), table(["flag", "value"], flat)),
        h("details", {}, h("summary", {}, "Server settings"), table(["setting", "value"],
          Object.entries(info.server || {}).map(([k, v]) => [k, JSON.stringify(v)]))));
    }

    draw(data) {
      if (data.kind === "router") return this.drawRouter(data);
      const t = data.totals, last = this.samples[this.samples.length - 1] || {};
      setCard("running", String(t.running));
      setCard("waiting", String(t.waiting));
      setCard("kv", TF.fmt.pct(t.kv_usage) + " of " + t.num_kv_blocks + " blocks");
      setCard("prefix", TF.fmt.pct(last.prefix_hit_rate));
      setCard("tps-in", TF.fmt.num(last.prompt_tps || 0, 1));
      setCard("tps-out", TF.fmt.num(last.gen_tps || 0, 1));
      setCard("preempt", String(t.preemptions));
      setCard("uptime", TF.fmt.num(data.info.uptime_s, 0) + " s");
      for (const c of this.charts) c.update(this.samples);
      const tiers = t.kv_tiers;
      TF.clear(this.tiers).append(tiers ? table(["tier", "hits", "misses", "bytes restored", "puts"],
        ["cpu", "disk", "remote"].map((k) => [k, String(tiers.hits[k] || 0), String(tiers.misses[k] || 0),
          TF.fmt.bytes(tiers.bytes_restored[k] || 0), String(tiers.puts[k] || 0)])) :
        h("p", {class: "muted"}, "No KV tier configured (--kv-offload-cpu-gb, --kv-offload-disk-dir, --kv-remote)."));
      const finished = Object.entries(t.finished || {});
      TF.clear(this.finished).append(finished.length ? table(["finish reason", "requests"], finished.map(([k, v]) => [k, String(v)]))
        : h("p", {class: "muted"}, "None yet."), h("p", {class: "muted"},
        "Tokens: " + t.prompt_tokens + " in, " + t.generation_tokens + " out; prefix cache " + t.prefix_cache_hits + " / " + t.prefix_cache_queries + " tokens"));
    }

    layoutRouter(data) {
      this.replicaUrls = data.replicas.map((r) => r.url).join(" ");
      const per = (field) => data.replicas.map((r) => ({label: r.url.replace(/^https?:\/\//, ""), key: (p) => (p.replicas[r.url] || {})[field]}));
      const chart = (title, series, fmt) => { const c = new TF.LineChart(title, series, fmt); this.charts.push(c); return c.el; };
      this.body.append(
        h("h2", {}, "Router ", h("span", {class: "muted"}, "policy " + data.info.policy)),
        h("div", {class: "cards"}, card("Replicas admitted", "admitted"), card("Requests/s", "rps"), card("Prefix affinity", "affinity"),
          card("Failed requests", "failed"), card("Uptime", "uptime")),
        h("section", {class: "panel-box wide"}, h("h3", {}, "Replicas"), this.replicaTable = h("div", {id: "replicas"})),
        h("div", {class: "charts"},
          chart("Waiting per replica", per("waiting"), (v) => TF.fmt.num(v, 0)),
          chart("In flight per replica (this router)", per("in_flight"), (v) => TF.fmt.num(v, 0)),
          chart("Requests/s per replica", per("rps"), (v) => TF.fmt.num(v, 1)),
          chart("KV usage per replica", per("kv_usage"), TF.fmt.pct)));
    }

    drawRouter(data) {
      if (data.replicas.map((r) => r.url).join(" ") !== this.replicaUrls) { this.charts = []; TF.clear(this.body); this.layoutRouter(data); }
      const sum = (o) => Object.values(o || {}).reduce((a, b) => a + b, 0);
      let placed = 0, byPrefix = 0;
      const rows = data.replicas.map((r) => {
        const total = sum(r.requests), prefix = (r.requests || {}).prefix || 0;
        placed += total - ((r.requests || {}).retry || 0);
        byPrefix += prefix;
        const state = h("span", {class: "state " + r.state}, r.state);
        return [h("code", {}, r.url), state, r.reason || "", r.healthy ? "yes" : "no", TF.fmt.num(r.waiting, 0), TF.fmt.num(r.running, 0),
          TF.fmt.pct(r.kv_usage), String(r.in_flight), String(total), total ? TF.fmt.pct(prefix / total) : "–",
          String((r.events || {}).ejected || 0), (r.model || "–") + (r.version ? " " + r.version : "")];
      });
      TF.clear(this.replicaTable).append(table(["replica", "state", "why", "healthy", "waiting", "running", "KV", "in flight",
        "requests", "by prefix", "ejections", "model"], rows, {id: "replica-table"}));
      const last = this.samples[this.samples.length - 1] || {replicas: {}};
      setCard("admitted", data.replicas.filter((r) => r.state === "admitted").length + " / " + data.replicas.length);
      setCard("rps", TF.fmt.num(Object.values(last.replicas).reduce((a, r) => a + (r.rps || 0), 0), 1));
      setCard("affinity", placed ? TF.fmt.pct(byPrefix / placed) + " by prefix" : "–");
      setCard("failed", String(sum(data.failed)));
      setCard("uptime", TF.fmt.num(data.info.uptime_s, 0) + " s");
      for (const c of this.charts) c.update(this.samples);
    }
  }

  TF.Dashboard = Dashboard;
})();
