"use strict";
// Markdown for model output, rendered straight to DOM nodes: text only ever becomes text nodes,
// so a <script> tag or an onerror attribute in the output is shown as the characters it is and
// never parsed as HTML. Links are kept for http(s) and mailto only. Code blocks are coloured by
// the small tokenizer below (comments, strings, numbers, keywords).
(function () {
  const TF = (window.TF = window.TF || {});
  const h = TF.h;

  const KEYWORDS = {
    python: "and as assert async await break class continue def del elif else except False finally for from global if import in is lambda None nonlocal not or pass raise return True try while with yield match case self print",
    js: "async await break case catch class const continue debugger default delete do else export extends false finally for function if import in instanceof let new null of return static super switch this throw true try typeof undefined var void while yield",
    c: "auto bool break case char const continue default do double else enum extern false float for fn go if impl int let long loop match mod mut namespace new nullptr pub return self short signed sizeof static struct switch template this true type typedef union unsigned use using var void volatile while func package import interface map range chan defer select class public private protected final",
    bash: "if then else elif fi for while do done case esac in function return export local echo cd exit set unset source true false sudo pip python",
    sql: "select from where and or not insert into values update set delete create table drop alter join left right inner outer on group by order limit having as distinct null is in like union all primary key index",
    json: "true false null",
  };
  const ALIASES = {py: "python", python: "python", js: "js", javascript: "js", ts: "js", typescript: "js",
    jsx: "js", tsx: "js", json: "json", sh: "bash", bash: "bash", shell: "bash", zsh: "bash", console: "bash",
    c: "c", cpp: "c", "c++": "c", h: "c", java: "c", go: "c", rust: "c", rs: "c", cs: "c", kotlin: "c",
    swift: "c", sql: "sql", yaml: "bash", yml: "bash", toml: "bash"};
  const HASH_COMMENTS = new Set(["python", "bash"]);
  const sets = {};
  for (const [lang, words] of Object.entries(KEYWORDS)) sets[lang] = new Set(words.split(" "));

  function tokenRegex(lang) {
    const comment = HASH_COMMENTS.has(lang) ? "#[^\\n]*" : lang === "sql" ? "--[^\\n]*" : lang === "json" ? "(?!)" : "\\/\\/[^\\n]*|\\/\\*[\\s\\S]*?(?:\\*\\/|$)";
    const strings = lang === "python" ? "\"\"\"[\\s\\S]*?(?:\"\"\"|$)|'''[\\s\\S]*?(?:'''|$)|" : "";
    return new RegExp("(" + comment + ")|(" + strings + "\"(?:\\\\.|[^\"\\\\\\n])*\"?|'(?:\\\\.|[^'\\\\\\n])*'?|`(?:\\\\.|[^`\\\\])*`?)" +
      "|(\\b(?:0[xX][0-9a-fA-F]+|\\d+(?:\\.\\d+)?(?:[eE][+-]?\\d+)?)\\b)|([A-Za-z_$][\\w$]*)", "g");
  }

  // code -> DocumentFragment of text nodes and <span class="tok-*"> (comment, string, number, keyword).
  function highlight(code, language) {
    const lang = ALIASES[(language || "").toLowerCase()] || "c";
    const keywords = sets[lang], re = tokenRegex(lang), frag = document.createDocumentFragment();
    let last = 0, m;
    while ((m = re.exec(code)) !== null) {
      if (m[0] === "") { re.lastIndex++; continue; }
      const cls = m[1] ? "tok-c" : m[2] ? "tok-s" : m[3] ? "tok-n" :
        (keywords.has(lang === "sql" ? m[4].toLowerCase() : m[4]) ? "tok-k" : null);
      if (!cls) continue;
      if (m.index > last) frag.append(code.slice(last, m.index));
      frag.append(h("span", {class: cls}, m[0]));
      last = m.index + m[0].length;
    }
    if (last < code.length) frag.append(code.slice(last));
    return frag;
  }

  const INLINE = new RegExp([
    "(`+)([\\s\\S]*?[^`])\\1(?!`)",              // 1,2 code
    "\\*\\*(?=\\S)([\\s\\S]*?\\S)\\*\\*",           // 3 strong
    "\\*(?=[^\\s*])([\\s\\S]*?[^\\s*])\\*",         // 4 em
    "~~(?=\\S)([\\s\\S]*?\\S)~~",                  // 5 del
    "\\[([^\\]\\n]+)\\]\\(([^)\\s]+)\\)",          // 6,7 link
    "(https?:\\/\\/[^\\s<>()]*[^\\s<>().,;:!?'\"])", // 8 bare URL
  ].join("|"), "g");
  const SAFE_URL = /^(https?:\/\/|mailto:)/i;

  function link(text, url) {
    if (!SAFE_URL.test(url)) return document.createTextNode(text === url ? text : text + " (" + url + ")");
    return h("a", {href: url, target: "_blank", rel: "noopener noreferrer nofollow"}, text);
  }

  function inline(text) {
    // A regex of its own per call: the nested calls below (strong, em, del) must not move the
    // outer call's lastIndex (a shared one sent it back to 0 after **x**: an endless loop).
    const re = new RegExp(INLINE.source, "g"), frag = document.createDocumentFragment();
    let last = 0, m;
    while ((m = re.exec(text)) !== null) {
      if (m.index > last) frag.append(text.slice(last, m.index));
      if (m[1]) frag.append(h("code", {}, m[2]));
      else if (m[3]) frag.append(h("strong", {}, inline(m[3])));
      else if (m[4]) frag.append(h("em", {}, inline(m[4])));
      else if (m[5]) frag.append(h("del", {}, inline(m[5])));
      else if (m[6]) frag.append(link(m[6], m[7]));
      else if (m[8]) frag.append(link(m[8], m[8]));
      last = m.index + m[0].length;
    }
    if (last < text.length) frag.append(text.slice(last));
    return frag;
  }

  function lines(text) {          // a paragraph's lines, with hard breaks between them
    const frag = document.createDocumentFragment();
    text.split("\n").forEach((line, i) => { if (i) frag.append(h("br")); frag.append(inline(line)); });
    return frag;
  }

  const FENCE = /^\s{0,3}(`{3,}|~{3,})\s*([^\s`]*)/;
  const HEADING = /^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$/;
  const RULE = /^\s{0,3}([-*_])(\s*\1){2,}\s*$/;
  const QUOTE = /^\s{0,3}>\s?/;
  const ITEM = /^(\s*)([-*+]|\d{1,9}[.)])\s+(.*)$/;
  const TABLE_SEP = /^\s*\|?\s*:?-{1,}:?\s*(\|\s*:?-{1,}:?\s*)*\|?\s*$/;

  function isBlockStart(line) {
    return FENCE.test(line) || HEADING.test(line) || RULE.test(line) || QUOTE.test(line) || ITEM.test(line);
  }
  function cells(row) { return row.trim().replace(/^\|/, "").replace(/\|$/, "").split("|").map((c) => c.trim()); }

  function render(text) {
    const out = document.createDocumentFragment();
    const src = String(text || "").replace(/\r\n?/g, "\n").split("\n");
    let i = 0;
    while (i < src.length) {
      const line = src[i];
      let m;
      if (!line.trim()) { i++; continue; }
      if ((m = FENCE.exec(line))) {
        const fence = m[1], body = [];
        for (i++; i < src.length && !src[i].trim().startsWith(fence); i++) body.push(src[i]);
        i++;
        const code = body.join("\n");
        const lang = m[2] || "";
        const copy = h("button", {type: "button", class: "copy", "aria-label": "Copy code"}, "Copy");
        copy.addEventListener("click", () => navigator.clipboard && navigator.clipboard.writeText(code).catch(() => {}));
        out.append(h("div", {class: "codeblock"}, h("div", {class: "codehead"}, h("span", {}, lang || "code"), copy),
          h("pre", {}, h("code", {class: lang ? "lang-" + lang.replace(/[^\w+-]/g, "") : null}, highlight(code, lang)))));
      } else if ((m = HEADING.exec(line))) {
        out.append(h("h" + Math.min(6, m[1].length + 2), {class: "md-h"}, inline(m[2])));
        i++;
      } else if (RULE.test(line)) {
        out.append(h("hr"));
        i++;
      } else if (QUOTE.test(line)) {
        const body = [];
        for (; i < src.length && QUOTE.test(src[i]); i++) body.push(src[i].replace(QUOTE, ""));
        out.append(h("blockquote", {}, render(body.join("\n"))));
      } else if ((m = ITEM.exec(line))) {
        const ordered = /\d/.test(m[2]);
        const list = h(ordered ? "ol" : "ul");
        if (ordered && parseInt(m[2], 10) !== 1) list.setAttribute("start", parseInt(m[2], 10));
        while (i < src.length && (m = ITEM.exec(src[i])) && /\d/.test(m[2]) === ordered) {
          const item = [m[3]];
          for (i++; i < src.length && src[i].trim() && !ITEM.test(src[i]) && !isBlockStart(src[i]); i++) item.push(src[i].trim());
          list.append(h("li", {}, lines(item.join("\n"))));
        }
        out.append(list);
      } else if (line.includes("|") && i + 1 < src.length && TABLE_SEP.test(src[i + 1]) && src[i + 1].includes("-")) {
        const head = cells(line);
        const table = h("table", {class: "md-table"}, h("thead", {}, h("tr", {}, head.map((c) => h("th", {}, inline(c))))));
        const body = h("tbody");
        for (i += 2; i < src.length && src[i].includes("|") && src[i].trim(); i++) {
          body.append(h("tr", {}, cells(src[i]).map((c) => h("td", {}, inline(c)))));
        }
        table.append(body);
        out.append(h("div", {class: "table-wrap"}, table));
      } else {
        const para = [line];
        for (i++; i < src.length && src[i].trim() && !isBlockStart(src[i]); i++) para.push(src[i]);
        out.append(h("p", {}, lines(para.join("\n"))));
      }
    }
    return out;
  }

  // "<think>...</think>" (or an unfinished <think>) in the content: the reasoning, shown apart.
  function splitReasoning(text) {
    const open = text.indexOf("<think>");
    if (open < 0) return {reasoning: "", content: text};
    const close = text.indexOf("</think>", open);
    if (close < 0) return {reasoning: text.slice(open + 7), content: text.slice(0, open)};
    return {reasoning: text.slice(open + 7, close), content: text.slice(0, open) + text.slice(close + 8)};
  }

  TF.md = {render, inline, highlight, splitReasoning};
})();
