"""The chat page at / in headless Chromium: type a message, watch the answer stream in.

Needs Debian's `chromium` and `chromium-driver` (apt-get install -y chromium chromium-driver).
"""

import shutil

import httpx
import pytest

from easylm.serving import server as server_lib
from serving_utils import ServerThread, make_batcher, make_tokenizer

CHROMIUM, DRIVER = shutil.which("chromium"), shutil.which("chromedriver")
pytestmark = pytest.mark.skipif(
    CHROMIUM is None or DRIVER is None,
    reason="headless Chromium is not installed (apt-get install -y chromium chromium-driver)",
)

# Every change to the newest reply's text, recorded in the page as it happens.
RECORD_UPDATES = """
window.replyTexts = [];
new MutationObserver(() => {
  const replies = document.querySelectorAll('.message.assistant');
  if (replies.length) window.replyTexts.push(replies[replies.length - 1].textContent);
}).observe(document.getElementById('messages'),
           {childList: true, subtree: true, characterData: true});
"""


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
    try:
        with ServerThread(server_lib.create_app(service)) as server:
            browser.get(server.url + "/")
            assert browser.title == "easylm chat"
            browser.execute_script(RECORD_UPDATES)
            for field, value in (("temperature", "0"), ("max_tokens", "12"),
                                 ("api_key", "page-key")):
                element = browser.find_element(By.ID, field)
                element.clear()
                element.send_keys(value)
            browser.find_element(By.ID, "input").send_keys("Hello there")
            browser.find_element(By.ID, "send").click()
            WebDriverWait(browser, 120).until(lambda d: d.find_elements(
                By.CSS_SELECTOR, ".message.assistant[data-done='true']"))
            shown = browser.execute_script(
                "return document.querySelector('.message.assistant').textContent")
            updates = browser.execute_script("return window.replyTexts")
            user = browser.find_element(By.CSS_SELECTOR, ".message.user").text
            expected = httpx.post(
                server.url + "/v1/chat/completions",
                headers={"Authorization": "Bearer page-key"},
                json={"messages": [{"role": "user", "content": "Hello there"}],
                      "max_tokens": 12, "temperature": 0}, timeout=120,
            ).json()["choices"][0]["message"]["content"]
    finally:
        batcher.stop()
    assert user == "Hello there"
    assert shown == expected and shown
    # Streamed: the reply grew through intermediate texts before the final one.
    partial = [t for t in updates if t and t != shown]
    assert partial and all(shown.startswith(t) for t in partial)
