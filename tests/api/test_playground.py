"""The playground at `/` in a real browser: headless Chromium (Debian's `chromium` and
`chromium-driver`) driven by Selenium against a real server; a screenshot of each state."""

from __future__ import annotations

import os
import shutil

import httpx
import pytest
from PIL import Image

from tests.api.conftest import live_server
from tests.conftest import wait_for

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
DRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
KEY = "pg-secret"

try:
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
except ImportError:  # the test extra brings it
    webdriver = None

MISSING = (
    "selenium is not installed (pip install -e '.[test]')"
    if webdriver is None
    else None
    if os.path.exists(CHROMIUM) and os.path.exists(DRIVER)
    else "no browser: apt-get install chromium chromium-driver"
)
if MISSING and os.environ.get("CI") == "true":
    raise RuntimeError(f"the playground tests need a browser under CI: {MISSING}")
pytestmark = pytest.mark.skipif(MISSING is not None, reason=MISSING or "")


@pytest.fixture(scope="module")
def shots(tmp_path_factory):
    where = os.environ.get("PLAYGROUND_SCREENSHOTS") or str(tmp_path_factory.mktemp("shots"))
    os.makedirs(where, exist_ok=True)
    return where


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with live_server(tmp_path_factory, "null-omni", "null-image", "null-video") as s:
        yield s


@pytest.fixture(scope="module")
def keyed_server(tmp_path_factory):
    with live_server(
        tmp_path_factory, "null-image", "null-video", settings_kw={"api_keys": (KEY,)}
    ) as s:
        yield s


def _browser(width: int = 1280, height: int = 900):
    options = Options()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        options.add_argument(arg)
    options.add_argument(f"--window-size={width},{height}")
    options.add_argument("--autoplay-policy=no-user-gesture-required")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    # the driver's path is given: Selenium Manager never tries to download one
    return webdriver.Chrome(service=Service(executable_path=DRIVER), options=options)


@pytest.fixture
def browser():
    driver = _browser()
    try:
        yield driver
    finally:
        driver.quit()


def _open(driver, server) -> None:
    driver.get(f"{server.url}/")
    wait_for(
        lambda: driver.find_elements(By.CSS_SELECTOR, "#image-model option"),
        15,
        "the models listed",
    )


def _errors(driver) -> list[dict]:
    return [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]


def _set(driver, element_id: str, text: str) -> None:
    field = driver.find_element(By.ID, element_id)
    field.clear()
    field.send_keys(text)


def _rendered(driver, selector: str) -> list:
    """Images under `selector` that finished (not pending) and really decoded."""
    images = driver.find_elements(By.CSS_SELECTOR, f"{selector} img")
    done = [
        i
        for i in images
        if "pending" not in (i.get_attribute("class") or "")
        and driver.execute_script("return arguments[0].complete && arguments[0].naturalWidth", i)
    ]
    return done if images and len(done) == len(images) else []


def _create_video(driver):
    """Create a 1-second video job on the Videos tab; its player, once the job completed."""
    driver.find_element(By.ID, "tab-videos").click()
    _set(driver, "video-seconds", "1")
    driver.find_element(By.ID, "video-create").click()
    return wait_for(
        lambda: driver.find_elements(By.CSS_SELECTOR, "#video-list video"), 20, "a player"
    )[0]


