"""The web page at `/` in a real browser: Debian's Chromium driven by Playwright, against a live
`pagellm serve` on the embedded model. A message streams in, the engine view's running count
and KV usage move while it does, and a screenshot is kept as a test artefact."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from server_utils import REPO_ROOT, RemoteServer, assert_clean_shutdown

sync_api = pytest.importorskip("playwright.sync_api")

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run"]
ARTIFACTS = Path(os.environ.get("PAGELLM_TEST_ARTIFACTS", REPO_ROOT / "test-artifacts"))
MODEL = "SmolLM2-135M-Instruct"

pytestmark = pytest.mark.skipif(not CHROMIUM.exists(),
                                reason="needs Debian's chromium (scripts/setup.sh --test)")


@pytest.fixture(scope="module")
def server(smollm2_gguf: Path) -> Iterator[RemoteServer]:
    remote = RemoteServer(smollm2_gguf, "--served-model-name", MODEL, startup_timeout=600)
    yield remote
    assert_clean_shutdown(remote.stop())


@pytest.fixture(scope="module")
def page(server: RemoteServer) -> Iterator[object]:
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_FLAGS)
        view = browser.new_page(viewport={"width": 1400, "height": 900})
        view.set_default_timeout(180_000)  # six engineers' tests may share two cores
        errors: list[str] = []
        view.on("pageerror", lambda error: errors.append(str(error)))
        view.goto(f"{server.url}/?interval=250")
        yield view
        browser.close()
        assert not errors, errors


def _background_load(server: RemoteServer, count: int) -> list[threading.Thread]:
    """Requests from another client that keep the engine busy while the page watches it."""
    def run() -> None:
        server.client().chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Count to one hundred."}],
            max_tokens=96, extra_body={"ignore_eos": True})

    threads = [threading.Thread(target=run) for _ in range(count)]
    for thread in threads:
        thread.start()
    return threads


def _text(page: object, selector: str) -> str:
    return page.locator(selector).inner_text()


def test_chat_streams_and_engine_view_moves(server: RemoteServer, page: object) -> None:
    page.wait_for_function(f"document.querySelector('#model').value === '{MODEL}'")
    page.wait_for_function("document.querySelector('#running').textContent === '0'")
    assert page.locator("#block-legend li[data-state=free]").get_attribute("data-count") == "512"

    page.click("#settings summary")
    page.fill("#temperature", "0")
    page.fill("#max_tokens", "32")
    page.fill("#prompt", "Tell me a long story about a lighthouse keeper and a storm.")
    threads = _background_load(server, 2)
    page.press("#prompt", "Enter")

    reply = page.locator(".message.assistant").last
    page.wait_for_function("document.querySelector('.message.assistant.streaming')"
                           "?.textContent.length > 0")
    first = reply.inner_text()
    page.wait_for_function(f"document.querySelector('.message.assistant').textContent.length"
                           f" > {len(first)}")
    page.wait_for_function("Number(document.querySelector('#running').textContent) >= 1")
    page.wait_for_function("Number(document.querySelector('#kv-usage').dataset.value) > 0")
    page.wait_for_function("Number(document.querySelector('#block-legend li[data-state=used]')"
                           "?.dataset.count) > 0")
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "playground-streaming.png"))

    page.wait_for_selector(".message.assistant.streaming", state="detached")
    for thread in threads:
        thread.join()
    assert len(reply.inner_text()) > len(first)
    assert "tokens in" in _text(page, ".message.assistant .meta")
    page.wait_for_function("document.querySelector('#running').textContent === '0'")
    page.wait_for_function("Number(document.querySelector('#kv-usage').dataset.value) === 0")
    assert float(_text(page, "#generation-rate")) >= 0
    page.screenshot(path=str(ARTIFACTS / "playground.png"))


def test_stop_aborts_and_conversation_survives_reload(server: RemoteServer, page: object) -> None:
    page.fill("#max_tokens", "400")
    page.fill("#prompt", "Write a very long poem about the sea.")
    page.press("#prompt", "Enter")
    page.wait_for_function("document.querySelector('.message.assistant.streaming')"
                           "?.textContent.length > 0")
    page.click("#stop")
    page.wait_for_selector(".message.assistant.streaming", state="detached")
    assert page.locator(".message.assistant .meta").last.inner_text() == "stopped"
    # the server aborts the request and frees its blocks
    page.wait_for_function("document.querySelector('#running').textContent === '0'")
    page.wait_for_function("Number(document.querySelector('#kv-usage').dataset.value) === 0")

    page.reload()
    page.wait_for_function("document.querySelectorAll('.message').length === 4")
    assert "lighthouse" in page.locator(".message.user").first.inner_text()
    assert page.locator("#conversation-list li").count() == 1
