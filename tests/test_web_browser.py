"""The web page end to end in headless Chromium (Debian's chromium, driven by Playwright): send a chat message and
see the streamed text and its stats line, regenerate, stop a long reply, open a report and see its plot, compare
two history runs. Screenshots go to test-artifacts/web/ (or $TURBOSPEC_TEST_ARTIFACTS). `.ci/run` installs
chromium and playwright; elsewhere the test is skipped when either is missing."""

import contextlib
import io
import json
import os
import shutil
from pathlib import Path

import pytest

sync_api = pytest.importorskip("playwright.sync_api")
pytest.importorskip("uvicorn")
pytest.importorskip("matplotlib")
CHROMIUM = os.environ.get("TURBOSPEC_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
if CHROMIUM is None:
    pytest.skip("no chromium (apt-get install chromium)", allow_module_level=True)

from tests.test_plots import quality_report  # noqa: E402
from tests.test_server_cancel import live_app, settle  # noqa: E402
from tests.test_web import bench_report  # noqa: E402
from turbospec.cli.main import main  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
ARTIFACTS = Path(os.environ.get("TURBOSPEC_TEST_ARTIFACTS", ROOT / "test-artifacts")) / "web"
# as root in a container, with this machine's closed network: no sandbox, no background connections
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage"]


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """A live server over the bundled model with MTP drafting and q8_0 KV, listing a reports folder and a
    history of two runs (the second slower)."""
    from turbospec.config import EngineConfig, SpecConfig
    from turbospec.engine import build_engine
    from turbospec.lab import history

    tmp = tmp_path_factory.mktemp("site")
    (tmp / "reports" / "bench-depth").mkdir(parents=True)
    (tmp / "reports" / "bench-depth" / "report.json").write_text(json.dumps(bench_report()))
    (tmp / "reports" / "quality-kv").mkdir()
    (tmp / "reports" / "quality-kv" / "report.json").write_text(json.dumps(quality_report()))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["fit", "--preset", "qwen3.6-27b", "--mem", "24GiB", "--backend", "cuda", "-ctk", "f16,tbq4_0",
                     "--json"]) == 0
    (tmp / "reports" / "fit-27b.json").write_text(out.getvalue())
    db = tmp / "h.sqlite"
    history.record(db, bench_report("aaaa111", 10.0))
    history.record(db, bench_report("bbbb222", 5.0))
    engine = build_engine(EngineConfig(model=str(ROOT / "models" / "turbospec-tiny"), ctx=4096,
                                       cache_type_k="q8_0", cache_type_v="q8_0",
                                       spec=SpecConfig(types=("draft-mtp",))))
    with live_app(engine, reports=(str(tmp / "reports"),), history_db=str(db), stream_interval=0.0) as (url, _):
        yield url


@pytest.fixture(scope="module")
def browser():
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        yield b
        b.close()


@pytest.fixture(scope="module")
def page(browser, site):
    pg = browser.new_page(viewport={"width": 1200, "height": 900})
    errors: list[str] = []
    pg.on("pageerror", lambda e: errors.append(str(e)))
    pg.goto(site + "/")
    yield pg
    pg.close()
    assert not errors, errors


def chat_requests(page) -> list:
    reqs: list = []
    page.on("request", lambda r: reqs.append(r) if r.url.endswith("/v1/chat/completions") else None)
    return reqs


def settings(page, **values) -> None:
    """Type into the settings panel (opened first): settings(page, temperature=0, max_tokens=96)."""
    if page.locator("#settings").get_attribute("open") is None:
        page.click("#settings summary")
    for name, value in values.items():
        page.fill("#" + name.replace("_", "-"), str(value))


def last_stats(page) -> str:
    return page.locator(".msg.assistant .stats").last.inner_text()


