"""The playground in a real headless Chromium (selenium) against the running tiny stack: a streamed chat, a
text-to-image request with live progress and a preview, an interleaved answer; a screenshot is kept as a test
artifact (test-artifacts/playground.png). Under CI=true a missing browser is a failure, not a skip."""
import os
import shutil

import httpx
import pytest

from .stackproc import ROOT

CHROMIUM_FLAGS = ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--disable-dev-shm-usage", "--window-size=1280,1800")
ARTIFACTS = os.path.join(ROOT, "test-artifacts")


def _unavailable(why: str):
    if os.environ.get("CI") == "true":
        pytest.fail(f"the playground browser test needs {why} (CI=true: .ci/run installs it)")
    pytest.skip(f"needs {why}")


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        _unavailable("selenium (pip install selenium)")
    chromium = next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome")
                     if shutil.which(n)), None)
    driver = shutil.which("chromedriver")
    if not chromium or not driver:
        _unavailable("Chromium and chromedriver (apt-get install chromium chromium-driver)")
    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium
    for flag in CHROMIUM_FLAGS:
        opts.add_argument(flag)
    opts.add_argument(f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}")
    os.environ.setdefault("SE_OFFLINE", "true")     # never let selenium fetch a driver: the network is closed
    d = webdriver.Chrome(service=Service(driver), options=opts)
    d.set_page_load_timeout(60)
    yield d
    d.quit()


def _wait_status(browser, element_id: str, timeout: float = 180) -> str:
    from selenium.webdriver.support.ui import WebDriverWait

    def finished(drv):
        el = drv.find_element("id", element_id)
        text = el.text
        if "error" in (el.get_attribute("class") or ""):
            raise AssertionError(f"{element_id}: {text}")
        return text if text.startswith("done") else False
    return WebDriverWait(browser, timeout, poll_frequency=0.2).until(finished)


def _set(browser, element_id: str, value: str):
    el = browser.find_element("id", element_id)
    el.clear()
    el.send_keys(value)


def _tab(browser, name: str):
    browser.find_element("css selector", f'.tab[data-tab="{name}"]').click()


def test_playground_page_is_served(stack):
    r = httpx.get(stack.base + "/", timeout=10, follow_redirects=False)
    assert r.status_code in (302, 307) and r.headers["location"] == "/playground"
    page = httpx.get(stack.base + "/playground", timeout=10)
    assert page.status_code == 200 and "u1serve playground" in page.text
    assert "default-src 'self'" in page.headers["content-security-policy"]
    for name in ("playground.js", "playground.css"):
        assert httpx.get(f"{stack.base}/playground/static/{name}", timeout=10).status_code == 200
    assert "/playground" not in httpx.get(stack.base + "/openapi.json", timeout=10).json()["paths"]


def test_playground_chat_image_and_interleaved_answer(stack, browser):
    browser.get(stack.base + "/")
    assert browser.title == "u1serve playground"

    # chat, streamed
    _set(browser, "chat-max-tokens", "8")
    _set(browser, "chat-input", "Hello there")
    browser.find_element("id", "chat-send").click()
    assert _wait_status(browser, "chat-status").startswith("done (")
    bubbles = browser.find_elements("css selector", ".msg.assistant")
    assert len(bubbles) == 1

    # text to image: progress, a preview, the image
    _tab(browser, "image")
    _set(browser, "img-prompt", "a red fox in the snow")
    _set(browser, "img-size", "64x64")
    _set(browser, "img-steps", "4")
    _set(browser, "img-seed", "3")
    browser.find_element("id", "img-generate").click()
    assert _wait_status(browser, "img-status").startswith("done (1 image")
    assert browser.execute_script("return document.querySelector('#img-results img').naturalWidth") == 64
    assert browser.find_elements("css selector", "#img-preview img")
    assert browser.execute_script("return document.getElementById('img-progress').value") == 4

    # an interleaved answer (a small logit_bias makes the random tiny model draw)
    _tab(browser, "interleave")
    _set(browser, "il-prompt", "Draw a house and describe it")
    _set(browser, "il-size", "64x64")
    _set(browser, "il-steps", "2")
    _set(browser, "il-max-images", "2")
    _set(browser, "il-extra", '{"logit_bias": {"262": 0.2}, "max_tokens": 30}')
    browser.find_element("id", "il-send").click()
    status = _wait_status(browser, "il-status")
    assert "2 images" in status, status
    assert browser.execute_script(
        "return [...document.querySelectorAll('img.generated')].filter(i => i.naturalWidth === 64).length") == 2

    os.makedirs(ARTIFACTS, exist_ok=True)
    shot = os.path.join(ARTIFACTS, "playground.png")
    assert browser.save_screenshot(shot)
    print(f"playground screenshot: {shot}")
