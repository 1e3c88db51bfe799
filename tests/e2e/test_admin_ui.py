"""The admin UI in a real browser: Playwright drives Debian's chromium (headless) against
a live server, on SQLite and PostgreSQL.

Sign in; create a tenant and a key; upload an adapter (progress bar, then its kind, rank,
targets, size and digest); grant it; the key then gets a completion with that adapter
through the official openai client; adapters of the other kinds (DoRA, lora_bias,
trainable tokens with saved norms) upload granted, show their kind in the Kind column and
the adapter's details, and give PEFT's greedy tokens; one recorded before kinds were
shows as unknown; a malformed upload shows its error in plain words and changes nothing;
every page is screenshotted into test-artifacts/admin-ui/.

Skips (with the reason) when chromium or playwright is missing, unless
LORAPLEX_REQUIRE_BROWSER=1 (CI sets it), where that is a failure.
"""
from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest

from tests.e2e.admin_fixtures import (ADMIN_TOKEN, KIND_PROMPT, admin_live, forget_kind,  # noqa: F401 - fixtures
                                      kind_adapters, upload_adapters)

REPO = Path(__file__).resolve().parents[2]
ARTIFACTS = REPO / "test-artifacts" / "admin-ui"
# What the Kind column shows for each of `kind_adapters`, and the adapter's details.
KIND_LABELS = {"dora": ["DoRA"], "bias": ["LoRA bias"], "saved": ["trainable tokens", "saved modules"]}
KIND_DETAILS = {"dora": ["DoRA"], "bias": ["LoRA bias"],
                "saved": ["trainable tokens: embed_tokens",
                          "saved modules: input_layernorm, post_attention_layernorm, norm"]}
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-dev-shm-usage"]


def _chromium() -> str | None:
    env = os.environ.get("LORAPLEX_CHROMIUM")
    if env:
        return env
    for name in ("chromium", "chromium-browser"):
        path = shutil.which(name)
        if path:
            return path
    return None


def _unavailable(reason: str):
    if os.environ.get("LORAPLEX_REQUIRE_BROWSER") == "1":
        pytest.fail(f"{reason} (LORAPLEX_REQUIRE_BROWSER=1)")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def browser():
    exe = _chromium()
    if exe is None:
        _unavailable("chromium is not installed (apt-get install chromium): browser tests skipped")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _unavailable("the playwright package is not installed (pip install -e '.[test]'): browser tests skipped")
    pw = sync_playwright().start()
    try:
        b = pw.chromium.launch(executable_path=exe, args=CHROMIUM_ARGS, headless=True)
    except Exception as exc:  # noqa: BLE001 - a broken install is reported, not hidden
        pw.stop()
        _unavailable(f"chromium at {exe} does not start: {exc}")
    yield b
    b.close()
    pw.stop()


@pytest.fixture
def page(browser, admin_live):
    ctx = browser.new_context(viewport={"width": 1320, "height": 900}, accept_downloads=True,
                              base_url=admin_live.url)
    pg = ctx.new_page()
    errors: list[str] = []
    pg.on("pageerror", lambda e: errors.append(str(e)))
    # (console errors "Failed to load resource" are the 4xx answers the UI shows in its own words)
    pg.on("console", lambda m: errors.append(m.text)
          if m.type == "error" and "Failed to load resource" not in m.text else None)
    pg.set_default_timeout(20_000)
    yield pg
    ctx.close()
    assert not errors, f"errors in the page: {errors}"


def _shot(page, backend: str, name: str) -> Path:
    out = ARTIFACTS / backend / f"{name}.png"
    out.parent.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(out), full_page=True)
    return out


def _sign_in(page, token: str = ADMIN_TOKEN) -> None:
    page.fill("#signin-token", token)
    page.click("#signin-submit")


def _goto(page, section: str) -> None:
    page.click(f".sidenav a[data-page={section}]")
    page.wait_for_selector(f"#main[data-page={section}][aria-busy=false]")