def test_chat_streams_text_and_shows_stats(page, site):
    sync_api.expect(page.locator("#model-info")).to_contain_text("KV q8_0/q8_0")
    sync_api.expect(page.locator("#model-info")).to_contain_text("draft draft-mtp")
    settings(page, max_tokens=96, temperature=0)
    # count the updates of the reply's text as they land: a streamed reply changes it many times
    page.evaluate("""() => { window.updates = 0;
        new MutationObserver((ms) => { for (const m of ms) if (m.target.classList &&
            m.target.classList.contains('text') && m.target.parentElement.classList.contains('assistant'))
            window.updates++; }).observe(document.getElementById('messages'), {subtree: true, childList: true}); }""")
    page.fill("#prompt", "Once upon a time")
    page.press("#prompt", "Enter")
    sync_api.expect(page.locator(".msg.assistant .stats")).to_contain_text("t/s", timeout=60_000)
    text = page.locator(".msg.assistant .text").inner_text()
    stats = last_stats(page)
    page.screenshot(path=str(ARTIFACTS / "chat.png"), full_page=True)
    assert page.locator(".msg.user .text").inner_text() == "Once upon a time"
    assert len(text) > 20
    assert page.evaluate("window.updates") > 3, "the reply arrived in one piece, not streamed"
    for part in ("TTFT", "tokens", "acceptance", "KV q8_0/q8_0", "length"):
        assert part in stats, stats
    assert page.locator("#stop").is_hidden() and page.locator("#send").is_enabled()


def test_regenerate_replaces_the_reply(page):
    reqs = chat_requests(page)
    settings(page, temperature=1.0)
    page.locator(".regenerate").click()
    sync_api.expect(page.locator(".regenerate")).to_be_visible(timeout=60_000)
    assert len(reqs) == 1
    assert page.locator(".msg.assistant").count() == 1 and page.locator(".msg.user").count() == 1
    body = json.loads(reqs[0].post_data)
    assert [m["role"] for m in body["messages"]] == ["user"] and body["temperature"] == 1.0
    assert "t/s" in last_stats(page)


def test_stop_ends_a_long_reply(page, site):
    settings(page, max_tokens=3500, temperature=1.0)

    def no_eos(route):  # the reply must still be running when Stop is clicked: the tiny model may end it early
        route.continue_(post_data=json.dumps({**json.loads(route.request.post_data), "ignore_eos": True}))

    page.route("**/v1/chat/completions", no_eos)
    # Stop is clicked from inside the page as soon as the reply has some text: the tiny model is fast, and a browser
    # starved of CPU (the server computes on the same cores) can take longer to click than the reply takes to finish
    page.evaluate("""() => { window.stopClicked = false;
        const obs = new MutationObserver(() => {
            const t = document.querySelectorAll('.msg.assistant .text')[1], stop = document.getElementById('stop');
            if (t && t.textContent.length > 10 && !stop.hidden) { obs.disconnect(); window.stopClicked = true;
                stop.click(); } });
        obs.observe(document.getElementById('messages'), {subtree: true, childList: true, characterData: true}); }""")
    page.fill("#prompt", "Tell me a long story.")
    page.press("#prompt", "Enter")
    page.wait_for_function("() => window.stopClicked", timeout=60_000)
    page.unroute("**/v1/chat/completions")
    sync_api.expect(page.locator(".msg.assistant .stats").last).to_contain_text("stopped", timeout=30_000)
    h = settle(site)  # the server stopped generating for the client that left
    assert (h["running"], h["waiting"]) == (0, 0)
    assert page.locator("#send").is_enabled() and page.locator(".msg.assistant").count() == 2
    page.reload()  # the conversation is kept in the browser
    sync_api.expect(page.locator(".msg.assistant")).to_have_count(2)
    assert page.locator(".msg.user .text").first.inner_text() == "Once upon a time"
    assert "stopped" in last_stats(page)


