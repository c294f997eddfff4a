"""The chat page at / in headless Chromium: streaming, Stop, readable errors, the history
after a failed turn, the narrow layout, and a screenshot.

Needs Debian's `chromium` and `chromium-driver` (apt-get install -y chromium chromium-driver).
"""

import contextlib
import shutil
import threading
import time

import httpx
import pytest
from serving_utils import ServerThread, make_batcher, make_tokenizer

from easylm.serving import server as server_lib

CHROMIUM, DRIVER = shutil.which("chromium"), shutil.which("chromedriver")
pytestmark = pytest.mark.skipif(
    CHROMIUM is None or DRIVER is None,
    reason="headless Chromium is not installed (apt-get install -y chromium chromium-driver)",
)
WAIT = 120  # seconds: a guard against hanging, never a timing assumption
KEY = "page-key"
MAX_TOKENS = 24  # the keyless server's --max_tokens


@pytest.fixture(scope="module")
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    options = Options()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                 "--window-size=1280,900"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(DRIVER), options=options)
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def servers():
    """One tiny model behind two servers: one that needs an API key, one that does not."""
    tokenizer = make_tokenizer()
    batcher, _, _ = make_batcher(stop_token_ids=(tokenizer.eos_token_id,))
    keyed = server_lib.Service({"api_key": KEY}, batcher, tokenizer)
    open_ = server_lib.Service({"max_tokens": MAX_TOKENS}, batcher, tokenizer)
    with contextlib.ExitStack() as stack:
        keyed_url = stack.enter_context(ServerThread(server_lib.create_app(keyed))).url
        open_url = stack.enter_context(ServerThread(server_lib.create_app(open_))).url
        yield {"batcher": batcher, "keyed": (keyed, keyed_url), "open": (open_, open_url)}
    batcher.stop()


@contextlib.contextmanager
def held_at_first_text(batcher):
    """The batcher (which calls on_event) holds at a reply's first visible text until
    `release` is set: the page must show that text while the rest is not yet made.
    Yields (release, the generations submitted)."""
    release, submitted, submit = threading.Event(), [], batcher.submit

    def submit_held(generation):
        emit = generation.on_event

        def on_event(event):
            emit(event)
            if event.text.strip() and event.finish_reason is None and not release.is_set():
                release.wait(WAIT)

        generation.on_event = on_event
        submitted.append(generation)
        return submit(generation)

    batcher.submit = submit_held
    try:
        yield release, submitted
    finally:
        release.set()
        batcher.submit = submit


@contextlib.contextmanager
def held_prefill(engine):
    """The engine's prefill (a new prompt length compiling, as the page sees it) waits
    until the yielded event is set."""
    release, prefill = threading.Event(), engine.prefill

    def held(*args):
        release.wait(WAIT)
        return prefill(*args)

    engine.prefill = held
    try:
        yield release
    finally:
        release.set()
        engine.prefill = prefill


@contextlib.contextmanager
def recorded_messages(service):
    """The `messages` of each chat request the server formats."""
    sent, real = [], service.apply_chat_template
    service.apply_chat_template = lambda messages: (sent.append(messages), real(messages))[1]
    try:
        yield sent
    finally:
        service.apply_chat_template = real


def wait_until(browser, condition, what):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(browser, WAIT, poll_frequency=0.05).until(
        lambda d: condition(), message=f"timed out waiting for {what}")


def poll(condition, what):
    for _ in range(int(WAIT / 0.05)):  # bounded; returns as soon as it holds
        if condition():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def js(browser, script):
    return browser.execute_script(script)


def open_page(browser, url):
    browser.get(url + "/")
    assert browser.title == "easylm chat"
    wait_until(browser, lambda: js(browser, "return document.getElementById('model').textContent")
               != "connecting...", "the page to ask /v1/models")


def type_and_send(browser, text):
    from selenium.webdriver.common.by import By

    browser.find_element(By.ID, "input").send_keys(text)
    browser.find_element(By.ID, "send").click()


def set_field(browser, field, value):
    from selenium.webdriver.common.by import By

    if not js(browser, "return document.querySelector('details').open"):
        browser.find_element(By.TAG_NAME, "summary").click()
    element = browser.find_element(By.ID, field)
    element.clear()
    element.send_keys(value)


def key_field_shown(browser):
    from selenium.webdriver.common.by import By

    if not js(browser, "return document.querySelector('details').open"):
        browser.find_element(By.TAG_NAME, "summary").click()
    return browser.find_element(By.ID, "api_key").is_displayed()


