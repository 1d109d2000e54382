"use strict";
// Conversations kept in this browser (localStorage), several at once, with export and import as
// JSON. A conversation holds its mode (chat or completions), system prompt, the controls' values
// as typed, and its messages with each response's speed line.
(function () {
  const TF = (window.TF = window.TF || {});
  const STORE = "tokenforge.conversations", CURRENT = "tokenforge.current";
  const DEFAULT_PARAMS = {temperature: "0.7", top_p: "", top_k: "", max_tokens: "256", seed: "", stop: "",
    schema: "", tools: "", tool_choice: "auto", extra: ""};

  function uid() { return Date.now().toString(36) + Math.random().toString(36).slice(2, 8); }

  function fresh(mode) {
    return {id: uid(), title: mode === "completion" ? "New completion" : "New chat", mode: mode || "chat",
      system: "", params: Object.assign({}, DEFAULT_PARAMS), messages: [], created: Date.now()};
  }

  function valid(c) {
    return c && typeof c === "object" && typeof c.id === "string" && Array.isArray(c.messages);
  }

  function normalize(c) {
    const out = Object.assign(fresh(c.mode === "completion" ? "completion" : "chat"), c);
    out.params = Object.assign({}, DEFAULT_PARAMS, c.params || {});
    out.messages = c.messages.filter((m) => m && typeof m.role === "string")
      .map((m) => Object.assign({}, m, {content: typeof m.content === "string" ? m.content : ""}));
    out.title = String(out.title || "Untitled").slice(0, 80);
    return out;
  }

  class Conversations {
    constructor() {
      this.list = (TF.load(STORE, []) || []).filter(valid).map(normalize);
      if (!this.list.length) this.list.push(fresh("chat"));
      const current = TF.load(CURRENT, null);
      this.currentId = this.list.some((c) => c.id === current) ? current : this.list[0].id;
    }
    get current() { return this.list.find((c) => c.id === this.currentId) || this.list[0]; }
    select(id) { this.currentId = id; this.persist(); }
    add(mode) { const c = fresh(mode); this.list.unshift(c); this.currentId = c.id; this.persist(); return c; }
    remove(id) {
      this.list = this.list.filter((c) => c.id !== id);
      if (!this.list.length) this.list.push(fresh("chat"));
      if (!this.list.some((c) => c.id === this.currentId)) this.currentId = this.list[0].id;
      this.persist();
    }
    persist() {
      const clean = this.list.map((c) => Object.assign({}, c, {messages: c.messages.map((m) => {
        const copy = Object.assign({}, m);
        delete copy.streaming;
        return copy;
      })}));
      TF.save(STORE, clean);
      TF.save(CURRENT, this.currentId);
    }
    exportJSON() {
      return JSON.stringify({format: "tokenforge.conversations", version: 1, exported: new Date().toISOString(),
        conversations: this.list}, null, 2);
    }
    // Merge conversations from an export (or a bare list); returns how many were added.
    importJSON(text) {
      let data;
      try { data = JSON.parse(text); } catch (e) { throw new Error("not JSON: " + e.message); }
      const items = Array.isArray(data) ? data : data && Array.isArray(data.conversations) ? data.conversations : null;
      if (!items) throw new Error("expected an export of tokenforge conversations (a 'conversations' list)");
      const known = new Set(this.list.map((c) => c.id));
      const added = items.filter(valid).map(normalize).map((c) => (known.has(c.id) ? Object.assign(c, {id: uid()}) : c));
      if (!added.length) throw new Error("the file holds no conversations");
      this.list = added.concat(this.list);
      this.currentId = added[0].id;
      this.persist();
      return added.length;
    }
  }

  TF.Conversations = Conversations;
})();
