"use strict";
// From the controls (as typed) to an OpenAI request body, and from its stream to a response
// record: content, reasoning, tool calls, and the speed line (tokens in and out, time to first
// token, tokens/s, finish reason). Values are sent as given: the server's validation judges them.
(function () {
  const TF = (window.TF = window.TF || {});

  class InputError extends Error {}
  TF.InputError = InputError;

  function json(text, what) {
    try { return JSON.parse(text); }
    catch (e) { throw new InputError(what + " is not valid JSON: " + e.message); }
  }

  const NUMBERS = ["temperature", "top_p", "top_k", "max_tokens", "seed"];

  function sampling(params) {
    const body = {};
    for (const key of NUMBERS) {
      const raw = String(params[key] ?? "").trim();
      if (raw !== "") body[key] = Number.isNaN(Number(raw)) ? raw : Number(raw);
    }
    const stop = String(params.stop || "").trim();
    if (stop) body.stop = stop.startsWith("[") ? json(stop, "Stop") : stop;
    return body;
  }

  function extra(params) {
    const raw = String(params.extra || "").trim();
    if (!raw) return {};
    const value = json(raw, "Extra body");
    if (!value || typeof value !== "object" || Array.isArray(value)) throw new InputError("Extra body must be a JSON object");
    return value;
  }

  function history(conv, upTo) {
    const messages = [];
    if (conv.system.trim()) messages.push({role: "system", content: conv.system});
    for (const m of conv.messages.slice(0, upTo)) {
      if (m.error) continue;
      const entry = {role: m.role, content: m.content};
      if (m.tool_calls && m.tool_calls.length) entry.tool_calls = m.tool_calls;
      if (m.tool_call_id) entry.tool_call_id = m.tool_call_id;
      messages.push(entry);
    }
    return messages;
  }

  // The request for the response at conv.messages[index] (everything before it is the input).
  TF.buildRequest = function buildRequest(conv, index, model) {
    const p = conv.params;
    const base = Object.assign({model, stream: true, stream_options: {include_usage: true}}, sampling(p));
    if (conv.mode === "completion") {
      return {path: "/v1/completions", body: Object.assign(base, {prompt: conv.messages[index - 1].content}, extra(p))};
    }
    const body = Object.assign(base, {messages: history(conv, index)});
    const schema = String(p.schema || "").trim();
    if (schema) {
      body.response_format = {type: "json_schema", json_schema: {name: "output", schema: json(schema, "The JSON schema")}};
    }
    const tools = String(p.tools || "").trim();
    if (tools) {
      const parsed = json(tools, "Tools");
      body.tools = (Array.isArray(parsed) ? parsed : [parsed]).map((t) => (t && t.type ? t : {type: "function", function: t}));
      if (p.tool_choice && p.tool_choice !== "auto") body.tool_choice = p.tool_choice;
    }
    return {path: "/v1/chat/completions", body: Object.assign(body, extra(p)), json: !!schema};
  };

  // Stream a request into `record` (an assistant message); onUpdate() after each change.
  TF.runRequest = async function runRequest(request, record, onUpdate, signal) {
    const start = performance.now();
    let first = null, deltas = 0;
    const calls = [];
    record.content = "";
    record.reasoning = "";
    record.stats = {};
    const touch = () => { if (first === null) first = performance.now(); deltas += 1; };
    try {
      await TF.stream(request.path, request.body, (event) => {
        if (event.usage) {
          record.stats.prompt_tokens = event.usage.prompt_tokens;
          record.stats.completion_tokens = event.usage.completion_tokens;
        }
        for (const choice of event.choices || []) {
          const delta = choice.delta || {};
          const text = choice.text !== undefined ? choice.text : delta.content;
          const reasoning = delta.reasoning_content || delta.reasoning;
          if (text) { record.content += text; touch(); }
          if (reasoning) { record.reasoning += reasoning; touch(); }
          for (const call of delta.tool_calls || []) {
            touch();
            const slot = calls[call.index || 0] || (calls[call.index || 0] = {id: "", type: "function", function: {name: "", arguments: ""}});
            if (call.id) slot.id = call.id;
            if (call.function && call.function.name) slot.function.name += call.function.name;
            if (call.function && call.function.arguments) slot.function.arguments += call.function.arguments;
          }
          if (choice.finish_reason) record.stats.finish_reason = choice.finish_reason;
        }
        if (calls.length) record.tool_calls = calls.filter(Boolean);
        onUpdate();
      }, signal);
    } catch (err) {
      if (!(err && err.name === "AbortError")) throw err;
      record.stats.finish_reason = "stopped";
      record.stats.approximate = true;
    } finally {
      const end = performance.now(), s = record.stats;
      if (s.completion_tokens === undefined) s.completion_tokens = deltas;
      s.ttft_ms = first === null ? null : first - start;
      s.total_ms = end - start;
      // Streamed in pieces: the decode rate after the first token. In one piece (a constrained tool
      // call is sent whole at the end): over the whole request, not over the last few ms.
      s.tokens_per_s = first === null || s.completion_tokens < 2 ? null
        : deltas > 1 && end > first ? (s.completion_tokens - 1) / ((end - first) / 1000)
        : s.completion_tokens / ((end - start) / 1000);
      onUpdate();
    }
  };

  TF.speedLine = function speedLine(s) {
    if (!s) return "";
    const parts = [];
    if (s.prompt_tokens !== undefined) parts.push(s.prompt_tokens + " in");
    if (s.completion_tokens !== undefined) parts.push((s.approximate ? "≈" : "") + s.completion_tokens + " out");
    if (s.ttft_ms !== undefined) parts.push("TTFT " + (s.ttft_ms === null ? "–" : TF.fmt.num(s.ttft_ms, 0) + " ms"));
    if (s.tokens_per_s !== undefined) parts.push((s.tokens_per_s === null ? "–" : TF.fmt.num(s.tokens_per_s, 1)) + " tok/s");
    if (s.finish_reason) parts.push("finish: " + s.finish_reason);
    return parts.join(" · ");
  };
})();
