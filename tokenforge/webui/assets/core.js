"use strict";
// Shared helpers: DOM building (text only, never HTML strings), the API key, fetch with the
// server's error messages, and a reader for OpenAI-style server-sent events.
(function () {
  const TF = (window.TF = window.TF || {});
  const KEY_STORE = "tokenforge.apiKey";

  // h("div", {class: "x", onclick: f}, "text", node, [more]) -> element. Text is always a text
  // node: nothing handed to h is ever parsed as HTML.
  TF.h = function h(tag, attrs, ...children) {
    const ns = attrs && attrs.ns;
    const el = ns ? document.createElementNS(ns, tag) : document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v === null || v === undefined || v === false || k === "ns") continue;
      if (k.startsWith("on") && typeof v === "function") el.addEventListener(k.slice(2), v);
      else if (k === "text") el.textContent = v;
      else el.setAttribute(k, v === true ? "" : String(v));
    }
    TF.append(el, children);
    return el;
  };
  TF.append = function append(el, children) {
    for (const c of children.flat(Infinity)) {
      if (c === null || c === undefined || c === false) continue;
      el.append(c instanceof Node ? c : document.createTextNode(String(c)));
    }
    return el;
  };
  TF.$ = (sel, root) => (root || document).querySelector(sel);
  TF.clear = (el) => { while (el.firstChild) el.removeChild(el.firstChild); return el; };

  TF.load = function (name, fallback) {
    try { const v = localStorage.getItem(name); return v === null ? fallback : JSON.parse(v); }
    catch (e) { return fallback; }
  };
  TF.save = function (name, value) {
    try { localStorage.setItem(name, JSON.stringify(value)); return true; }
    catch (e) { return false; }
  };

  class ApiError extends Error {
    constructor(status, message, body) { super(message); this.status = status; this.body = body; }
  }
  TF.ApiError = ApiError;

  TF.apiKey = () => TF.load(KEY_STORE, "");
  TF.setApiKey = (key) => TF.save(KEY_STORE, key);

  function headers(extra) {
    const out = Object.assign({}, extra || {});
    const key = TF.apiKey();
    if (key) out.Authorization = "Bearer " + key;
    return out;
  }

  async function errorOf(response) {
    let body = null, message = response.status + " " + response.statusText;
    try {
      body = await response.json();
      if (body && body.error && body.error.message) message = body.error.message;
      else if (body && body.detail) message = typeof body.detail === "string" ? body.detail : JSON.stringify(body.detail);
    } catch (e) { /* not JSON: keep the status line */ }
    return new ApiError(response.status, message, body);
  }

  // fetch with the key; a 401 asks for a key (once) and tries again with it.
  // A wrong key asks again, with the server's message, until a key works or the user cancels.
  TF.request = async function request(path, options, attempt) {
    const tries = attempt || 0;
    const opts = Object.assign({}, options || {});
    opts.headers = headers(opts.headers);
    const response = await fetch(path, opts);
    if (response.ok) return response;
    const err = await errorOf(response);
    if (err.status === 401 && tries < 5 && !(opts.signal && opts.signal.aborted)) {
      const key = await TF.askKey(tries || TF.apiKey() ? "The key was refused: " + err.message : "");
      if (key !== null) return TF.request(path, options, tries + 1);
    }
    throw err;
  };
  TF.getJSON = async (path) => (await TF.request(path)).json();

  // The key dialog: resolves with the key entered, or null when cancelled.
  let pending = null;
  TF.askKey = function askKey(message) {
    const dialog = TF.$("#key-dialog");
    TF.$("#key-error").textContent = message || "";
    if (pending) return pending;
    pending = new Promise((resolve) => {
      const form = TF.$("#key-form"), input = TF.$("#key-input");
      input.value = "";
      const done = (value) => {
        form.removeEventListener("submit", onSubmit);
        TF.$("#key-cancel").removeEventListener("click", onCancel);
        dialog.close();
        pending = null;
        resolve(value);
      };
      const onSubmit = (ev) => { ev.preventDefault(); TF.setApiKey(input.value.trim()); done(input.value.trim()); };
      const onCancel = () => done(null);
      form.addEventListener("submit", onSubmit);
      TF.$("#key-cancel").addEventListener("click", onCancel);
      if (!dialog.open) dialog.showModal();
      input.focus();
    });
    return pending;
  };

  // POST `body` to `path` and call onEvent(json) for every `data:` event until [DONE].
  TF.stream = async function stream(path, body, onEvent, signal) {
    const response = await TF.request(path, {
      method: "POST", body: JSON.stringify(body), signal,
      headers: {"Content-Type": "application/json", Accept: "text/event-stream"},
    });
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const {value, done} = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, {stream: true});
      let at;
      while ((at = buffer.indexOf("\n\n")) >= 0) {
        const block = buffer.slice(0, at);
        buffer = buffer.slice(at + 2);
        for (const line of block.split("\n")) {
          if (!line.startsWith("data:")) continue;
          const data = line.slice(5).trim();
          if (data === "[DONE]") return;
          let event;
          try { event = JSON.parse(data); } catch (e) { continue; }
          if (event.error) throw new ApiError(event.error.code || 500, event.error.message || "stream error", event);
          onEvent(event);
        }
      }
    }
  };

  TF.fmt = {
    num(v, digits) {
      if (v === null || v === undefined || Number.isNaN(v)) return "–";
      const d = digits === undefined ? (Math.abs(v) >= 100 ? 0 : Math.abs(v) >= 10 ? 1 : 2) : digits;
      return Number(v).toFixed(d);
    },
    ms(seconds) { return seconds === null || seconds === undefined ? "–" : TF.fmt.num(seconds * 1000, 0) + " ms"; },
    pct(v) { return v === null || v === undefined ? "–" : TF.fmt.num(v * 100, 1) + " %"; },
    bytes(v) {
      if (!v) return "0 B";
      const units = ["B", "KiB", "MiB", "GiB", "TiB"];
      let i = 0;
      while (v >= 1024 && i < units.length - 1) { v /= 1024; i++; }
      return TF.fmt.num(v, i ? 1 : 0) + " " + units[i];
    },
  };
})();