def test_the_page_is_served_with_a_csp_and_no_key(server):
    r = httpx.get(f"{server.url}/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    csp = r.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "default-src 'none'" in csp
    for name in ("app.js", "style.css", "favicon.svg"):
        assert httpx.get(f"{server.url}/playground/{name}").status_code == 200
    assert httpx.get(f"{server.url}/favicon.ico").status_code == 200
    missing = httpx.get(f"{server.url}/playground/nope.js")
    assert missing.status_code == 404 and missing.json()["error"]["message"]


def test_generate_renders_images_with_their_revised_prompt(browser, server, shots):
    _open(browser, server)
    browser.save_screenshot(os.path.join(shots, "1-start.png"))
    _set(browser, "image-prompt", "a big yellow circle")
    _set(browser, "image-n", "2")
    browser.find_element(By.ID, "image-generate").click()
    done = wait_for(lambda: _rendered(browser, "#image-grid"), 20, "two images rendered")
    assert len(done) == 2
    captions = [c.text for c in browser.find_elements(By.CSS_SELECTOR, "#image-grid .revised")]
    model = browser.find_element(By.ID, "image-model").get_attribute("value")
    if model == "null-omni":  # a pipeline with an LLM stage says what it drew
        assert all(c.startswith("drawn: ") for c in captions), captions
    links = browser.find_elements(By.CSS_SELECTOR, "#image-grid a.download")
    assert [a.get_attribute("href").startswith("blob:") for a in links] == [True, True]
    browser.save_screenshot(os.path.join(shots, "2-images.png"))
    status = wait_for(
        lambda: browser.find_element(By.ID, "status-summary").text == "healthy",
        10,
        "the status shown",
    )
    assert status
    rows = browser.find_elements(By.CSS_SELECTOR, "#status-table tbody tr")
    assert rows and all(r.get_attribute("data-state") == "ready" for r in rows)
    assert _errors(browser) == []


def test_partial_images_fill_the_grid_while_it_streams(browser, server, shots):
    _open(browser, server)
    browser.execute_script("arguments[0].value = 'null-image'", _model_select(browser))
    _set(browser, "image-prompt", "a slow square @delay=0.15")
    _set(browser, "image-steps", "12")
    browser.find_element(By.ID, "image-generate").click()
    img = wait_for(
        lambda: browser.find_elements(By.CSS_SELECTOR, "#image-grid img.pending"), 10, "a cell"
    )[0]
    wait_for(  # a real intermediate step, shown before the image is done
        lambda: (
            (img.get_attribute("src") or "").startswith("data:image/png;base64,")
            and "pending" in img.get_attribute("class")
        ),
        10,
        "a partial image in the pending cell",
    )
    browser.save_screenshot(os.path.join(shots, "2b-partial.png"))
    wait_for(lambda: _rendered(browser, "#image-grid"), 20, "the final image")
    assert img.get_attribute("src").startswith("blob:")


def _model_select(browser):
    return browser.find_element(By.ID, "image-model")


def test_a_bad_size_shows_the_apis_own_message(browser, server, shots):
    _open(browser, server)
    _set(browser, "image-size", "4096x4096")
    browser.find_element(By.ID, "image-generate").click()
    box = browser.find_element(By.ID, "image-error")
    wait_for(lambda: box.is_displayed() and box.text, 15, "the error shown")
    model = browser.find_element(By.ID, "image-model").get_attribute("value")
    api = httpx.post(
        f"{server.url}/v1/images/generations",
        json={"prompt": "x", "model": model, "size": "4096x4096", "stream": True},
    )
    assert box.text == f"{api.status_code}: {api.json()['error']['message']}"
    browser.save_screenshot(os.path.join(shots, "3-error.png"))


def test_markup_in_a_prompt_is_shown_as_text_and_never_runs(browser, server, shots):
    _open(browser, server)
    payload = '<img src=x onerror="window.__pwned=1"><script>window.__pwned=2</script>'
    select = browser.find_element(By.ID, "image-model")
    browser.execute_script("arguments[0].value = 'null-omni'", select)
    _set(browser, "image-prompt", payload)
    browser.find_element(By.ID, "image-generate").click()
    wait_for(lambda: _rendered(browser, "#image-grid"), 20, "the image rendered")
    caption = browser.find_element(By.CSS_SELECTOR, "#image-grid .revised").text
    assert "<img src=x" in caption  # the markup is there, as text
    assert browser.execute_script("return window.__pwned") is None
    assert not browser.find_elements(By.CSS_SELECTOR, "#image-grid .revised img")
    # an error message that carries the markup back (an unknown model is named in it)
    browser.execute_script(
        "const o = document.createElement('option'); o.value = arguments[1]; o.textContent = 'x';"
        "arguments[0].append(o); arguments[0].value = arguments[1];",
        select,
        payload,
    )
    browser.find_element(By.ID, "image-generate").click()
    box = browser.find_element(By.ID, "image-error")
    wait_for(lambda: box.is_displayed() and box.text, 15, "the error shown")
    assert box.text.startswith("404: model '<img src=x onerror=") and "<script>" in box.text
    assert not browser.find_elements(By.CSS_SELECTOR, "#image-error *")
    assert browser.execute_script("return window.__pwned") is None
    browser.save_screenshot(os.path.join(shots, "4-markup-as-text.png"))


def test_an_edit_with_a_painted_mask(browser, server, shots, tmp_path):
    _open(browser, server)
    browser.find_element(By.ID, "tab-edits").click()
    png = tmp_path / "square.png"
    Image.new("RGB", (64, 64), (200, 30, 30)).save(png)
    browser.find_element(By.ID, "edit-file").send_keys(str(png))
    canvas = browser.find_element(By.ID, "edit-canvas")
    wait_for(
        lambda: browser.execute_script("return arguments[0].width", canvas) == 64,
        10,
        "the image on the canvas",
    )
    ActionChains(browser).move_to_element(canvas).click_and_hold().move_by_offset(
        20, 10
    ).release().perform()
    painted = browser.execute_script(
        "return editor.mask.getContext('2d').getImageData(0, 0, 64, 64).data"
        ".filter((v, i) => i % 4 === 3 && v > 0).length"
    )
    assert painted > 50, painted  # the brush marked pixels (an empty mask would be a 400)
    browser.find_element(By.ID, "edit-generate").click()
    wait_for(lambda: _rendered(browser, "#edit-grid"), 20, "the edited image rendered")
    browser.save_screenshot(os.path.join(shots, "5-edit.png"))
    assert _errors(browser) == []


def test_a_video_job_plays_in_the_page_and_is_deleted(browser, server, shots):
    _open(browser, server)
    assert browser.execute_script(
        "return document.createElement('video').canPlayType('video/mp4; codecs=\"avc1.64001E\"')"
    ), "this Chromium cannot play the H.264 MP4s the server writes"
    player = _create_video(browser)
    wait_for(
        lambda: browser.execute_script(
            "const v = arguments[0]; return v.readyState >= 2 && v.videoWidth > 0 && !v.paused",
            player,
        ),
        20,
        "the video playing",
    )
    browser.save_screenshot(os.path.join(shots, "6-video.png"))
    item = browser.find_element(By.CSS_SELECTOR, "#video-list li")
    video_id = item.get_attribute("data-id")
    item.find_element(By.CSS_SELECTOR, "button.delete").click()
    wait_for(
        lambda: not browser.find_elements(By.CSS_SELECTOR, f'#video-list li[data-id="{video_id}"]'),
        10,
        "the job gone from the list",
    )
    assert httpx.get(f"{server.url}/v1/videos/{video_id}").status_code == 404
    assert _errors(browser) == []


def test_narrow_screen_keyboard_and_labels(server, shots):
    driver = _browser(375, 800)
    try:
        _open(driver, server)
        overflow = driver.execute_script(
            "return document.documentElement.scrollWidth - document.documentElement.clientWidth"
        )
        assert overflow <= 0, f"{overflow}px of horizontal scroll at 375 px"
        driver.save_screenshot(os.path.join(shots, "7-narrow.png"))
        body = driver.find_element(By.TAG_NAME, "body")
        body.click()
        for _ in range(40):  # Tab reaches Generate
            if driver.switch_to.active_element.get_attribute("id") == "image-generate":
                break
            driver.switch_to.active_element.send_keys(Keys.TAB)
        assert driver.switch_to.active_element.get_attribute("id") == "image-generate"
        unlabelled = driver.execute_script(
            """
            return [...document.querySelectorAll('input, select, textarea, button, canvas')]
              .filter((c) => !(c.labels && c.labels.length) && !c.getAttribute('aria-label')
                             && !(c.tagName === 'BUTTON' && c.textContent.trim()))
              .map((c) => c.id || c.outerHTML);
            """
        )
        assert unlabelled == []
        assert _errors(driver) == []
    finally:
        driver.quit()


def test_with_an_api_key_the_page_asks_for_it_and_sends_it(keyed_server, shots):
    driver = _browser()
    try:
        driver.get(f"{keyed_server.url}/")  # the page itself needs no key
        box = driver.find_element(By.ID, "image-error")
        wait_for(lambda: box.is_displayed() and box.text, 10, "the missing key said")
        assert box.text == "401: missing API key"
        key = driver.find_element(By.ID, "api-key")
        key.send_keys(KEY, Keys.TAB)  # change: kept in local storage, models reloaded
        wait_for(
            lambda: driver.find_elements(By.CSS_SELECTOR, "#image-model option"),
            10,
            "the models listed with the key",
        )
        assert driver.execute_script("return localStorage.getItem('vllm_omni_like.api_key')") == KEY
        driver.find_element(By.ID, "image-generate").click()
        wait_for(lambda: _rendered(driver, "#image-grid"), 20, "an image with the key")
        player = _create_video(driver)
        wait_for(  # the MP4 was fetched with the key, as a blob
            lambda: driver.execute_script(
                "return arguments[0].src.startsWith('blob:') && arguments[0].readyState >= 2",
                player,
            ),
            20,
            "the video loaded with the key",
        )
        driver.save_screenshot(os.path.join(shots, "8-with-key.png"))
        # a reload keeps the key
        driver.refresh()
        wait_for(
            lambda: driver.find_elements(By.CSS_SELECTOR, "#image-model option"),
            10,
            "the models listed after a reload",
        )
        errors = [e for e in _errors(driver) if "401" not in e["message"]]
        assert errors == []  # the one 401 is the page asking before the key was given
    finally:
        driver.quit()
