"use strict";
// Start-up: theme, navigation, the API key button, then the view the path names.
(function () {
  const TF = window.TF;
  const THEME = "tokenforge.theme";

  function applyTheme(theme) {
    if (theme) document.documentElement.dataset.theme = theme;
    else delete document.documentElement.dataset.theme;
  }

  function ready(state) {        // tests wait for data-ready and read how long it took (ms)
    document.body.dataset.readyMs = String(Math.round(performance.now()));
    document.body.dataset.ready = state;
  }

  function setup() {
    applyTheme(TF.load(THEME, null));
    TF.$("#theme-button").addEventListener("click", () => {
      const dark = document.documentElement.dataset.theme ? document.documentElement.dataset.theme === "dark"
        : matchMedia("(prefers-color-scheme: dark)").matches;
      const next = dark ? "light" : "dark";
      TF.save(THEME, next);
      applyTheme(next);
    });
    TF.$("#key-button").addEventListener("click", () => TF.askKey(""));
    const dashboard = /\/dashboard\/?$/.test(location.pathname);
    const nav = TF.$(dashboard ? "#nav-dashboard" : "#nav-playground");
    nav.setAttribute("aria-current", "page");
    const view = TF.$("#view");
    if (dashboard) {
      document.title = "tokenforge · dashboard";
      TF.dashboard = new TF.Dashboard(view);
      ready("1");
      return;
    }
    document.title = "tokenforge · playground";
    TF.getJSON("/v1/models").then((list) => {
      const model = list.data && list.data[0] ? list.data[0].id : null;
      TF.$("#model-name").textContent = model || "";
      TF.playground = new TF.Playground(view, model);
      ready("1");
    }).catch((e) => {
      TF.clear(view).append(TF.h("p", {class: "error", role: "alert", id: "load-error"},
        "Cannot list the models: " + (e.status ? e.status + " " : "") + e.message));
      ready("error");
    });
  }

  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", setup);
  else setup();
})();