def last(browser, selector, prop="textContent"):
    return js(browser, f"const all = document.querySelectorAll({selector!r}); "
                       f"return all.length ? all[all.length - 1].{prop} : null")


def replies_done(browser, count):
    return len(js(browser, "return [...document.querySelectorAll("
                           "'.message[data-done=\"true\"]')]")) >= count


def test_chat_page_streams_an_answer(browser, servers):
    service, url = servers["keyed"]
    with held_at_first_text(servers["batcher"]) as (release, _):
        open_page(browser, url)
        # The server needs a key: the page says so and shows the field only now.
        assert "API key" in js(browser, "return document.getElementById('model').textContent")
        assert key_field_shown(browser)
        set_field(browser, "temperature", "0")
        set_field(browser, "max_tokens", "12")
        set_field(browser, "api_key", KEY)
        set_field(browser, "temperature", "0")  # (leaving the key field fires its change)
        wait_until(browser, lambda: "64-token context" in js(
            browser, "return document.getElementById('model').textContent"), "the model's name")
        assert js(browser, "return document.getElementById('model').textContent").startswith("easylm")
        type_and_send(browser, "Hello there")
        wait_until(browser, lambda: last(browser, ".message.assistant:not(.pending)"),
                   "the first text")
        partial = last(browser, ".message.assistant")
        release.set()
        wait_until(browser, lambda: replies_done(browser, 1), "the reply to end")
    shown = last(browser, ".message.assistant")
    expected = httpx.post(
        url + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
        json={"messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 12,
              "temperature": 0}, timeout=WAIT,
    ).json()["choices"][0]["message"]["content"]
    assert last(browser, ".message.user") == "Hello there"
    # The reply as the API gives it, less the space that marks its first word's start.
    assert shown == expected.lstrip() and shown
    # Streamed: the page showed the first tokens' text while the rest was being made.
    assert partial != shown and shown.startswith(partial), (partial, shown)


