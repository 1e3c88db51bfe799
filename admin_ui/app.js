/* loraplex admin UI: one page, plain JavaScript, no build step, no third-party code.
 *
 * Talks to /admin/api (JSON). Signs in with the admin token for an HttpOnly session
 * cookie; every change sends the session's CSRF token in X-CSRF-Token. The DOM is built
 * with createElement/textContent only (never innerHTML with data), and the page's CSP
 * allows scripts and styles from this origin alone.
 */
"use strict";

(() => {
  const API = "/admin/api";
  const LANES = ["interactive", "standard", "batch"];
  const COLORS = ["#4c6ef5", "#12b886", "#fab005", "#e64980", "#7950f2", "#15aabf", "#fd7e14", "#82c91e", "#adb5bd"];
  const state = { session: null, page: null, timer: null, renderId: 0, tenants: null, quotas: true };

  // -- DOM helpers ---------------------------------------------------------------------
  const $ = (sel, root = document) => root.querySelector(sel);

  function h(tag, attrs, ...kids) {
    const el = document.createElement(tag);
    setAttrs(el, attrs);
    append(el, kids);
    return el;
  }

  function s(tag, attrs, ...kids) { // SVG
    const el = document.createElementNS("http://www.w3.org/2000/svg", tag);
    for (const [k, v] of Object.entries(attrs || {})) if (v !== null && v !== undefined) el.setAttribute(k, String(v));
    append(el, kids);
    return el;
  }

  function setAttrs(el, attrs) {
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v === null || v === undefined || v === false) continue;
      if (k.startsWith("on") && typeof v === "function") el.addEventListener(k.slice(2), v);
      else if (k === "class") el.className = v;
      else if (k === "for") el.htmlFor = v;
      else if (k === "text") el.textContent = v;
      else if (["value", "checked", "disabled", "hidden", "required", "multiple", "selected"].includes(k)) el[k] = v;
      else el.setAttribute(k, v === true ? "" : String(v));
    }
  }

  function append(el, kids) {
    for (const kid of kids.flat(Infinity)) {
      if (kid === null || kid === undefined || kid === false) continue;
      el.append(kid instanceof Node ? kid : document.createTextNode(String(kid)));
    }
  }

  function clear(el) { while (el.firstChild) el.removeChild(el.firstChild); return el; }

  function toast(msg, bad = false) {
    const t = h("div", { class: "toast" + (bad ? " bad" : ""), role: bad ? "alert" : "status" }, msg);
    $("#toasts").append(t);
    setTimeout(() => t.remove(), bad ? 7000 : 3500);
  }

  function showError(box, err) {
    box.textContent = err && err.message ? err.message : String(err);
    box.hidden = false;
  }

  // -- formatting ------------------------------------------------------------------------
  const nf = new Intl.NumberFormat();
  const fmtNum = (n) => (n === null || n === undefined ? "–" : nf.format(n));

  function fmtShort(n) {
    if (n === null || n === undefined) return "–";
    const a = Math.abs(n);
    const unit = (d, suffix) => (n / d).toFixed(a >= 10 * d ? 0 : 1).replace(/\.0$/, "") + suffix;
    if (a >= 1e9) return unit(1e9, "B");
    if (a >= 1e6) return unit(1e6, "M");
    if (a >= 1e3) return unit(1e3, "k");
    return String(Math.round(n * 100) / 100);
  }

  function fmtBytes(n) {
    if (n === null || n === undefined) return "–";
    const units = ["B", "KiB", "MiB", "GiB"];
    let i = 0;
    while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
    return (i ? n.toFixed(n >= 100 ? 0 : 1) : n) + " " + units[i];
  }

  function fmtTime(iso) {
    if (!iso) return "–";
    const d = new Date(iso);
    const p = (x) => String(x).padStart(2, "0");
    return `${d.getFullYear()}-${p(d.getMonth() + 1)}-${p(d.getDate())} ${p(d.getHours())}:${p(d.getMinutes())}`;
  }

  function fmtAgo(iso) {
    if (!iso) return "never";
    const sec = (Date.now() - new Date(iso).getTime()) / 1000;
    const fut = sec < 0;
    const a = Math.abs(sec);
    const txt = a < 60 ? "moments" : a < 3600 ? `${Math.round(a / 60)} min` : a < 86400 ? `${Math.round(a / 3600)} h`
      : `${Math.round(a / 86400)} days`;
    return fut ? `in ${txt}` : `${txt} ago`;
  }

  const timeEl = (iso, rel = false) => h("span", { title: iso || "" }, rel ? fmtAgo(iso) : fmtTime(iso));
  const shortDigest = (d) => (d ? d.replace("sha256:", "").slice(0, 12) : "–");

  // -- the API ---------------------------------------------------------------------------
  class ApiError extends Error {
    constructor(status, message, param) { super(message); this.status = status; this.param = param; }
  }

  async function api(method, path, body) {
    const headers = { Accept: "application/json" };
    if (body !== undefined) headers["Content-Type"] = "application/json";
    if (method !== "GET" && state.session && state.session.csrf_token) headers["X-CSRF-Token"] = state.session.csrf_token;
    let resp;
    try {
      resp = await fetch(API + path, {
        method, headers, credentials: "same-origin", body: body === undefined ? undefined : JSON.stringify(body),
      });
    } catch (e) {
      throw new ApiError(0, "The server did not answer (is it running?)");
    }
    return handle(resp.status, await resp.text());
  }

  function handle(status, text) {
    let data = null;
    try { data = text ? JSON.parse(text) : null; } catch (e) { data = null; }
    if (status >= 200 && status < 300) return data;
    const err = data && data.error ? data.error : { message: `HTTP ${status}` };
    if (status === 401 && state.session) {
      state.session = null;
      showSignin(err.message);
    }
    throw new ApiError(status, err.message || `HTTP ${status}`, err.param);
  }

  /** multipart upload with progress (XHR: fetch has no upload progress). */
  function upload(path, form, onProgress) {
    return new Promise((resolve, reject) => {
      const xhr = new XMLHttpRequest();
      xhr.open("POST", API + path);
      xhr.setRequestHeader("Accept", "application/json");
      if (state.session && state.session.csrf_token) xhr.setRequestHeader("X-CSRF-Token", state.session.csrf_token);
      xhr.upload.onprogress = (e) => { if (e.lengthComputable) onProgress(e.loaded / e.total, e.loaded, e.total); };
      xhr.onload = () => {
        try { resolve(handle(xhr.status, xhr.responseText)); } catch (e) { reject(e); }
      };
      xhr.onerror = () => reject(new ApiError(0, "The upload failed: the connection was lost"));
      xhr.send(form);
    });
  }

  async function tenants(refresh = false) {
    if (!state.tenants || refresh) state.tenants = await api("GET", "/tenants");
    return state.tenants;
  }

  // -- session ---------------------------------------------------------------------------
  function showSignin(message) {
    stopTimer();
    $("#app").hidden = true;
    $("#signin").hidden = false;
    const err = $("#signin-error");
    err.hidden = !message;
    err.textContent = message || "";
    $("#signin-token").focus();
  }

  async function signedIn(session) {
    state.session = session;
    $("#signin").hidden = true;
    $("#app").hidden = false;
    $("#whoami").textContent = session.actor;
    $("#whoami").title = "Changes are recorded in the audit log under this name";
    try {
      const eng = await api("GET", "/engine");
      $("#model-name").textContent = eng.model;
    } catch (e) { /* shown on the engine page */ }
    route();
  }

  $("#signin-form").addEventListener("submit", async (ev) => {
    ev.preventDefault();
    const btn = $("#signin-submit");
    btn.disabled = true;
    try {
      const session = await api("POST", "/session", { token: $("#signin-token").value.trim() });
      $("#signin-token").value = "";
      await signedIn(session);
    } catch (e) {
      showError($("#signin-error"), e);
    } finally {
      btn.disabled = false;
    }
  });

  $("#signout").addEventListener("click", async () => {
    try { await api("DELETE", "/session"); } catch (e) { /* signed out anyway */ }
    state.session = null;
    state.tenants = null;
    showSignin("Signed out.");
  });

  // -- routing ---------------------------------------------------------------------------
  const PAGES = { tenants: pageTenants, keys: pageKeys, adapters: pageAdapters, usage: pageUsage,
    engine: pageEngine, audit: pageAudit };

  function stopTimer() { if (state.timer) { clearInterval(state.timer); state.timer = null; } }

  async function route() {
    if (!state.session) return;
    const name = (location.hash.replace(/^#\/?/, "") || "tenants").split("?")[0];
    const page = PAGES[name] ? name : "tenants";
    stopTimer();
    state.page = page;
    const id = ++state.renderId;
    for (const a of document.querySelectorAll(".sidenav a")) a.classList.toggle("active", a.dataset.page === page);
    const main = clear($("#main"));
    main.dataset.page = page;
    main.setAttribute("aria-busy", "true");
    try {
      await PAGES[page](main, () => id === state.renderId);
    } catch (e) {
      if (id === state.renderId && e.status !== 401) main.append(h("div", { class: "error" }, e.message));
    } finally {
      if (id === state.renderId) main.setAttribute("aria-busy", "false");
    }
  }
  window.addEventListener("hashchange", route);

  function head(title, sub, ...right) {
    return h("div", { class: "page-head" }, h("div", {}, h("h1", {}, title), h("p", {}, sub)),
      h("div", { class: "actions" }, right));
  }

  /** A button that asks once more before doing something destructive. */
  function confirmButton(label, confirmLabel, action, attrs = {}) {
    let armed = false;
    let timer = null;
    const btn = h("button", { class: "btn small danger", type: "button", ...attrs }, label);
    btn.addEventListener("click", async () => {
      if (!armed) {
        armed = true;
        btn.textContent = confirmLabel;
        timer = setTimeout(() => { armed = false; btn.textContent = label; }, 4000);
        return;
      }
      clearTimeout(timer);
      btn.disabled = true;
      try { await action(); } catch (e) { toast(e.message, true); btn.disabled = false; armed = false; btn.textContent = label; }
    });
    return btn;
  }

  function laneSelect(id, value) {
    return h("select", { id }, LANES.map((l) => h("option", { value: l, selected: l === value }, l)));
  }

  function laneChecks(prefix, lane, allowed) {
    const wrap = h("div", { class: "checks", id: prefix + "-allowed" });
    const update = (lane2) => {
      for (const cb of wrap.querySelectorAll("input")) {
        const above = LANES.indexOf(cb.value) < LANES.indexOf(lane2);
        cb.disabled = above || cb.value === lane2;
        if (above) cb.checked = false;
        if (cb.value === lane2) cb.checked = true;
      }
    };
    for (const l of LANES) {
      wrap.append(h("label", {}, h("input", { type: "checkbox", value: l, checked: allowed.includes(l) }), l));
    }
    update(lane);
    return { el: wrap, update, value: () => [...wrap.querySelectorAll("input:checked")].map((x) => x.value) };
  }

  // -- quotas ----------------------------------------------------------------------------
  const QUOTA_FIELDS = [
    ["rpm", "Requests / min"], ["tpm", "Tokens / min"], ["max_concurrency", "Concurrent"], ["token_budget", "Token budget"],
  ];

  function quotaInputs(prefix, q) {
    q = q || {};
    const fields = QUOTA_FIELDS.map(([k, label]) => h("div", { class: "field" },
      h("label", { for: `${prefix}-${k}` }, label),
      h("input", { id: `${prefix}-${k}`, type: "number", min: 0, step: 1, placeholder: "no limit",
        value: q[k] === null || q[k] === undefined ? "" : String(q[k]) })));
    const period = h("select", { id: `${prefix}-budget_period` },
      h("option", { value: "month", selected: q.budget_period !== "day" }, "per month"),
      h("option", { value: "day", selected: q.budget_period === "day" }, "per day"));
    const el = h("fieldset", {}, h("legend", {}, "Quotas (empty: no limit)"),
      h("div", { class: "form-row" }, fields, h("div", { class: "field" }, h("label", { for: period.id }, "Budget period"), period)));
    const value = () => {
      const out = {};
      for (const [k] of QUOTA_FIELDS) {
        const raw = $(`#${prefix}-${k}`, el).value.trim();
        out[k] = raw === "" ? null : Number(raw);
      }
      out.budget_period = out.token_budget === null ? null : period.value;
      return out;
    };
    return { el, value };
  }

  function quotaSummary(q) {
    if (!q) return h("span", { class: "muted" }, "–");
    const parts = [];
    if (q.rpm !== null) parts.push(`${fmtShort(q.rpm)} rpm`);
    if (q.tpm !== null) parts.push(`${fmtShort(q.tpm)} tpm`);
    if (q.max_concurrency !== null) parts.push(`${q.max_concurrency} concurrent`);
    if (q.token_budget !== null) {
      const pct = q.token_budget ? Math.round((100 * (q.budget_used || 0)) / q.token_budget) : 100;
      parts.push(`${fmtShort(q.token_budget)}/${q.budget_period} (${pct}% used)`);
    }
    return parts.length ? h("span", { class: "small" }, parts.join(" · ")) : h("span", { class: "muted small" }, "no limits");
  }

  // -- scheduling: weight and request timeout ---------------------------------------------
  function schedulingInputs(prefix, t) {
    const weight = h("input", { id: `${prefix}-weight`, type: "number", min: 0.001, max: 1000, step: "any",
      value: t ? String(t.weight) : "1" });
    const timeout = h("input", { id: `${prefix}-timeout`, type: "number", min: 0, step: "any",
      placeholder: "server default", value: t && t.request_timeout ? String(t.request_timeout) : "" });
    const el = [
      h("div", { class: "field" }, h("label", { for: weight.id, title: "Its share of the engine inside a lane, relative to other tenants" }, "Weight"), weight),
      h("div", { class: "field" }, h("label", { for: timeout.id }, "Request timeout (s)"), timeout)];
    // Empty timeout: the server's default (null); the API checks the ranges and names the field.
    const value = () => ({
      weight: weight.value.trim() === "" ? 1 : Number(weight.value),
      request_timeout: timeout.value.trim() === "" ? null : Number(timeout.value),
    });
    return { el, value };
  }

  function schedulingSummary(t) {
    const timeout = t.request_timeout ? ` · ${t.request_timeout} s timeout` : "";
    return h("span", { class: "small" }, `${t.weight}${timeout}`);
  }

  // -- Tenants -----------------------------------------------------------------------------
  async function pageTenants(main, current) {
    main.append(head("Tenants", "Who may call the API, in which priority lanes, within which quotas."));
    const list = await tenants(true);
    if (!current()) return;
    state.quotas = list.length === 0 || list.some((t) => t.quotas !== null);

    const lane = laneSelect("tenant-lane", "standard");
    const allowed = laneChecks("tenant", "standard", LANES.slice(1));
    lane.addEventListener("change", () => allowed.update(lane.value));
    const quotas = quotaInputs("tenant-q", null);
    const sched = schedulingInputs("tenant", null);
    const err = h("div", { class: "error", hidden: true, role: "alert", id: "tenant-error" });
    const name = h("input", { id: "tenant-name", type: "text", placeholder: "acme", maxlength: 64, required: true,
      autocomplete: "off" });
    const form = h("form", { class: "card", id: "tenant-form" },
      h("h2", {}, "New tenant"),
      h("div", { class: "form-row" },
        h("div", { class: "field grow" }, h("label", { for: "tenant-name" }, "Name"), name),
        h("div", { class: "field" }, h("label", { for: "tenant-lane" }, "Lane"), lane),
        h("div", { class: "field" }, h("span", { class: "label" }, "May also ask for"), allowed.el),
        ...sched.el,
        h("button", { class: "btn primary", type: "submit", id: "tenant-create" }, "Create tenant")),
      state.quotas ? quotas.el : null, err);
    form.addEventListener("submit", async (ev) => {
      ev.preventDefault();
      err.hidden = true;
      const body = { name: name.value.trim(), default_lane: lane.value, allowed_lanes: allowed.value(),
        ...sched.value() };
      if (state.quotas) {
        const q = quotas.value();
        if (Object.values(q).some((v) => v !== null)) body.quotas = q;
      }
      try {
        await api("POST", "/tenants", body);
        toast(`Tenant ${body.name} created`);
        route();
      } catch (e) { showError(err, e); }
    });
    main.append(form);

    const table = h("table", { id: "tenants-table" },
      h("thead", {}, h("tr", {}, h("th", {}, "Name"), h("th", {}, "Lane"), h("th", {}, "Allowed lanes"),
        h("th", {}, "Status"), h("th", { class: "num" }, "Active keys"), h("th", {}, "Weight"), h("th", {}, "Quotas"),
        h("th", {}))));
    const tbody = h("tbody");
    table.append(tbody);
    for (const t of list) tbody.append(...tenantRows(t));
    main.append(spacer(), h("div", { class: "card flush" }, list.length ? table
      : h("div", { class: "empty" }, "No tenants yet: create the first one above.")));
  }

  function tenantRows(t) {
    const row = h("tr", { "data-tenant": t.name },
      h("td", {}, h("strong", {}, t.name)),
      h("td", {}, h("span", { class: "badge" }, t.default_lane)),
      h("td", { class: "small" }, t.allowed_lanes.join(", ")),
      h("td", {}, h("span", { class: "badge " + (t.enabled ? "ok" : "off") }, t.enabled ? "enabled" : "disabled")),
      h("td", { class: "num" }, t.num_keys),
      h("td", { class: "weight" }, schedulingSummary(t)),
      h("td", {}, quotaSummary(t.quotas)),
      h("td", {}, h("div", { class: "actions" },
        h("button", { class: "btn small", type: "button", onclick: () => toggleEdit() }, "Edit"),
        t.enabled
          ? confirmButton("Disable", "Disable now?", async () => {
            await api("PATCH", `/tenants/${encodeURIComponent(t.name)}`, { enabled: false });
            toast(`Tenant ${t.name} disabled: its keys stop working`);
            route();
          })
          : h("button", { class: "btn small", type: "button", onclick: async () => {
            try {
              await api("PATCH", `/tenants/${encodeURIComponent(t.name)}`, { enabled: true });
              toast(`Tenant ${t.name} enabled`);
              route();
            } catch (e) { toast(e.message, true); }
          } }, "Enable"))));
    const edit = h("tr", { class: "subrow", hidden: true });
    let built = false;
    function toggleEdit() {
      if (!built) { buildEdit(); built = true; }
      edit.hidden = !edit.hidden;
      row.classList.toggle("editing", !edit.hidden);
    }
    function buildEdit() {
      const lane = laneSelect(`edit-${t.name}-lane`, t.default_lane);
      const allowed = laneChecks(`edit-${t.name}`, t.default_lane, t.allowed_lanes);
      lane.addEventListener("change", () => allowed.update(lane.value));
      const quotas = quotaInputs(`edit-${t.name}-q`, t.quotas);
      const sched = schedulingInputs(`edit-${t.name}`, t);
      const err = h("div", { class: "error", hidden: true, role: "alert" });
      const save = h("button", { class: "btn primary small", type: "button" }, "Save");
      save.addEventListener("click", async () => {
        err.hidden = true;
        const body = { default_lane: lane.value, allowed_lanes: allowed.value(), ...sched.value() };
        if (t.quotas !== null) body.quotas = quotas.value();
        try {
          await api("PATCH", `/tenants/${encodeURIComponent(t.name)}`, body);
          toast(`Tenant ${t.name} saved`);
          route();
        } catch (e) { showError(err, e); }
      });
      edit.append(h("td", { colspan: 8 },
        h("div", { class: "form-row" },
          h("div", { class: "field" }, h("label", { for: lane.id }, "Lane"), lane),
          h("div", { class: "field" }, h("span", { class: "label" }, "May also ask for"), allowed.el),
          ...sched.el,
          save, h("button", { class: "btn small", type: "button", onclick: toggleEdit }, "Cancel")),
        t.quotas !== null ? quotas.el : null, err));
    }
    return [row, edit];
  }

  // -- Keys ----------------------------------------------------------------------------------
  async function pageKeys(main, current) {
    const list = await tenants(true);
    if (!current()) return;
    main.append(head("API keys", "A key is shown once, when it is created; afterwards only its prefix."));
    const secretBox = h("div", { class: "secret-box", id: "key-secret", hidden: true });
    const tenantSel = h("select", { id: "key-tenant", required: true },
      list.filter((t) => t.enabled).map((t) => h("option", { value: t.name }, t.name)));
    const name = h("input", { id: "key-name", type: "text", placeholder: "e.g. production backend", maxlength: 128 });
    const days = h("input", { id: "key-expires", type: "number", min: 1, step: 1, placeholder: "never" });
    const err = h("div", { class: "error", hidden: true, role: "alert", id: "key-error" });
    const form = h("form", { class: "card", id: "key-form" }, h("h2", {}, "New API key"),
      list.length ? h("div", { class: "form-row" },
        h("div", { class: "field" }, h("label", { for: "key-tenant" }, "Tenant"), tenantSel),
        h("div", { class: "field grow" }, h("label", { for: "key-name" }, "Note"), name),
        h("div", { class: "field" }, h("label", { for: "key-expires" }, "Expires in (days)"), days),
        h("button", { class: "btn primary", type: "submit", id: "key-create" }, "Create key"))
        : h("p", { class: "muted" }, "Create a tenant first."), err);
    form.addEventListener("submit", async (ev) => {
      ev.preventDefault();
      err.hidden = true;
      const body = { tenant: tenantSel.value };
      if (name.value.trim()) body.name = name.value.trim();
      if (days.value.trim()) body.expires_in_days = Number(days.value);
      try {
        const k = await api("POST", "/keys", body);
        showSecret(secretBox, k);
        name.value = "";
        days.value = "";
        await loadKeys();
      } catch (e) { showError(err, e); }
    });

    const fTenant = h("select", { id: "keys-filter-tenant" }, h("option", { value: "" }, "All tenants"),
      list.map((t) => h("option", { value: t.name }, t.name)));
    const fPrefix = h("input", { id: "keys-filter-prefix", type: "text", placeholder: "lpx_3f9a…", maxlength: 20 });
    const fStatus = h("select", { id: "keys-filter-status" }, h("option", { value: "" }, "Any status"),
      ["active", "expired", "revoked"].map((x) => h("option", { value: x }, x)));
    const tableWrap = h("div", { class: "card flush", id: "keys-list" });
    const filters = h("div", { class: "form-row card" },
      h("div", { class: "field" }, h("label", { for: fTenant.id }, "Tenant"), fTenant),
      h("div", { class: "field grow" }, h("label", { for: fPrefix.id }, "Prefix starts with"), fPrefix),
      h("div", { class: "field" }, h("label", { for: fStatus.id }, "Status"), fStatus));
    let debounce = null;
    for (const el of [fTenant, fStatus]) el.addEventListener("change", () => loadKeys());
    fPrefix.addEventListener("input", () => { clearTimeout(debounce); debounce = setTimeout(loadKeys, 250); });

    async function loadKeys() {
      const q = new URLSearchParams();
      if (fTenant.value) q.set("tenant", fTenant.value);
      if (fPrefix.value.trim()) q.set("prefix", fPrefix.value.trim());
      if (fStatus.value) q.set("status", fStatus.value);
      let keys;
      try {
        keys = await api("GET", "/keys?" + q.toString());
      } catch (e) {
        clear(tableWrap).append(h("div", { class: "error" }, e.message));
        return;
      }
      clear(tableWrap);
      if (!keys.length) { tableWrap.append(h("div", { class: "empty" }, "No keys match.")); return; }
      const tbody = h("tbody");
      for (const k of keys) {
        const badge = { active: "ok", revoked: "off", expired: "warn" }[k.status];
        tbody.append(h("tr", { "data-key": k.prefix },
          h("td", { class: "mono" }, k.prefix),
          h("td", {}, k.tenant),
          h("td", {}, k.name || h("span", { class: "muted" }, "–")),
          h("td", {}, h("span", { class: "badge " + badge }, k.status)),
          h("td", {}, timeEl(k.created_at)),
          h("td", {}, k.expires_at ? h("span", { title: k.expires_at }, fmtAgo(k.expires_at)) : h("span", { class: "muted" }, "never")),
          h("td", {}, k.last_used_at ? timeEl(k.last_used_at, true) : h("span", { class: "muted" }, "never")),
          h("td", {}, k.status === "revoked" ? null : h("div", { class: "actions" },
            confirmButton("Revoke", "Revoke now?", async () => {
              await api("DELETE", `/keys/${encodeURIComponent(k.prefix)}`);
              toast(`Key ${k.prefix} revoked`);
              await loadKeys();
            })))));
      }
      tableWrap.append(h("table", { id: "keys-table" }, h("thead", {}, h("tr", {},
        ["Prefix", "Tenant", "Note", "Status", "Created", "Expires", "Last used", ""].map((x) => h("th", {}, x)))), tbody));
    }
    main.append(secretBox, form, spacer(), filters, spacer(), tableWrap);
    await loadKeys();
  }

  function spacer() { return h("div", { class: "spacer" }); }

  function showSecret(box, k) {
    const input = h("input", { type: "text", readonly: true, value: k.key, id: "key-secret-value",
      "aria-label": "The new API key" });
    const copy = h("button", { class: "btn primary", type: "button", id: "key-copy" }, "Copy");
    copy.addEventListener("click", async () => {
      try {
        await navigator.clipboard.writeText(k.key);
      } catch (e) {
        input.select();
        document.execCommand("copy");
      }
      copy.textContent = "Copied";
      setTimeout(() => { copy.textContent = "Copy"; }, 2000);
    });
    clear(box).append(
      h("div", {}, h("strong", {}, "Copy this key now: it will not be shown again."),
        ` Key ${k.prefix} for tenant ${k.tenant}` + (k.expires_at ? `, expires ${fmtTime(k.expires_at)}.` : ".")),
      h("div", { class: "secret-row" }, input, copy,
        h("button", { class: "btn", type: "button", onclick: () => { clear(box); box.hidden = true; } }, "Done")));
    box.hidden = false;
    input.focus();
    input.select();
  }

  // -- Adapters ----------------------------------------------------------------------------
  const RESIDENCY = { device: ["device", "GPU slot"], cpu: ["cpu", "CPU memory"], disk: ["disk", "disk"],
    store: ["disk", "shared store"], missing: ["off", "missing from store"] };

  function residencyBadge(r, deviceName) {
    const [cls, label] = RESIDENCY[r] || ["disk", r];
    const text = r === "device" && deviceName && !deviceName.startsWith("cuda") ? "device slot" : label;
    return h("span", { class: "badge " + cls, title: "Where the current version is now" }, text);
  }

  function progressUI(id) {
    const bar = h("div");
    const wrap = h("div", { class: "progress", id, hidden: true, role: "progressbar", "aria-valuemin": 0,
      "aria-valuemax": 100, "aria-valuenow": 0 }, bar);
    const label = h("div", { class: "progress-label", hidden: true, id: id + "-label" });
    return {
      els: [wrap, label],
      set(frac, loaded, total) {
        wrap.hidden = false;
        label.hidden = false;
        const pct = Math.round(frac * 100);
        bar.style.width = pct + "%";
        wrap.setAttribute("aria-valuenow", String(pct));
        label.textContent = frac >= 1 ? "Uploaded; validating…" : `${pct}% · ${fmtBytes(loaded)} of ${fmtBytes(total)}`;
      },
      done(text) { label.textContent = text; },
      hide() { wrap.hidden = true; label.hidden = true; bar.style.width = "0"; },
    };
  }

  // An adapter's kind: the tags of loraplex.adapters.features ("dora", "modules_to_save:lm_head,norm", ...);
  // [] is plain LoRA, null a version recorded before kinds were.
  const FEATURES = {
    rslora: ["rsLoRA", "use_rslora: each module's scale is alpha / √rank"],
    dora: ["DoRA", "use_dora: a magnitude vector rescales each targeted projection"],
    lora_bias: ["LoRA bias", "lora_bias: a bias on every lora_B"],
    trainable_tokens: ["trainable tokens", "trainable_token_indices: token rows replaced in"],
    modules_to_save: ["saved modules", "modules_to_save: saved whole"],
  };

  function kindKey(features) {
    if (!Array.isArray(features)) return "unknown";
    return features.length ? features.map((t) => t.split(":")[0]).join(" ") : "lora";
  }

  function kindView(features, full) {
    if (!Array.isArray(features)) {
      return h("span", { class: "muted small", title: "Recorded before loraplex kept adapter kinds; a new upload of "
        + "the same files records it" }, "unknown");
    }
    if (!features.length) return h("span", { class: "badge", title: "Plain LoRA" }, "LoRA");
    return h("div", { class: "chips" }, features.map((tag) => {
      const [name, modules] = tag.split(":");
      const [label, hint] = FEATURES[name] || [name, tag];
      const list = modules ? modules.split(",").join(", ") : "";
      return h("span", { class: "badge kind", "data-feature": name, title: list ? `${hint}: ${list}` : hint },
        full && list ? `${label}: ${list}` : label);
    }));
  }

  function adapterDetails(a) {
    return h("dl", { class: "kv" },
      h("dt", {}, "Kind"),
      h("dd", { "data-field": "kind", "data-kind": kindKey(a.features) }, kindView(a.features, true)),
      h("dt", {}, "Rank"), h("dd", { "data-field": "rank" }, a.rank ?? "–"),
      h("dt", {}, "Alpha"), h("dd", { "data-field": "alpha" }, a.alpha ?? "–"),
      h("dt", {}, "Targets"), h("dd", { "data-field": "targets" }, a.target_modules.join(", ")),
      h("dt", {}, "Size"), h("dd", { "data-field": "size" }, fmtBytes(a.size_bytes)),
      h("dt", {}, "Digest"), h("dd", { class: "mono", "data-field": "digest" }, a.digest));
  }

  async function pageAdapters(main, current) {
    const [list, ts, eng] = await Promise.all([api("GET", "/adapters"), tenants(true),
      api("GET", "/engine").catch(() => ({ device: "" }))]);
    if (!current()) return;
    main.append(head("Adapters", "PEFT LoRA adapters: uploaded, validated, then served to the tenants allowed to use them."));

    // upload
    const name = h("input", { id: "adapter-name", type: "text", placeholder: "sql-helper", maxlength: 64, required: true,
      autocomplete: "off" });
    const files = h("input", { id: "adapter-files", type: "file", multiple: true, required: true,
      accept: ".json,.safetensors,.zip,application/zip,application/json" });
    const pub = h("input", { id: "adapter-public", type: "checkbox" });
    const grant = h("select", { id: "adapter-grant" }, h("option", { value: "" }, "(no tenant yet)"),
      ts.map((t) => h("option", { value: t.name }, t.name)));
    const err = h("div", { class: "error", hidden: true, role: "alert", id: "upload-error" });
    const result = h("div", { class: "success", hidden: true, id: "upload-result" });
    const prog = progressUI("upload-progress");
    const submit = h("button", { class: "btn primary", type: "submit", id: "adapter-upload" }, "Upload");
    const form = h("form", { class: "card", id: "adapter-form" }, h("h2", {}, "Upload an adapter"),
      h("div", { class: "form-row" },
        h("div", { class: "field" }, h("label", { for: name.id }, "Name"), name),
        h("div", { class: "field grow" }, h("label", { for: files.id }, "Files: adapter_config.json + adapter_model.safetensors, or one .zip"), files),
        h("div", { class: "field" }, h("label", { for: grant.id }, "Grant to"), grant),
        h("div", { class: "field" }, h("span", { class: "label" }, "Access"),
          h("div", { class: "checks" }, h("label", {}, pub, "public (every tenant)"))),
        submit),
      prog.els, err, result);
    form.addEventListener("submit", async (ev) => {
      ev.preventDefault();
      err.hidden = true;
      result.hidden = true;
      const fd = new FormData();
      fd.append("name", name.value.trim());
      if (pub.checked) fd.append("public", "true");
      if (grant.value) fd.append("grants", grant.value);
      for (const f of files.files) fd.append("files", f, f.name);
      submit.disabled = true;
      prog.set(0, 0, [...files.files].reduce((n, f) => n + f.size, 0));
      try {
        const a = await upload("/adapters", fd, prog.set);
        prog.done("Done.");
        clear(result).append(h("strong", {}, `Adapter ${a.name} is ready.`), adapterDetails(a));
        result.hidden = false;
        name.value = "";
        files.value = "";
        await loadList();
      } catch (e) {
        prog.hide();
        showError(err, e);
      } finally {
        submit.disabled = false;
      }
    });

    const tableWrap = h("div", { class: "card flush", id: "adapters-list" });
    main.append(form, spacer(), tableWrap);

    async function loadList(fresh) {
      const adapters = fresh || await api("GET", "/adapters");
      clear(tableWrap);
      if (!adapters.length) { tableWrap.append(h("div", { class: "empty" }, "No adapters yet: upload one above.")); return; }
      const tbody = h("tbody");
      for (const a of adapters) tbody.append(...adapterRows(a));
      tableWrap.append(h("table", { id: "adapters-table" }, h("thead", {}, h("tr", {},
        h("th", {}, "Name"), h("th", { class: "num" }, "Rank"), h("th", {}, "Kind"), h("th", {}, "Targets"),
        h("th", { class: "num" }, "Size"),
        h("th", {}, "Digest"), h("th", {}, "Access"), h("th", {}, "Resident"), h("th", {}))), tbody));
    }

    function adapterRows(a) {
      const enc = encodeURIComponent(a.name);
      const access = h("div", { class: "chips" });
      if (a.public) access.append(h("span", { class: "badge ok" }, "public"));
      if (a.owner) access.append(h("span", { class: "badge", title: "owner" }, `owner: ${a.owner}`));
      for (const g of a.grants) {
        access.append(h("span", { class: "chip", "data-grant": g }, g,
          h("button", { type: "button", title: `Take ${g}'s grant away`, "aria-label": `Revoke grant of ${g}`,
            onclick: async () => {
              try { await api("DELETE", `/adapters/${enc}/grants/${encodeURIComponent(g)}`); toast(`Grant of ${g} revoked`); await loadList(); } catch (e) { toast(e.message, true); }
            } }, "×")));
      }
      if (!a.public && !a.owner && !a.grants.length) access.append(h("span", { class: "muted small" }, "nobody yet"));

      const grantSel = h("select", { class: "grant-select", "aria-label": `Grant ${a.name} to` },
        h("option", { value: "" }, "Grant to…"),
        ts.filter((t) => !a.grants.includes(t.name)).map((t) => h("option", { value: t.name }, t.name)));
      grantSel.addEventListener("change", async () => {
        if (!grantSel.value) return;
        try {
          await api("PUT", `/adapters/${enc}/grants/${encodeURIComponent(grantSel.value)}`);
          toast(`${a.name} granted to ${grantSel.value}`);
          await loadList();
        } catch (e) { toast(e.message, true); grantSel.value = ""; }
      });
      const pubBtn = h("button", { class: "btn small", type: "button" }, a.public ? "Make private" : "Make public");
      pubBtn.addEventListener("click", async () => {
        try {
          await api("PATCH", `/adapters/${enc}`, { public: !a.public });
          toast(`${a.name} is now ${a.public ? "private" : "public"}`);
          await loadList();
        } catch (e) { toast(e.message, true); }
      });
      const replaceInput = h("input", { type: "file", multiple: true, hidden: true,
        accept: ".json,.safetensors,.zip,application/zip,application/json", "aria-label": `New version of ${a.name}` });
      const replaceBtn = h("button", { class: "btn small", type: "button", onclick: () => replaceInput.click() }, "Replace…");
      const sub = h("tr", { class: "subrow", hidden: true });
      const prog2 = progressUI(`replace-${a.name}-progress`);
      const err2 = h("div", { class: "error", hidden: true, role: "alert" });
      sub.append(h("td", { colspan: 9 }, prog2.els, err2));
      const details = h("tr", { class: "subrow details", hidden: true, "data-details": a.name },
        h("td", { colspan: 9 }, adapterDetails(a)));
      const toggle = h("button", { class: "linklike", type: "button", "aria-expanded": "false",
        title: "Show this adapter's details" }, h("strong", {}, a.name));
      toggle.addEventListener("click", () => {
        details.hidden = !details.hidden;
        toggle.setAttribute("aria-expanded", String(!details.hidden));
      });
      replaceInput.addEventListener("change", async () => {
        if (!replaceInput.files.length) return;
        const fd = new FormData();
        for (const f of replaceInput.files) fd.append("files", f, f.name);
        sub.hidden = false;
        err2.hidden = true;
        try {
          const b = await upload(`/adapters/${enc}/versions`, fd, prog2.set);
          toast(`${a.name}: new version ${shortDigest(b.digest)} (rank ${b.rank}) is live`);
          await loadList();
        } catch (e) {
          prog2.hide();
          showError(err2, e);
        } finally { replaceInput.value = ""; }
      });
      const row = h("tr", { "data-adapter": a.name },
        h("td", { class: "nowrap" }, toggle,
          a.num_versions > 1 ? h("div", { class: "muted small" }, `${a.num_versions} versions kept`) : null),
        h("td", { class: "num" }, a.rank ?? "–"),
        h("td", { class: "kind", "data-kind": kindKey(a.features) }, kindView(a.features, false)),
        h("td", { class: "small" }, a.target_modules.join(", ")),
        h("td", { class: "num nowrap" }, fmtBytes(a.size_bytes)),
        h("td", { class: "mono", title: a.digest }, shortDigest(a.digest)),
        h("td", {}, access),
        h("td", {}, residencyBadge(a.residency, eng.device)),
        h("td", {}, h("div", { class: "actions" }, grantSel, pubBtn, replaceBtn, replaceInput,
          confirmButton("Remove", "Remove for good?", async () => {
            await api("DELETE", `/adapters/${enc}`);
            toast(`Adapter ${a.name} removed`);
            await loadList();
          }))));
      return [row, details, sub];
    }

    await loadList(list);
  }

  // -- Usage ---------------------------------------------------------------------------------
  const RANGES = {
    "24h": { label: "Last 24 hours", granularity: "hour", periods: 24 },
    "7d": { label: "Last 7 days", granularity: "hour", periods: 24 * 7 },
    "30d": { label: "Last 30 days", granularity: "day", periods: 30 },
    "90d": { label: "Last 90 days", granularity: "day", periods: 90 },
  };

  function rangeBounds(key) {
    const r = RANGES[key];
    const step = r.granularity === "day" ? 86400e3 : 3600e3;
    const end = Math.floor(Date.now() / step) * step + step;
    return { from: new Date(end - step * r.periods).toISOString(), to: new Date(end).toISOString(),
      granularity: r.granularity, step };
  }

  async function pageUsage(main, current) {
    const ts = await tenants(true);
    if (!current()) return;
    const range = h("select", { id: "usage-range" },
      Object.entries(RANGES).map(([k, r]) => h("option", { value: k, selected: k === "24h" }, r.label)));
    const tenant = h("select", { id: "usage-tenant" }, h("option", { value: "" }, "All tenants"),
      ts.map((t) => h("option", { value: t.name }, t.name)));
    const exportLinks = h("div", { class: "export", id: "usage-export" });
    main.append(head("Usage", "Tokens billed (prompt + completion) over time, from the hourly rollups."),
      h("div", { class: "card form-row" },
        h("div", { class: "field" }, h("label", { for: range.id }, "Range"), range),
        h("div", { class: "field" }, h("label", { for: tenant.id }, "Tenant"), tenant),
        h("div", { class: "field grow" }), h("div", { class: "field" }, h("span", { class: "label" }, "Export (per request)"), exportLinks)),
      spacer());
    const byTenant = h("div", { class: "card", id: "usage-tenants" });
    const byAdapter = h("div", { class: "card", id: "usage-adapters" });
    main.append(h("div", { class: "grid2" }, byTenant, byAdapter));

    async function load() {
      const b = rangeBounds(range.value);
      const q = new URLSearchParams({ from: b.from, to: b.to, granularity: b.granularity });
      if (tenant.value) q.set("tenant", tenant.value);
      clear(exportLinks);
      for (const [fmt, label] of [["csv", "CSV"], ["jsonl", "JSON lines"], ["cloudevents", "CloudEvents"]]) {
        const eq = new URLSearchParams({ format: fmt, from: b.from, to: b.to });
        if (tenant.value) eq.set("tenant", tenant.value);
        exportLinks.append(h("a", { class: "btn small", href: `${API}/usage/export?${eq}`, download: "",
          "data-format": fmt }, label));
      }
      for (const [el, group, title] of [[byTenant, "tenant", "Tokens per tenant"], [byAdapter, "adapter", "Tokens per adapter"]]) {
        clear(el).append(h("div", { class: "card-title" }, h("h2", {}, title)));
        try {
          const data = await api("GET", `/usage?${q}&group_by=${group}`);
          el.append(usageChart(data, b.step));
        } catch (e) {
          el.append(h("div", { class: e.status === 404 && !tenant.value ? "empty" : "error" },
            e.status === 404 && !tenant.value ? "Usage metering is not available in this build." : e.message));
        }
      }
    }
    range.addEventListener("change", load);
    tenant.addEventListener("change", load);
    await load();
  }

  /** A round tick step (1, 2 or 5 × 10^k, at least 1) giving about `n` ticks up to v. */
  function niceStep(v, n) {
    const raw = Math.max(1, v / n);
    const p = Math.pow(10, Math.floor(Math.log10(raw)));
    for (const m of [1, 2, 5, 10]) if (m * p >= raw) return m * p;
    return 10 * p;
  }

  /** A stacked bar chart of total tokens per period, one colour per series (hand-drawn SVG). */
  function usageChart(data, step) {
    const start = new Date(data.from).getTime();
    const end = new Date(data.to).getTime();
    const n = Math.max(1, Math.round((end - start) / step));
    const top = data.series.slice(0, COLORS.length - 1);
    const rest = data.series.slice(COLORS.length - 1);
    const series = top.map((x, i) => ({ key: x.key, color: COLORS[i], total: x.totals.total_tokens, points: x.points }));
    if (rest.length) {
      series.push({ key: `${rest.length} others`, color: COLORS[COLORS.length - 1],
        total: rest.reduce((a, x) => a + x.totals.total_tokens, 0), points: rest.flatMap((x) => x.points) });
    }
    const grid = series.map(() => new Array(n).fill(0));
    series.forEach((sr, i) => {
      for (const p of sr.points) {
        const k = Math.floor((new Date(p.t).getTime() - start) / step);
        if (k >= 0 && k < n) grid[i][k] += p.total_tokens;
      }
    });
    const sums = new Array(n).fill(0).map((_, k) => grid.reduce((a, row) => a + row[k], 0));
    const total = sums.reduce((a, b) => a + b, 0);
    const wrap = h("div", { class: "chart-wrap", "data-total": total });
    if (!total) {
      wrap.append(h("div", { class: "empty" }, "No usage in this range yet."));
      return wrap;
    }
    const W = 640, H = 240, L = 48, R = 8, T = 10, B = 26;
    const pw = W - L - R, ph = H - T - B;
    const ystep = niceStep(Math.max(...sums), 4);
    const ticks = Math.max(1, Math.ceil(Math.max(...sums) / ystep));
    const ymax = ystep * ticks;
    const svg = s("svg", { class: "chart", viewBox: `0 0 ${W} ${H}`, role: "img",
      "aria-label": `Stacked bars of tokens per period; ${fmtNum(total)} tokens in all` });
    for (let i = 0; i <= ticks; i++) {
      const y = T + ph - (ph * i) / ticks;
      svg.append(s("line", { x1: L, x2: W - R, y1: y, y2: y, class: i ? "gridline" : "axis" }),
        s("text", { x: L - 6, y: y + 4, "text-anchor": "end" }, fmtShort(ystep * i)));
    }
    const band = pw / n;
    const bw = Math.max(1, band * 0.78);
    for (let k = 0; k < n; k++) {
      let y = T + ph;
      const x = L + k * band + (band - bw) / 2;
      const when = new Date(start + k * step);
      grid.forEach((row, i) => {
        if (!row[k]) return;
        const hgt = (ph * row[k]) / ymax;
        y -= hgt;
        svg.append(s("rect", { x: x.toFixed(2), y: y.toFixed(2), width: bw.toFixed(2), height: Math.max(0.5, hgt).toFixed(2),
          fill: series[i].color, rx: Math.min(2, bw / 4) },
        s("title", {}, `${series[i].key} · ${fmtTime(when.toISOString())} · ${fmtNum(row[k])} tokens`)));
      });
    }
    // Labels every `every` periods: on round local hours (hourly bars) or every k-th day.
    const hourly = step < 86400e3;
    const every = [1, 2, 3, 4, 6, 12, 24, 48, 72, 168].find((e) => n / e <= 7) || Math.ceil(n / 7);
    for (let k = 0; k < n; k++) {
      const d = new Date(start + k * step);
      const unit = hourly ? Math.round(d.getTime() / step) - d.getTimezoneOffset() / 60 : k;
      if (unit % every !== 0) continue;
      const p = (x) => String(x).padStart(2, "0");
      const date = `${p(d.getMonth() + 1)}-${p(d.getDate())}`;
      const txt = !hourly || every >= 24 ? date : (n > 24 && d.getHours() === 0 ? `${date} ` : "") + `${p(d.getHours())}:00`;
      svg.append(s("text", { x: L + k * band + band / 2, y: H - 8, "text-anchor": "middle" }, txt));
    }
    wrap.append(svg);
    const legend = h("div", { class: "legend" });
    for (const sr of series) {
      const sw = h("i");
      sw.style.background = sr.color;
      legend.append(h("span", { "data-series": sr.key }, sw, `${sr.key} · ${fmtShort(sr.total)}`));
    }
    wrap.append(legend, h("div", { class: "muted small" }, `${fmtNum(total)} tokens in this range`));
    return wrap;
  }

  // -- Engine --------------------------------------------------------------------------------
  async function pageEngine(main, current) {
    main.append(head("Engine", "What the engine is doing now. Refreshes every 2 seconds."));
    const body = h("div", { id: "engine-body" });
    main.append(body);
    async function load() {
      let e;
      try { e = await api("GET", "/engine"); } catch (err) {
        clear(body).append(h("div", { class: "error" }, err.message));
        return;
      }
      if (!current()) return;
      const pct = Math.round(e.kv_cache_usage * 1000) / 10;
      const meter = h("div", { class: "meter" + (pct > 85 ? " hot" : "") }, h("div"));
      meter.firstChild.style.width = `${Math.min(100, pct)}%`;
      const hit = e.prefix_cache_queries ? Math.round((100 * e.prefix_cache_hits) / e.prefix_cache_queries) : null;
      const stat = (v, k, id) => h("div", { class: "stat", id }, h("div", { class: "v" }, v), h("div", { class: "k" }, k));
      const lanes = h("tbody");
      const maxLane = Math.max(1, ...LANES.map((l) => e.lanes[l].running + e.lanes[l].waiting));
      for (const l of LANES) {
        const x = e.lanes[l];
        const bar = h("div", { class: "lanebar" }, h("div", { class: "r" }), h("div", { class: "w" }));
        bar.children[0].style.width = `${(100 * x.running) / maxLane}%`;
        bar.children[1].style.width = `${(100 * x.waiting) / maxLane}%`;
        lanes.append(h("tr", { "data-lane": l }, h("td", {}, l), h("td", { class: "num" }, x.running),
          h("td", { class: "num" }, x.waiting), h("td", {}, bar)));
      }
      const dev = e.resident_adapters.filter((r) => r.tier === "device");
      const cpu = e.resident_adapters.filter((r) => r.tier === "cpu");
      const resList = (rows, empty) => (rows.length ? h("ul", { class: "plain" }, rows.map((r) => h("li", {},
        h("strong", {}, r.names.length ? r.names.join(", ") : "(older version)"), " ",
        h("span", { class: "mono muted", title: r.digest }, shortDigest(r.digest)))))
        : h("p", { class: "muted" }, empty));
      const deviceLabel = e.device.startsWith("cuda") ? "On the GPU" : `On the device (${e.device})`;
      clear(body).append(
        h("div", { class: "stats" },
          stat(e.running ? "running" : "stopped", "Engine", "engine-state"),
          stat(fmtNum(e.num_running), "Requests running", "engine-running"),
          stat(fmtNum(e.num_waiting), "Requests waiting", "engine-waiting"),
          stat(`${pct}%`, `KV cache in use (${fmtNum(e.num_kv_blocks)} blocks × ${e.block_size} tokens)`, "engine-kv"),
          stat(hit === null ? "–" : `${hit}%`, "Prefix cache hits", "engine-prefix"),
          stat(fmtNum(e.num_preemptions), "Preemptions", "engine-preempt")),
        h("div", { class: "card" }, h("h2", {}, "KV cache"), meter),
        spacer(),
        h("div", { class: "grid2" },
          h("div", { class: "card flush" }, h("table", { id: "engine-lanes" }, h("thead", {}, h("tr", {},
            h("th", {}, "Lane"), h("th", { class: "num" }, "Running"), h("th", { class: "num" }, "Waiting"),
            h("th", {}, h("span", { class: "legend" }, h("span", {}, "running / waiting"))))), lanes)),
          h("div", { class: "card", id: "engine-resident" },
            h("h2", {}, `${deviceLabel}: ${dev.length} resident, up to ${e.max_loras} per step`),
            resList(dev, "No adapter on the device."),
            h("h2", {}, `CPU tier: ${cpu.length} of ${e.max_cpu_loras}`), resList(cpu, "No adapter in CPU memory."))),
        h("p", { class: "muted small" }, `Model ${e.model} on ${e.device}. Updated ${new Date().toLocaleTimeString()}.`));
    }
    await load();
    if (current()) state.timer = setInterval(() => { if (!document.hidden) load(); }, 2000);
  }

  // -- Audit -----------------------------------------------------------------------------------
  function detailText(details) {
    const show = (v) => {
      if (typeof v === "string" && v.startsWith("sha256:")) return shortDigest(v);
      if (typeof v === "string") return v;
      if (Array.isArray(v)) return v.length ? v.map(show).join(", ") : "none";
      if (v && typeof v === "object") return "{" + Object.entries(v).map(([k, x]) => `${k}: ${show(x)}`).join(", ") + "}";
      return String(v);
    };
    return Object.entries(details).map(([k, v]) => `${k}=${show(v)}`).join("  ");
  }

  async function pageAudit(main, current) {
    main.append(head("Audit log", "Every change made through the admin API: who, what, when."));
    const tbody = h("tbody");
    const more = h("button", { class: "btn", type: "button", id: "audit-more" }, "Load older entries");
    const wrap = h("div", { class: "card flush" }, h("table", { id: "audit-table" }, h("thead", {}, h("tr", {},
      ["When", "Who", "Action", "Target", "Details"].map((x) => h("th", {}, x)))), tbody));
    main.append(wrap, spacer(), more);
    let before = null;
    async function load() {
      const q = new URLSearchParams({ limit: "100" });
      if (before) q.set("before", String(before));
      const rows = await api("GET", "/audit?" + q);
      if (!current()) return;
      for (const r of rows) {
        tbody.append(h("tr", { "data-action": r.action }, h("td", { class: "nowrap" }, timeEl(r.at)),
          h("td", { class: "small" }, r.actor), h("td", {}, h("span", { class: "badge" }, r.action)),
          h("td", { class: "mono" }, r.target),
          h("td", { class: "details", title: JSON.stringify(r.details) }, detailText(r.details))));
      }
      if (rows.length) before = rows[rows.length - 1].id;
      more.hidden = rows.length < 100;
      if (!tbody.children.length) wrap.append(h("div", { class: "empty" }, "Nothing recorded yet."));
    }
    more.addEventListener("click", load);
    await load();
  }

  // -- start -----------------------------------------------------------------------------------
  (async () => {
    try {
      const session = await api("GET", "/session");
      await signedIn(session);
    } catch (e) {
      showSignin(e.status === 401 ? "" : e.message);
    }
  })();
})();