def _upload_kinds(page, client, tenant: str, folders: dict[str, Path], model_dir: Path) -> list[str]:
    """Each kind uploads through the form, granted at once; the key then gets PEFT's
    greedy tokens with it. Returns the adapters' names."""
    from playwright.sync_api import expect
    from transformers import AutoTokenizer

    from tests.engine.oracle import hf_greedy

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    names = []
    for kind, folder in folders.items():
        name = f"{tenant}-{kind}"
        page.fill("#adapter-name", name)
        page.select_option("#adapter-grant", tenant)
        page.set_input_files("#adapter-files", [str(folder / "adapter_config.json"),
                                                str(folder / "adapter_model.safetensors")])
        page.click("#adapter-upload")
        result = page.locator("#upload-result")
        expect(result).to_contain_text(f"Adapter {name} is ready.")
        expect(result.locator("[data-field=rank]")).to_have_text("8")
        expect(result.locator("[data-field=kind] .badge")).to_have_text(KIND_DETAILS[kind])
        expect(page.locator(f"tr[data-adapter='{name}'] .chip[data-grant='{tenant}']")).to_be_visible()
        expect(page.locator(f"tr[data-adapter='{name}'] td.kind .badge")).to_have_text(KIND_LABELS[kind])
        names.append(name)
        out = client.completions.create(model=name, prompt=KIND_PROMPT, max_tokens=6, temperature=0,
                                        extra_body={"ignore_eos": True})
        ref = hf_greedy(model_dir, [KIND_PROMPT], [6], adapter_dir=folder)[0]
        assert out.choices[0].text == tokenizer.decode(ref, skip_special_tokens=True), kind
    return names


