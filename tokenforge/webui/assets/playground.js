"use strict";
// The playground: conversations on the left, the chat (or completions) in the middle, the
// controls on the right. One response streams at a time; Stop aborts its HTTP request, which the
// server sees as a disconnect and aborts (freeing its KV blocks).
(function () {
  const TF = (window.TF = window.TF || {});
  const h = TF.h;

  const FIELDS = [
    ["temperature", "Temperature", "0.7"], ["top_p", "Top-p", "1"], ["top_k", "Top-k", "0 = off"],
    ["max_tokens", "Max tokens", "256"], ["seed", "Seed", "random"],
  ];

  class Playground {
    constructor(root, model) {
      this.root = root;
      this.model = model;
      this.store = new TF.Conversations();
      this.busy = null;            // {controller, conv} while a response streams
      this.error = "";
      this.build();
      this.show();
    }

    get conv() { return this.store.current; }

    build() {
      this.list = h("ul", {class: "conv-list", "aria-label": "Conversations"});
      this.fileInput = h("input", {type: "file", accept: "application/json,.json", class: "hidden", id: "import-file",
        onchange: (e) => this.importFile(e.target.files[0])});
      const side = h("aside", {class: "side", "aria-label": "Conversations"},
        h("details", {class: "panel", open: !matchMedia("(max-width: 800px)").matches},
          h("summary", {}, "Conversations"),
          h("div", {class: "row wrap"},
            h("button", {type: "button", id: "new-chat", onclick: () => this.newConv("chat")}, "New chat"),
            h("button", {type: "button", id: "new-completion", onclick: () => this.newConv("completion")}, "New completion")),
          this.list,
          h("div", {class: "row wrap"},
            h("button", {type: "button", id: "export", onclick: () => this.exportAll()}, "Export"),
            h("button", {type: "button", id: "import", onclick: () => this.fileInput.click()}, "Import"),
            h("button", {type: "button", id: "delete-conv", onclick: () => this.deleteConv()}, "Delete"),
            this.fileInput)));
      this.chat = h("div", {id: "chat", class: "chat", "aria-live": "polite", "aria-label": "Messages"});
      this.errorBox = h("div", {id: "error", class: "error", role: "alert"});
      this.input = h("textarea", {id: "prompt", rows: 3, "aria-label": "Message", placeholder: "Message (Enter sends, Shift+Enter: new line)",
        onkeydown: (e) => { if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); this.send(); } }});
      this.sendButton = h("button", {type: "button", id: "send", class: "primary", onclick: () => this.send()}, "Send");
      this.stopButton = h("button", {type: "button", id: "stop", disabled: true, onclick: () => this.stop()}, "Stop");
      this.regenButton = h("button", {type: "button", id: "regenerate", onclick: () => this.regenerate()}, "Regenerate");
      this.modeLabel = h("span", {class: "muted", id: "mode-label"});
      const center = h("section", {class: "center", "aria-label": "Chat"}, this.modeLabel, this.chat, this.errorBox,
        h("div", {class: "composer"}, this.input, h("div", {class: "row"}, this.sendButton, this.stopButton, this.regenButton)));
      this.controls = h("div", {class: "controls"});
      const settings = h("aside", {class: "settings", "aria-label": "Settings"},
        h("details", {class: "panel", open: !matchMedia("(max-width: 800px)").matches},
          h("summary", {}, "Settings"), this.controls));
      TF.clear(this.root).append(h("div", {class: "playground"}, side, center, settings));
    }

    field(id, label, value, onInput, attrs) {
      const input = h(attrs && attrs.rows ? "textarea" : "input", Object.assign({id: "p-" + id, value: attrs && attrs.rows ? null : value,
        oninput: (e) => onInput(e.target.value)}, attrs || {}));
      if (attrs && attrs.rows) input.value = value;
      return h("div", {class: "field"}, h("label", {for: "p-" + id}, label), input);
    }

    renderControls() {
      const c = this.conv, p = c.params, save = () => this.store.persist();
      const set = (key) => (v) => { p[key] = v; save(); };
      const parts = [];
      if (c.mode === "chat") {
        parts.push(this.field("system", "System prompt", c.system, (v) => { c.system = v; save(); },
          {rows: 3, placeholder: "You are a helpful assistant."}));
      }
      parts.push(h("div", {class: "grid2"}, FIELDS.map(([key, label, hint]) =>
        this.field(key, label, p[key], set(key), {type: "number", step: "any", inputmode: "decimal", placeholder: hint}))));
      parts.push(this.field("stop", "Stop (a string, or a JSON list)", p.stop, set("stop"), {type: "text", placeholder: '["\\n\\n"]'}));
      if (c.mode === "chat") {
        parts.push(this.field("schema", "Structured output: JSON schema", p.schema, set("schema"),
          {rows: 4, spellcheck: "false", placeholder: '{"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}'}));
        parts.push(this.field("tools", "Tools (JSON list of function definitions)", p.tools, set("tools"),
          {rows: 4, spellcheck: "false", placeholder: '[{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]'}));
        const choice = h("select", {id: "p-tool_choice", onchange: (e) => set("tool_choice")(e.target.value)},
          ["auto", "none", "required"].map((v) => h("option", {value: v, selected: p.tool_choice === v}, v)));
        parts.push(h("div", {class: "field"}, h("label", {for: "p-tool_choice"}, "Tool choice"), choice));
      }
      parts.push(this.field("extra", "Extra body fields (JSON object, e.g. min_p, repetition_penalty)", p.extra, set("extra"),
        {rows: 2, spellcheck: "false", placeholder: '{"min_p": 0.05}'}));
      TF.clear(this.controls).append(...parts);
    }

    renderList() {
      TF.clear(this.list);
      for (const c of this.store.list) {
        const current = c.id === this.store.currentId;
        this.list.append(h("li", {}, h("button", {type: "button", class: "conv" + (current ? " current" : ""),
          "aria-current": current ? "true" : null, "data-id": c.id, onclick: () => { this.store.select(c.id); this.show(); }},
        (c.mode === "completion" ? "✎ " : "") + c.title)));
      }
    }

    show() {
      this.renderList();
      this.renderControls();
      this.modeLabel.textContent = this.conv.mode === "completion" ? "Completions mode (/v1/completions): the text is continued as it is."
        : "Chat (/v1/chat/completions)";
      this.input.placeholder = this.conv.mode === "completion" ? "Prompt to continue (Enter sends)" : "Message (Enter sends, Shift+Enter: new line)";
      this.renderMessages();
      this.setBusy(this.busy);
    }

    renderMessages() {
      TF.clear(this.chat);
      this.conv.messages.forEach((m, i) => this.chat.append(this.messageView(m, i)));
      this.errorBox.textContent = this.error;
      this.chat.scrollTop = this.chat.scrollHeight;
    }

    messageView(m, index) {
      const assistant = m.role === "assistant" || m.role === "completion";
      const el = h("article", {class: "msg " + (assistant ? "assistant" : "user") + (m.streaming ? " streaming" : ""),
        "data-index": index, "data-role": m.role});
      const actions = h("div", {class: "actions"});
      if (!assistant && !this.busy) actions.append(h("button", {type: "button", class: "edit", onclick: () => this.edit(index)}, "Edit"));
      el.append(h("header", {}, h("span", {class: "role"}, m.role === "completion" ? "completion" : m.role === "prompt" ? "prompt" : m.role), actions));
      if (m.editing) {
        const box = h("textarea", {class: "edit-box", rows: 3, "aria-label": "Edit message"});
        box.value = m.content;
        el.append(box, h("div", {class: "row"},
          h("button", {type: "button", class: "primary resend", onclick: () => this.resend(index, box.value)}, "Save and send"),
          h("button", {type: "button", onclick: () => { delete m.editing; this.renderMessages(); }}, "Cancel")));
        setTimeout(() => box.focus(), 0);
        return el;
      }
      const split = assistant ? TF.md.splitReasoning(m.content) : {reasoning: "", content: m.content};
      const reasoning = (m.reasoning || "") + split.reasoning;
      if (reasoning) {
        el.append(h("details", {class: "reasoning", open: !!m.streaming}, h("summary", {}, "Reasoning"), h("div", {class: "reasoning-text"}, reasoning)));
      }
      if (!assistant || m.role === "completion") el.append(h("div", {class: "content plain"}, split.content));
      else if (m.json) el.append(this.jsonView(split.content, m.streaming));
      else el.append(h("div", {class: "content md"}, TF.md.render(split.content)));
      for (const call of m.tool_calls || []) el.append(this.toolCallView(call));
      if (m.stats) el.append(h("div", {class: "speed"}, TF.speedLine(m.stats)));
      return el;
    }

    jsonView(text, streaming) {
      let pretty = text, ok = false;
      try { pretty = JSON.stringify(JSON.parse(text), null, 2); ok = true; } catch (e) { /* partial or invalid */ }
      return h("div", {class: "content"}, h("div", {class: "badge " + (ok ? "ok" : streaming ? "" : "bad")},
        ok ? "valid JSON" : streaming ? "JSON…" : "not valid JSON"),
      h("pre", {class: "json-output"}, h("code", {}, TF.md.highlight(pretty, "json"))));
    }

    toolCallView(call) {
      let args = call.function.arguments;
      try { args = JSON.stringify(JSON.parse(args), null, 2); } catch (e) { /* show as sent */ }
      return h("div", {class: "tool-call", "data-name": call.function.name}, h("div", {class: "tool-head"},
        h("span", {class: "badge"}, "tool call"), h("code", {class: "tool-name"}, call.function.name), call.id ? h("span", {class: "muted"}, call.id) : null),
      h("pre", {class: "tool-args"}, h("code", {}, TF.md.highlight(args, "json"))));
    }

    setBusy(busy) {
      this.busy = busy;
      const here = busy && busy.conv === this.conv;
      this.sendButton.disabled = !!busy;
      this.regenButton.disabled = !!busy || !this.conv.messages.length;
      this.stopButton.disabled = !here;
      document.body.dataset.streaming = busy ? "1" : "";
    }

    newConv(mode) { this.error = ""; this.store.add(mode); this.show(); this.input.focus(); }
    deleteConv() { this.store.remove(this.conv.id); this.show(); }

    exportAll() {
      const blob = new Blob([this.store.exportJSON()], {type: "application/json"});
      const a = h("a", {href: URL.createObjectURL(blob), download: "tokenforge-conversations.json"});
      document.body.append(a);
      a.click();
      setTimeout(() => { URL.revokeObjectURL(a.href); a.remove(); }, 0);
    }

    async importFile(file) {
      if (!file) return;
      try { this.error = ""; this.store.importJSON(await file.text()); }
      catch (e) { this.error = "Import failed: " + e.message; }
      this.fileInput.value = "";
      this.show();
    }

    send() {
      const text = this.input.value;
      if (this.busy || !text.trim()) return;
      const c = this.conv;
      c.messages.push({role: c.mode === "completion" ? "prompt" : "user", content: text});
      if (c.title.startsWith("New ")) c.title = text.trim().slice(0, 40);
      this.input.value = "";
      this.respond(c);
    }

    regenerate() {
      const c = this.conv;
      if (this.busy || !c.messages.length) return;
      while (c.messages.length && ["assistant", "completion"].includes(c.messages[c.messages.length - 1].role)) c.messages.pop();
      if (c.messages.length) this.respond(c);
    }

    edit(index) { this.conv.messages[index].editing = true; this.renderMessages(); }

    resend(index, text) {
      const c = this.conv;
      c.messages = c.messages.slice(0, index + 1);
      delete c.messages[index].editing;
      c.messages[index].content = text;
      this.respond(c);
    }

    stop() { if (this.busy) this.busy.controller.abort(); }

    async respond(conv) {
      this.error = "";
      let request;
      try { request = TF.buildRequest(conv, conv.messages.length, this.model); }
      catch (e) { this.error = e.message; this.renderMessages(); return; }
      const record = {role: conv.mode === "completion" ? "completion" : "assistant", content: "", streaming: true, json: !!request.json};
      conv.messages.push(record);
      const controller = new AbortController();
      this.setBusy({controller, conv});
      if (conv === this.conv) this.renderMessages();      // at once: the old answer must not linger
      let frame = 0;
      const redraw = () => {
        if (frame) return;
        frame = requestAnimationFrame(() => { frame = 0; if (conv === this.conv) this.renderMessages(); });
      };
      try {
        await TF.runRequest(request, record, redraw, controller.signal);
      } catch (e) {
        conv.messages.pop();
        this.error = (e.status ? "Error " + e.status + ": " : "Error: ") + e.message;
      } finally {
        delete record.streaming;
        this.setBusy(null);
        this.store.persist();
        cancelAnimationFrame(frame);
        frame = 0;
        if (conv === this.conv) this.show();
      }
    }
  }

  TF.Playground = Playground;
})();