def test_an_attached_image_goes_as_a_data_url_image_part(browser, servers, tmp_path):
    """The file input's image is sent as OpenAI's image part (a data URL of the file's
    bytes) before the text; this text-only server refuses it in one readable line, which
    the page shows, and the page then sends text alone again."""
    import base64

    from PIL import Image
    from selenium.webdriver.common.by import By

    service, url = servers["open"]
    path = tmp_path / "red.png"
    Image.new("RGB", (4, 4), (255, 0, 0)).save(path)
    sent, real = [], service.chat_prompt
    service.chat_prompt = lambda messages, references: (
        sent.append((messages, references)), real(messages, references))[1]
    try:
        open_page(browser, url)
        browser.find_element(By.ID, "image").send_keys(str(path))
        assert js(browser, "return document.getElementById('attached').textContent") == "red.png"
        type_and_send(browser, "What colour?")
        wait_until(browser, lambda: replies_done(browser, 1), "the refusal")
    finally:
        service.chat_prompt = real
    (messages, references), = sent
    assert references == ["data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()]
    assert messages[-1]["content"] == [{"type": "image"}, {"type": "text", "text": "What colour?"}]
    assert "reads no images" in last(browser, ".message.notice")
    assert last(browser, ".message.user img", "src") == references[0]
    # Sent once: the attachment is cleared.
    assert js(browser, "return document.getElementById('image').files.length") == 0


def test_stop_cancels_the_request_and_frees_its_slot(browser, servers):
    service, url = servers["open"]
    batcher = servers["batcher"]
    open_page(browser, url)
    assert not key_field_shown(browser)  # no key needed
    set_field(browser, "temperature", "0")
    with recorded_messages(service) as sent:
        with held_at_first_text(batcher) as (release, submitted):
            with held_prefill(batcher.engine):
                type_and_send(browser, "Tell me a story")
                # While the first token is not there, the page says what it waits for.
                wait_until(browser, lambda: "waiting for the first token" in (last(
                    browser, ".message.assistant.pending") or ""), "the waiting note")
                assert "compiles" in last(browser, ".message.assistant")
            wait_until(browser, lambda: last(browser, ".message.assistant:not(.pending)"),
                       "the first text")
            assert js(browser, "return document.getElementById('send').textContent") == "Stop"
            partial = last(browser, ".message.assistant")
            js(browser, "document.getElementById('send').click()")
            # The batcher is still held: only the server noticing the abort can cancel it.
            poll(lambda: submitted[0].cancelled, "the server to cancel the request")
            release.set()
            poll(lambda: all(s is None for s in batcher.slots), "the slot to be freed")
        assert submitted[0].finish_reason == "cancelled"
        wait_until(browser, lambda: replies_done(browser, 1), "the page to settle")
        assert last(browser, ".message.assistant", "className").endswith("stopped")
        assert last(browser, ".message.assistant") == partial
        assert js(browser, "return document.getElementById('send').textContent") == "Send"
        # What was shown before Stop is the reply the next request carries.
        type_and_send(browser, "And then?")
        wait_until(browser, lambda: replies_done(browser, 2), "the second reply")
    assert sent[-1] == [{"role": "user", "content": "Tell me a story"},
                        {"role": "assistant", "content": partial},
                        {"role": "user", "content": "And then?"}]


def test_errors_are_readable_and_a_failed_turn_is_left_out(browser, servers):
    service, url = servers["open"]
    open_page(browser, url)
    with recorded_messages(service) as sent:
        long = " ".join(["continuous batching"] * 40)  # far more than the 64-token context
        type_and_send(browser, long)
        wait_until(browser, lambda: replies_done(browser, 1), "the error")
        notice = last(browser, ".message.notice")
        assert notice.startswith("The server refused the request (400): the prompt has "), notice
        assert "context is 64 tokens" in notice and "not part of the conversation" in notice
        assert "failed" in last(browser, ".message.user", "className")
        assert js(browser, "return document.getElementById('input').value") == long  # to retry

        # max tokens above the server's limit: refused in the page, nothing sent.
        js(browser, "document.getElementById('input').value = ''")
        set_field(browser, "max_tokens", "100000")
        type_and_send(browser, "Hi")
        wait_until(browser, lambda: "max tokens" in (last(browser, ".message.notice") or ""),
                   "the limit's message")
        assert f"less than or equal to {MAX_TOKENS}" in last(browser, ".message.notice")
        requests = len(sent)
        set_field(browser, "max_tokens", "4")
        js(browser, "document.getElementById('input').value = ''")
        type_and_send(browser, "Hi")
        wait_until(browser, lambda: replies_done(browser, 2), "the reply")
    assert len(sent) == requests + 1
    assert sent[-1] == [{"role": "user", "content": "Hi"}]  # neither the failed turn nor 'Hi'x2

    # The server gone: one readable line, not "Failed to fetch".
    with ServerThread(server_lib.create_app(service)) as doomed:
        open_page(browser, doomed.url)
    type_and_send(browser, "Anyone there?")
    wait_until(browser, lambda: replies_done(browser, 1), "the error")
    notice = last(browser, ".message.notice")
    assert notice.startswith(f"Cannot reach the server at {doomed.url}"), notice
    assert "Failed to fetch" not in notice


def _layout(browser):
    return js(browser, """
        const box = (e) => e.getBoundingClientRect();
        const header = document.querySelector('header');
        const all = [...document.querySelectorAll('body *')].filter(e => box(e).width > 0);
        return {
          width: window.innerWidth,
          scrollWidth: document.documentElement.scrollWidth,
          widest: Math.max(...all.map(e => box(e).right)),
          headerRows: new Set([...header.children].map(e => Math.round((box(e).top + box(e).bottom) / 16))).size,
          headerHeight: box(header).height,
          userBubble: box(document.querySelector('.message.user')).width,
          messages: box(document.getElementById('messages')).width,
        };""")


@pytest.mark.parametrize("width", [400, 1280])
def test_layout_fits_and_looks_like_a_chat(browser, servers, width, tmp_path):
    from PIL import Image

    service, url = servers["open"]
    browser.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", {
        "width": width, "height": 800, "deviceScaleFactor": 1, "mobile": width < 600})
    try:
        open_page(browser, url)
        set_field(browser, "max_tokens", "8")
        browser.find_element("tag name", "summary").click()  # close the settings again
        type_and_send(browser, "hello")
        wait_until(browser, lambda: replies_done(browser, 1), "the reply")
        layout = _layout(browser)
        path = tmp_path / f"chat-{width}.png"
        assert browser.save_screenshot(str(path))
    finally:
        browser.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})
    assert layout["scrollWidth"] <= layout["width"] and layout["widest"] <= layout["width"], layout
    assert layout["headerRows"] == 1 and layout["headerHeight"] < 60, layout
    # A bubble is as wide as its text: "hello" is nowhere near the column's width.
    assert layout["userBubble"] < 0.3 * layout["messages"], layout
    image = Image.open(path).convert("RGB")
    assert image.size[0] == width
    colors = image.getcolors(maxcolors=1 << 16)
    background = max(colors)[0] if colors else 0
    assert colors is None or len(colors) > 50, "the screenshot is nearly blank"
    assert background < 0.95 * image.size[0] * image.size[1], "the screenshot is nearly blank"
