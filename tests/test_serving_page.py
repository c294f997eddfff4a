"""The chat page at / in headless Chromium: type a message, watch the answer stream in.

Needs Debian's `chromium` and `chromium-driver` (apt-get install -y chromium chromium-driver).
"""

import shutil
import threading

import httpx
import pytest

from easylm.serving import server as server_lib
from serving_utils import ServerThread, make_batcher, make_tokenizer

CHROMIUM, DRIVER = shutil.which("chromium"), shutil.which("chromedriver")
pytestmark = pytest.mark.skipif(
    CHROMIUM is None or DRIVER is None,
    reason="headless Chromium is not installed (apt-get install -y chromium chromium-driver)",
)

@pytest.fixture(scope="module")
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    options = Options()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(DRIVER), options=options)
    yield driver
    driver.quit()


def test_chat_page_streams_an_answer(browser):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    tokenizer = make_tokenizer()
    batcher, _, _ = make_batcher(stop_token_ids=(tokenizer.eos_token_id,))
    service = server_lib.Service({"api_key": "page-key"}, batcher, tokenizer)
    # The first time the reply gets text before its end, the batcher (which calls
    # on_event) holds until the page shows that text: the reply has to appear in pieces,
    # however the host schedules the server, the batcher and the browser.
    page_shows_text = threading.Event()
    submit = batcher.submit

    def submit_held(generation):
        emit = generation.on_event

        def on_event(event):
            emit(event)
            if event.text and event.finish_reason is None and not page_shows_text.is_set():
                page_shows_text.wait(120)  # a guard: a page that never shows text fails below

        generation.on_event = on_event
        return submit(generation)

    batcher.submit = submit_held
    try:
        with ServerThread(server_lib.create_app(service)) as server:
            browser.get(server.url + "/")
            assert browser.title == "easylm chat"
            for field, value in (("temperature", "0"), ("max_tokens", "12"),
                                 ("api_key", "page-key")):
                element = browser.find_element(By.ID, field)
                element.clear()
                element.send_keys(value)
            browser.find_element(By.ID, "input").send_keys("Hello there")
            browser.find_element(By.ID, "send").click()
            reply_text = "return document.querySelector('.message.assistant').textContent"
            WebDriverWait(browser, 120).until(lambda d: d.find_elements(
                By.CSS_SELECTOR, ".message.assistant") and d.execute_script(reply_text))
            partial = browser.execute_script(reply_text)
            page_shows_text.set()
            WebDriverWait(browser, 120).until(lambda d: d.find_elements(
                By.CSS_SELECTOR, ".message.assistant[data-done='true']"))
            shown = browser.execute_script(reply_text)
            user = browser.find_element(By.CSS_SELECTOR, ".message.user").text
            expected = httpx.post(
                server.url + "/v1/chat/completions",
                headers={"Authorization": "Bearer page-key"},
                json={"messages": [{"role": "user", "content": "Hello there"}],
                      "max_tokens": 12, "temperature": 0}, timeout=120,
            ).json()["choices"][0]["message"]["content"]
    finally:
        page_shows_text.set()
        batcher.stop()
    assert user == "Hello there"
    assert shown == expected and shown
    # Streamed: the page showed the first tokens' text while the rest was being made.
    assert partial != shown and shown.startswith(partial), (partial, shown)