def test_admin_ui_end_to_end(page, admin_live, upload_adapters, kind_adapters, tiny_llama_dir):
    from playwright.sync_api import expect

    b = admin_live.backend
    tenant, adapter = f"ui-{b}", f"ui-{b}-adapter"
    api = admin_live.client()
    try:
        # -- sign in -------------------------------------------------------------------
        page.goto("/admin")
        expect(page.locator("#signin")).to_be_visible()
        _shot(page, b, "01-signin")
        _sign_in(page, "not-the-token-not-the-token")
        expect(page.locator("#signin-error")).to_contain_text("invalid admin token")
        _sign_in(page)
        expect(page.locator("#app")).to_be_visible()
        page.wait_for_selector("#main[data-page=tenants][aria-busy=false]")
        expect(page.locator("#whoami")).to_contain_text("session:")

        # -- tenants -------------------------------------------------------------------
        page.fill("#tenant-name", tenant)
        page.select_option("#tenant-lane", "interactive")
        page.fill("#tenant-weight", "2")
        page.click("#tenant-create")
        row = page.locator(f"tr[data-tenant='{tenant}']")
        expect(row).to_contain_text("interactive")
        expect(row).to_contain_text("enabled")
        expect(row.locator("td.weight")).to_have_text("2")
        page.fill("#tenant-name", "../bad")
        page.click("#tenant-create")
        expect(page.locator("#tenant-error")).to_contain_text("'../bad' is not valid")
        page.fill("#tenant-name", "")
        # Edit: lanes and quotas.
        row.locator("button", has_text="Edit").click()
        page.select_option(f"#edit-{tenant}-lane", "standard")
        page.fill(f"#edit-{tenant}-q-rpm", "1000")
        page.fill(f"#edit-{tenant}-q-token_budget", "5000000")
        # Weight and request timeout: a bad weight is refused with the field named.
        page.fill(f"#edit-{tenant}-weight", "0")
        page.locator(f"tr[data-tenant='{tenant}'] + tr button", has_text="Save").click()
        expect(page.locator(f"tr[data-tenant='{tenant}'] + tr .error")).to_contain_text("weight")
        page.fill(f"#edit-{tenant}-weight", "3")
        page.fill(f"#edit-{tenant}-timeout", "20")
        page.locator(f"tr[data-tenant='{tenant}'] + tr button", has_text="Save").click()
        expect(row.locator("td.weight")).to_have_text("3 · 20 s timeout")
        expect(row).to_contain_text("1k rpm")
        expect(row).to_contain_text("5M/month")
        t = api.get(f"/tenants/{tenant}").json()
        assert t["default_lane"] == "standard" and t["allowed_lanes"] == ["standard", "batch"]
        assert t["quotas"]["rpm"] == 1000 and t["quotas"]["token_budget"] == 5_000_000
        assert (t["weight"], t["request_timeout"]) == (3, 20)
        _shot(page, b, "02-tenants")

        # -- keys ----------------------------------------------------------------------
        _goto(page, "keys")
        page.select_option("#key-tenant", tenant)
        page.fill("#key-name", "browser test")
        page.fill("#key-expires", "30")
        page.click("#key-create")
        expect(page.locator("#key-secret")).to_be_visible()
        key = page.input_value("#key-secret-value")
        assert key.startswith("lpx_")
        page.click("#key-copy")
        expect(page.locator("#key-copy")).to_have_text("Copied")
        prefix = "lpx_" + key.split("_")[1]  # the secret part may hold '_' too
        expect(page.locator(f"tr[data-key='{prefix}']")).to_contain_text("active")
        _shot(page, b, "03-keys")

        # -- adapters: upload (progress bar, then rank/targets/size/digest), grant ----------------
        _goto(page, "adapters")
        folder = upload_adapters["r4"]
        page.fill("#adapter-name", adapter)
        page.set_input_files("#adapter-files", [str(folder / "adapter_config.json"),
                                                str(folder / "adapter_model.safetensors")])
        page.click("#adapter-upload")
        result = page.locator("#upload-result")
        expect(result).to_be_visible()
        expect(result.locator("[data-field=rank]")).to_have_text("4")
        expect(result.locator("[data-field=kind]")).to_have_text("LoRA")
        expect(result.locator("[data-field=targets]")).to_have_text("q_proj, v_proj")
        expect(result.locator("[data-field=digest]")).to_contain_text("sha256:")
        expect(page.locator("#upload-progress")).to_have_attribute("aria-valuenow", "100")
        arow = page.locator(f"tr[data-adapter='{adapter}']")
        expect(arow).to_contain_text("nobody yet")
        expect(arow.locator("td.kind")).to_have_text("LoRA")
        arow.locator("select.grant-select").select_option(tenant)
        expect(page.locator(f"tr[data-adapter='{adapter}'] .chip[data-grant='{tenant}']")).to_be_visible()
        _shot(page, b, "04-adapters")

        # -- the key uses the adapter through the official openai client -------------------
        client = admin_live.openai(key)
        out = client.chat.completions.create(model=adapter, messages=[{"role": "user", "content": "Hello"}],
                                             max_tokens=4, temperature=0)
        assert out.model == adapter and out.usage.completion_tokens > 0
        assert adapter in {m.id for m in client.models.list().data}

        # -- adapters of every kind that fits an upload: DoRA, lora_bias, trainable tokens -----
        kinds = _upload_kinds(page, client, tenant, kind_adapters, tiny_llama_dir)
        assert set(kinds) <= {m.id for m in client.models.list().data}
        # The name opens the adapter's details, its kind in full among them.
        saved = f"{tenant}-saved"
        page.locator(f"tr[data-adapter='{saved}'] button.linklike").click()
        expect(page.locator(f"tr[data-details='{saved}'] [data-field=kind] .badge")).to_have_text(
            KIND_DETAILS["saved"])
        # An adapter recorded before kinds were shows as unknown, not as plain LoRA.
        forget_kind(admin_live, f"{tenant}-bias")
        _goto(page, "keys")
        _goto(page, "adapters")
        expect(page.locator(f"tr[data-adapter='{tenant}-bias'] td.kind")).to_have_text("unknown")
        expect(page.locator(f"tr[data-adapter='{tenant}-dora'] td.kind")).to_have_text("DoRA")
        _shot(page, b, "04b-adapter-kinds")

        # -- a malformed upload shows its error and changes nothing ----------------------------
        listing = api.get("/adapters").json()
        store = [(r.name, r.digest) for r in admin_live.store.list()]
        audit_n = len(api.audit())
        bad = folder.parent / "bad-upload"
        bad.mkdir(exist_ok=True)
        (bad / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 4, "lora_alpha": 8, '
                                                 '"target_modules": ["q_proj"]}')
        (bad / "adapter_model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{broken}")
        page.fill("#adapter-name", f"{adapter}-bad")
        page.set_input_files("#adapter-files", [str(bad / "adapter_config.json"),
                                                str(bad / "adapter_model.safetensors")])
        page.click("#adapter-upload")
        err = page.locator("#upload-error")
        expect(err).to_be_visible()
        expect(err).to_contain_text("safetensors")
        expect(page.locator("#upload-result")).to_be_hidden()
        _shot(page, b, "05-adapters-bad-upload")
        page.fill("#adapter-name", f"{adapter}-bad")
        page.set_input_files("#adapter-files", [str(bad / "adapter_config.json")])
        page.click("#adapter-upload")
        expect(err).to_contain_text("adapter_model.safetensors is missing")
        assert api.get("/adapters").json() == listing
        assert [(r.name, r.digest) for r in admin_live.store.list()] == store
        assert len(api.audit()) == audit_n
        expect(page.locator(f"tr[data-adapter='{adapter}-bad']")).to_have_count(0)

        # Replace with a new version from the row (rank 8).
        r8 = upload_adapters["r8"]
        arow.locator("input[type=file]").set_input_files([str(r8 / "adapter_config.json"),
                                                          str(r8 / "adapter_model.safetensors")])
        expect(page.locator(f"tr[data-adapter='{adapter}'] td").nth(1)).to_have_text("8")
        assert client.completions.create(model=adapter, prompt="Hi", max_tokens=2).usage.completion_tokens > 0

        # -- engine ----------------------------------------------------------------------------
        _goto(page, "engine")
        expect(page.locator("#engine-lanes tr[data-lane=standard]")).to_be_visible()
        expect(page.locator("#engine-resident")).to_contain_text(adapter)
        expect(page.locator("#engine-resident")).to_contain_text(f"{adapter} (older version)")
        expect(page.locator("#engine-kv")).to_contain_text("%")
        _shot(page, b, "06-engine")

        # -- usage: charts per tenant and per adapter; the export one click away ------------------
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:  # metering writes in batches
            series = api.get("/usage", params={"tenant": tenant}).json()["series"]
            if series and series[0]["totals"]["requests"] >= 2:
                break
            time.sleep(0.2)
        _goto(page, "usage")
        expect(page.locator(f"#usage-tenants .legend [data-series='{tenant}']")).to_be_visible()
        expect(page.locator(f"#usage-adapters .legend [data-series='{adapter}']")).to_be_visible()
        assert page.locator("#usage-tenants svg rect").count() >= 1
        with page.expect_download() as dl:
            page.click("#usage-export a[data-format=csv]")
        text = Path(dl.value.path()).read_text()
        assert out.id in text
        _shot(page, b, "07-usage")

        # -- audit: each change of this session, by this session ---------------------------------
        _goto(page, "audit")
        table = page.locator("#audit-table")
        for action in ("tenant.create", "key.create", "adapter.upload", "adapter.grant", "adapter.replace",
                       "session.create"):
            expect(table.locator(f"tr[data-action='{action}']").first).to_be_visible()
        rows = api.audit(target=f"adapter:{adapter}")
        assert {r["action"] for r in rows} >= {"adapter.upload", "adapter.grant", "adapter.replace"}
        assert all(r["actor"].startswith("session:") for r in rows)
        _shot(page, b, "08-audit")

        # -- revoke the key and sign out ------------------------------------------------------
        _goto(page, "keys")
        revoke = page.locator(f"tr[data-key='{prefix}'] button")
        revoke.click()
        expect(revoke).to_have_text("Revoke now?")
        revoke.click()
        expect(page.locator(f"tr[data-key='{prefix}']")).to_contain_text("revoked")
        page.click("#signout")
        expect(page.locator("#signin")).to_be_visible()
        page.reload()
        expect(page.locator("#signin")).to_be_visible()  # the session is gone
    finally:
        api.close()
