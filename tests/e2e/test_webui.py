"""The chat page at ``GET /``: its headers and content, ``--no-webui``, ``certs --p12``, and the
page in a real browser -- Debian's headless Chromium driven by Selenium -- over plain loopback
HTTP and over mutual TLS with the exported PKCS#12 file in the browser's NSS store."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile

import pytest
from helpers import (
    TEST_CONFIG,
    ThreadedServer,
    debian_binary,
    request,
    serving,
    start_server,
    wait_until,
)

from tiny_mindie.api import webui
from tiny_mindie.config.load import load_config

CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                  "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync")
#: Where Debian's Chromium reads its managed policies (AutoSelectCertificateForUrls).
POLICIES = "/etc/chromium/policies/managed"
#: A prompt the default model answers at length when greedy (hundreds of tokens).
LONG = "Count from 1 to 200, one number per line."


# ---- the page and its headers ------------------------------------------------------------
def test_the_page_is_self_contained_and_writes_model_text_as_text():
    html, policy = webui.page()
    text = html.decode()
    assert not re.search(r"(src|href)\s*=\s*[\"'](?!data:,)", text)   # nothing loaded
    assert not re.search(r"https?://", text)             # no other host named anywhere
    assert "innerHTML" not in text and "insertAdjacentHTML" not in text
    assert "document.write" not in text and "eval(" not in text
    assert 'fetch("/v1/chat/completions"' in text and 'fetch("/v1/models")' in text
    for tag in ("script", "style"):
        inline = text.split(f"<{tag}>")[1].split(f"</{tag}>")[0].encode()
        digest = base64.b64encode(hashlib.sha256(inline).digest()).decode()
        assert f"{tag}-src 'sha256-{digest}'" in policy
    assert "default-src 'self'" in policy and "connect-src 'self'" in policy
    assert "unsafe" not in policy


def test_no_webui_leaves_the_route_out():
    from tiny_mindie.service.app import App
    from tiny_mindie.service.shutdown import ShutdownControl

    cfg = load_config(None)
    on = App(cfg, shutdown=ShutdownControl())
    off = App(cfg.with_overrides(**{"server.webui": False}), shutdown=ShutdownControl())
    assert [r.path for r in on.routes if r.method == "GET" and r.path == "/"] == ["/"]
    assert not [r for r in off.routes if r.method == "GET" and r.path == "/"]


def test_the_page_is_served_with_its_policy(server):
    status, headers, body = request(server, "GET", "/")
    assert status == 200
    assert headers["content-type"] == "text/html; charset=utf-8"
    assert body == webui.page()[0]
    assert headers["content-security-policy"] == webui.page()[1]
    assert headers["x-content-type-options"] == "nosniff"
    wait_until(lambda: any(f"chat     python -m tiny_mindie chat --url {server.url} --config "
                           in line for line in server.log), what="the banner's chat line")
    assert any(line.startswith(f"  page     {server.url}/") for line in server.log)


def test_p12_export_holds_the_client_pair_and_the_ca(tmp_path):
    from cryptography.hazmat.primitives.serialization import pkcs12

    home = str(tmp_path)
    run = [sys.executable, "-m", "tiny_mindie", "certs", "--dir", home]
    assert subprocess.run(run, capture_output=True).returncode == 0
    out = str(tmp_path / "client.p12")
    done = subprocess.run([*run, "--p12", out, "--p12-password", "pass word"],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "Chrome/Chromium" in done.stdout and "Firefox" in done.stdout
    assert os.stat(out).st_mode & 0o777 == 0o600
    with pytest.raises(ValueError):
        pkcs12.load_key_and_certificates(open(out, "rb").read(), b"wrong")
    key, cert, cas = pkcs12.load_key_and_certificates(open(out, "rb").read(), b"pass word")
    assert "tiny_mindie client" in cert.subject.rfc4514_string() and key is not None
    assert [ca.subject for ca in cas] == [cert.issuer]
    again = subprocess.run([*run, "--p12", out, "--p12-password", "pass word"],
                           capture_output=True, text=True)
    assert again.returncode == 1 and "exists" in again.stderr


# ---- a real browser -----------------------------------------------------------------------
def _browser(home: str):
    """Headless Chromium with a fresh profile, ``HOME`` (its NSS store) in ``home``."""
    webdriver = pytest.importorskip("selenium.webdriver")
    chromium = debian_binary("chromium", "chromium")
    driver = debian_binary("chromedriver", "chromium-driver")
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in CHROMIUM_FLAGS:
        options.add_argument(flag)
    options.add_argument("--user-data-dir=" + os.path.join(home, "profile"))
    service = webdriver.ChromeService(executable_path=driver,
                                      env={**os.environ, "HOME": home})
    return webdriver.Chrome(options=options, service=service)


def _chat_in_the_page(browser, url: str) -> None:
    """Load the page, send a message, see the answer stream, stop it, find it kept after a
    reload; then a short answer with its stats, and a 400 shown as the server wrote it."""
    from selenium.webdriver.common.by import By

    def find(css):      # the text of each element (the page re-renders an answer as it grows)
        return browser.execute_script(
            "return [...document.querySelectorAll(arguments[0])].map(e => e.textContent)", css)

    browser.get(url)
    wait_until(lambda: find("#model") and find("#model")[0], within=60, what="model name")
    browser.find_element(By.ID, "temperature").clear()
    browser.find_element(By.ID, "temperature").send_keys("0")
    browser.find_element(By.ID, "max-tokens").clear()
    browser.find_element(By.ID, "max-tokens").send_keys("600")
    browser.find_element(By.ID, "input").send_keys(LONG)
    browser.find_element(By.ID, "send").click()
    # streaming: part of the answer on the page while the stop button is still live
    wait_until(lambda: "2. 2" in "".join(find(".msg.assistant .content")),
               within=120, what="the first tokens")
    assert browser.find_element(By.ID, "stop").is_enabled()
    browser.find_element(By.ID, "stop").click()
    wait_until(lambda: find(".msg.assistant .stopped"), within=30, what="the stop")
    assert not browser.find_element(By.ID, "stop").is_enabled()
    partial = find(".msg.assistant .content")[0]
    assert partial.startswith("1. 1\n2. 2") and "200. 200" not in partial
    browser.refresh()
    wait_until(lambda: find(".msg.assistant"), within=30, what="the kept conversation")
    assert find(".msg.user .content") == [LONG]
    assert find(".msg.assistant .content")[0] == partial
    assert find(".msg.assistant .stopped")
    saved = json.loads(browser.execute_script("return localStorage.getItem('tiny_mindie.chat')"))
    assert saved["temperature"] == 0 and saved["max_tokens"] == 600
    # a new chat, a short answer: tokens/s and TTFT under it, code fences as code
    browser.find_element(By.ID, "new").click()
    browser.find_element(By.ID, "max-tokens").clear()
    browser.find_element(By.ID, "max-tokens").send_keys("40")
    browser.find_element(By.ID, "input").send_keys(
        "Write a Python function that adds two numbers, in a ```python code block.")
    browser.find_element(By.ID, "send").click()
    wait_until(lambda: find(".msg.assistant .stats"), within=120, what="the answer's stats")
    assert re.fullmatch(r"\d+ tokens, TTFT \d+ ms, [\d.]+ tokens/s, prompt \d+ tokens "
                        r"\(\d+ cached\)", find(".msg.assistant .stats")[0])
    assert len(find(".msg")) == 2
    # the server's 400, shown as its body says
    browser.find_element(By.ID, "temperature").clear()
    browser.find_element(By.ID, "temperature").send_keys("-1")
    browser.find_element(By.ID, "input").send_keys("Hello")
    browser.find_element(By.ID, "send").click()
    wait_until(lambda: find(".msg.assistant .error"), within=60, what="the error")
    assert find(".msg.assistant .error")[0].startswith("HTTP 400: ")
    assert "temperature" in find(".msg.assistant .error")[0]
    # model text is text: a fence is code, markup stays characters
    answer = "Here:\n```python\nprint(1)\n```\n<img src=x onerror=alert(1)><b>bold</b>"
    browser.execute_script("localStorage.setItem('tiny_mindie.chat', JSON.stringify(arguments[0]))",
                           {"messages": [{"role": "user", "content": "x"},
                                         {"role": "assistant", "content": answer}],
                            "system": "", "temperature": 0, "max_tokens": 40})
    browser.refresh()
    wait_until(lambda: find(".msg.assistant pre code"), within=30, what="the code block")
    assert find(".msg.assistant pre code") == ["print(1)\n"]
    assert not find(".msg img") and not find(".msg b")
    assert find(".msg.assistant .content")[0].endswith(answer[-37:])


@pytest.mark.e2e
def test_the_page_in_chromium_over_plain_http(model_path, tmp_path):
    home = str(tmp_path)
    browser = _browser(home)
    config = json.loads(json.dumps(TEST_CONFIG))
    config["ServerConfig"]["httpsEnabled"] = False
    srv = start_server(home, config)
    try:
        for running in serving(srv):
            _chat_in_the_page(browser, f"http://127.0.0.1:{running.port}/")
            assert f"  page     http://127.0.0.1:{running.port}/\n" in running.log
    finally:
        browser.quit()


@pytest.fixture
def nss_home(server, tmp_path):
    """A ``HOME`` whose NSS store holds the server's client certificate (imported from the
    ``certs --p12`` export) and trusts its CA; Chromium's policy picks the certificate for the
    server without a dialog (a policy file, removed afterwards)."""
    pk12util = debian_binary("pk12util", "libnss3-tools")
    certutil = debian_binary("certutil", "libnss3-tools")
    home = str(tmp_path)
    p12 = os.path.join(home, "client.p12")
    subprocess.run([sys.executable, "-m", "tiny_mindie", "certs", "--config",
                    server.config_path, "--p12", p12, "--p12-password", "browser"],
                   check=True, capture_output=True)
    db = "sql:" + os.path.join(home, ".pki", "nssdb")
    os.makedirs(os.path.join(home, ".pki", "nssdb"))
    subprocess.run([certutil, "-N", "-d", db, "--empty-password"], check=True)
    subprocess.run([pk12util, "-d", db, "-i", p12, "-W", "browser"], check=True,
                   capture_output=True)
    subprocess.run([certutil, "-A", "-d", db, "-n", "tiny_mindie test CA", "-t", "C,,",
                    "-i", server.ca], check=True)
    try:
        os.makedirs(POLICIES, exist_ok=True)
        fd, policy = tempfile.mkstemp(prefix="tiny_mindie_test_", suffix=".json", dir=POLICIES)
    except OSError as exc:
        why = f"cannot write a Chromium policy in {POLICIES}: {exc}"
        pytest.fail(why) if os.environ.get("CI") else pytest.skip(why)
    with os.fdopen(fd, "w") as fh:
        json.dump({"AutoSelectCertificateForUrls": [json.dumps(
            {"pattern": f"https://127.0.0.1:{server.port}", "filter": {}})]}, fh)
    os.chmod(policy, 0o644)
    try:
        yield home
    finally:
        os.unlink(policy)


def test_the_page_in_chromium_over_mutual_tls(server, nss_home):
    browser = _browser(nss_home)
    try:
        _chat_in_the_page(browser, server.url + "/")
    finally:
        browser.quit()


@pytest.mark.e2e       # a browser process: in CI a missing one fails, not skips (ci_gate.py)
def test_the_page_shows_the_503_of_a_model_still_loading(tmp_path):
    """In process, on a real socket: an app whose model is still being pulled serves the page,
    and the page shows the API's 503 as it says it."""
    from selenium.webdriver.common.by import By

    from tiny_mindie.server.routing import BUSINESS
    from tiny_mindie.service.app import App
    from tiny_mindie.service.shutdown import ShutdownControl

    config = load_config(None).with_overrides(**{"server.https_enabled": False})
    app = App(config, shutdown=ShutdownControl())
    app.loading.log("pulling smollm2-135m-instruct (98 MB)")
    handle = app.handler_for(frozenset({BUSINESS}))

    class Business(ThreadedServer):
        async def handler(self, request, stream):
            return await handle(request, stream)

    browser = _browser(str(tmp_path))
    try:
        with Business(max_body_bytes=1 << 20) as srv:
            browser.get(f"http://127.0.0.1:{srv.port}/")
            browser.find_element(By.ID, "input").send_keys("Hello")
            browser.find_element(By.ID, "send").click()
            wait_until(lambda: browser.find_elements(By.CSS_SELECTOR, ".msg .error"),
                       within=30, what="the error")
            error = browser.find_element(By.CSS_SELECTOR, ".msg .error").text
    finally:
        browser.quit()
    assert error == ("HTTP 503: The model is loading: pulling smollm2-135m-instruct (98 MB)")