def test_report_view_shows_table_and_plot(page):
    page.click("#tab-reports")
    item = page.locator("#report-list li", has_text="bench-depth")
    item.click()
    sync_api.expect(page.locator("#report h2")).to_contain_text("bench")
    img = page.locator('img[data-plot="tps_vs_depth"]')
    sync_api.expect(img).to_be_visible(timeout=60_000)
    page.wait_for_function("() => { const i = document.querySelector('img[data-plot=\"tps_vs_depth\"]');"
                           " return i && i.complete && i.naturalWidth > 100; }")
    assert page.locator("#report table").first.locator("tr").count() == 5  # header + 4 rows
    page.screenshot(path=str(ARTIFACTS / "report.png"), full_page=True)


@pytest.mark.parametrize("title,plot_names", [("quality-kv", ["kld", "kld_vs_bits", "retrieval"]),
                                              ("fit-27b.json", ["memory"])])
def test_quality_and_fit_reports_show_their_plots(page, title, plot_names):
    page.click("#tab-reports")
    page.locator("#report-list li", has_text=title).click()
    sync_api.expect(page.locator("#report h2")).to_contain_text(title)
    for name in plot_names:
        page.wait_for_function(f"() => {{ const i = document.querySelector('img[data-plot=\"{name}\"]');"
                               " return i && i.complete && i.naturalWidth > 100; }", timeout=60_000)
    assert page.locator("#report table").first.locator("tr").count() > 1
    page.screenshot(path=str(ARTIFACTS / f"report-{title.split('.')[0]}.png"), full_page=True)


def test_a_late_answer_does_not_replace_the_report_asked_for_last(page):
    """Pick a report whose answer is slow, then another: the second stays shown after the first answer lands."""
    page.click("#tab-reports")
    slow = page.locator("#report-list li", has_text="quality-kv").get_attribute("data-id")
    page.evaluate("""(slow) => { window.realFetch = window.fetch;
        window.fetch = (url, opts) => String(url).endsWith('/lab/reports/' + slow)
            ? new Promise((done) => setTimeout(done, 1500)).then(() => window.realFetch(url, opts))
            : window.realFetch(url, opts); }""", slow)
    try:
        page.locator("#report-list li", has_text="quality-kv").click()
        page.locator("#report-list li", has_text="bench-depth").click()
        sync_api.expect(page.locator("#report h2")).to_contain_text("bench-depth")
        page.wait_for_timeout(2500)  # the slow answer has come by now
        sync_api.expect(page.locator("#report h2")).to_contain_text("bench-depth")
        assert page.locator("#report-list li.active").inner_text().startswith("benchbench-depth")
    finally:
        page.evaluate("() => { window.fetch = window.realFetch; }")


def test_compare_two_history_runs(page):
    page.goto(page.url.split("#")[0] + "#reports")
    sync_api.expect(page.locator("#compare-box")).to_be_visible()
    page.click("#compare")
    sync_api.expect(page.locator("#report td.verdict-slower").first).to_be_visible(timeout=30_000)
    assert page.locator("#report td.verdict-slower").count() == 4  # decode t/s at 2 configs x 2 depths
    page.screenshot(path=str(ARTIFACTS / "compare.png"), full_page=True)


def test_api_key_typed_into_settings(browser):
    """With --api-key the page loads, says the key is missing, and works once the key is typed in."""
    from turbospec.config import EngineConfig
    from turbospec.engine import build_engine

    engine = build_engine(EngineConfig(model=str(ROOT / "models" / "turbospec-tiny"), ctx=512))
    with live_app(engine, api_keys=("k3y",)) as (url, _):
        pg = browser.new_page()
        pg.goto(url + "/")
        sync_api.expect(pg.locator("#model-info")).to_contain_text("API key")
        settings(pg, api_key="k3y")
        pg.press("#api-key", "Tab")  # the change event
        sync_api.expect(pg.locator("#model-info")).to_contain_text("ctx 512")
        settings(pg, max_tokens=8)
        pg.fill("#prompt", "hi")
        pg.press("#prompt", "Enter")
        sync_api.expect(pg.locator(".msg.assistant .stats")).to_contain_text("t/s", timeout=60_000)
        assert pg.locator("#chat-error").is_hidden()
        pg.close()