def test_p12_password_is_asked_for_when_not_given(tmp_path):
    pexpect = pytest.importorskip("pexpect")
    from cryptography.hazmat.primitives.serialization import pkcs12

    home, out = str(tmp_path), str(tmp_path / "client.p12")
    subprocess.run([sys.executable, "-m", "tiny_mindie", "certs", "--dir", home], check=True,
                   capture_output=True)
    child = pexpect.spawn(sys.executable, ["-m", "tiny_mindie", "certs", "--dir", home,
                                           "--p12", out], encoding="utf-8", timeout=60)
    child.expect_exact("PKCS#12 password: ")
    child.sendline("typed secret")
    child.expect_exact("the same again: ")
    child.sendline("typed secret")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0
    assert "typed secret" not in child.before          # not echoed
    assert pkcs12.load_key_and_certificates(open(out, "rb").read(), b"typed secret")[1]


def test_p12_password_prompt_at_the_end_of_input_is_one_line(tmp_path):
    home, out = str(tmp_path), str(tmp_path / "client.p12")
    run = [sys.executable, "-m", "tiny_mindie", "certs", "--dir", home]
    subprocess.run(run, check=True, capture_output=True)
    done = subprocess.run([*run, "--p12", out], stdin=subprocess.DEVNULL,
                          capture_output=True, text=True)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr and "no password given" in done.stderr
    assert not os.path.exists(out)
