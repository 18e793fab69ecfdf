"""serve.py: the OpenAI-compatible server, driven by the real ``openai`` package, raw HTTP and a headless Chromium.

The server under test runs in its own process on 127.0.0.1, on a small random-weight chat checkpoint with a long
context (so that a long answer takes a while and a client can leave in the middle of it). Every answer is
compared with what ``gpt_model.generate`` gives for the same prompt ids in this process.
"""

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch

from conftest import REPO_ROOT

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

# below the importorskip lines, so that a missing openai or httpx skips this file before anything else loads
from chinese_tokenizer import EOS_ID, chat_messages_ids, chat_prompt_ids, decode, encode, until_eos  # noqa: E402
from gpt_model import GPTConfig, GPTModel, generate  # noqa: E402
from plumbing.checkpoint import load_checkpoint, save_checkpoint  # noqa: E402

CONTEXT = 1024
PROMPT = "写一条好评："


@pytest.fixture(scope="module")
def chat_checkpoint(tmp_path_factory, tokenizer):
    """A random-weight chat checkpoint (stage sft) with a 1024-token context."""
    torch.manual_seed(0)
    model = GPTModel(GPTConfig(context_length=CONTEXT, emb_dim=32, n_heads=2, n_layers=2, drop_rate=0.0))
    path = tmp_path_factory.mktemp("serve") / "sft"
    save_checkpoint(str(path), model, tokenizer, {"stage": "sft"})
    return path


@pytest.fixture(scope="module")
def policy(chat_checkpoint):
    model, _, _ = load_checkpoint(str(chat_checkpoint), "gpt")
    return model


@pytest.fixture(scope="module")
def server(chat_checkpoint, tmp_path_factory):
    """``python serve.py --checkpoint ... --port 0`` in its own process: yields (base_url, process, log path)."""
    log_path = tmp_path_factory.mktemp("serve_log") / "serve.log"
    log = open(log_path, "w")
    proc = subprocess.Popen([sys.executable, "serve.py", "--checkpoint", str(chat_checkpoint), "--port", "0"],
                            cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline = time.time() + 120
    url = None
    while url is None and time.time() < deadline and proc.poll() is None:
        found = re.search(r"http://127\.0\.0\.1:(\d+)/ ", log_path.read_text())
        url = f"http://127.0.0.1:{found.group(1)}" if found else None
        time.sleep(0.2)
    if url is None:
        proc.kill()
        pytest.fail(f"serve.py did not start:\n{log_path.read_text()[-2000:]}")
    yield url, proc, log_path
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
    log.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0, timeout=60)


def greedy(model, ids, n):
    """What generate gives alone: the first n greedy tokens after ``ids``, and whether [SEP] ended them."""
    out = generate(model, torch.tensor([ids]), n, CONTEXT, temperature=0.0, eos_id=EOS_ID)[0, len(ids):].tolist()
    return until_eos(out), EOS_ID in out


def test_models_lists_the_checkpoint(client):
    models = client.models.list().data
    assert [m.id for m in models] == ["sft"]
    assert client.models.retrieve("sft").id == "sft"


def test_chat_completion_equals_generate(client, policy, tokenizer):
    reply = client.chat.completions.create(model="sft", messages=[{"role": "user", "content": PROMPT}],
                                           temperature=0, max_tokens=12)
    ids = chat_prompt_ids(PROMPT, tokenizer)
    tokens, ended = greedy(policy, ids, 12)
    choice = reply.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == decode(tokens, tokenizer)
    assert choice.finish_reason == ("stop" if ended else "length")
    assert reply.usage.prompt_tokens == len(ids)
    assert reply.usage.completion_tokens == len(tokens) + ended
    assert reply.usage.total_tokens == len(ids) + len(tokens) + ended
    assert reply.object == "chat.completion" and reply.model == "sft"


def test_multi_turn_conversation_goes_through_the_template(client, policy, tokenizer):
    messages = [{"role": "system", "content": "你是一个助手"}, {"role": "user", "content": "你好"},
                {"role": "assistant", "content": "你好！"}, {"role": "user", "content": PROMPT}]
    reply = client.chat.completions.create(model="sft", messages=messages, temperature=0, max_tokens=6)
    ids = chat_messages_ids([(m["role"], m["content"]) for m in messages], tokenizer)
    assert ids.count(EOS_ID) == 2  # the system text and the assistant turn each end with [SEP]
    assert reply.usage.prompt_tokens == len(ids)
    assert reply.choices[0].message.content == decode(greedy(policy, ids, 6)[0], tokenizer)


def test_stream_sends_the_same_text_in_pieces(client, server, policy, tokenizer):
    chunks = list(client.chat.completions.create(model="sft", messages=[{"role": "user", "content": PROMPT}],
                                                 temperature=0, max_tokens=10, stream=True,
                                                 stream_options={"include_usage": True}))
    pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    tokens, ended = greedy(policy, chat_prompt_ids(PROMPT, tokenizer), 10)
    assert "".join(pieces) == decode(tokens, tokenizer) and len(pieces) > 1
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["stop" if ended else "length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(tokens) + ended

    # the wire format: every event is one `data: <json>` line, and the last is `data: [DONE]`
    body = {"model": "sft", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 5, "stream": True}
    with httpx.stream("POST", server[0] + "/v1/chat/completions", json=body, timeout=60) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = response.read().decode().split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    for event in events[:-2]:
        assert event.startswith("data: ") and "\n" not in event
        assert json.loads(event[6:])["object"] == "chat.completion.chunk"


def test_completions_continue_plain_text(client, policy, tokenizer):
    reply = client.completions.create(model="sft", prompt="床前明月光", temperature=0, max_tokens=8)
    tokens, _ = greedy(policy, encode("床前明月光", tokenizer), 8)
    assert reply.choices[0].text == decode(tokens, tokenizer) and reply.object == "text_completion"
    streamed = client.completions.create(model="sft", prompt="床前明月光", temperature=0, max_tokens=8, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == reply.choices[0].text
    two = client.completions.create(model="sft", prompt=["床前明月光", "白日依山尽"], temperature=0, max_tokens=4)
    assert [c.index for c in two.choices] == [0, 1]
    assert two.choices[1].text == decode(greedy(policy, encode("白日依山尽", tokenizer), 4)[0], tokenizer)


def test_n_samples_and_seed_repeat(client):
    def ask():
        reply = client.chat.completions.create(model="sft", messages=[{"role": "user", "content": PROMPT}],
                                               temperature=1.0, max_tokens=8, n=3, seed=7)
        return [c.message.content for c in reply.choices], [c.index for c in reply.choices]

    texts, indices = ask()
    assert indices == [0, 1, 2] and len(set(texts)) > 1  # three different samples
    assert ask()[0] == texts  # the same seed, the same samples


def test_stop_strings_end_the_text_before_them(client, policy, tokenizer):
    tokens, _ = greedy(policy, chat_prompt_ids(PROMPT, tokenizer), 12)
    full = decode(tokens, tokenizer)
    stop = full[5:7]
    for stream in (False, True):
        reply = client.chat.completions.create(model="sft", messages=[{"role": "user", "content": PROMPT}],
                                               temperature=0, max_tokens=12, stop=[stop, "never seen"],
                                               stream=stream)
        if stream:
            chunks = list(reply)
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        else:
            text, finish = reply.choices[0].message.content, [reply.choices[0].finish_reason]
        assert text == full[:full.index(stop)] and finish == ["stop"]


@pytest.mark.parametrize("kwargs, error, words", [
    ({"model": "gpt-4"}, "NotFoundError", "not served here"),
    ({"messages": []}, "BadRequestError", "messages is empty"),
    ({"messages": [{"role": "bot", "content": "hi"}]}, "BadRequestError", "use system, user or assistant"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]}, "BadRequestError",
     "'assistant' is due"),
    ({"max_tokens": CONTEXT}, "BadRequestError", "this model's context is 1024 tokens, but the prompt has"),
    ({"temperature": -0.5}, "UnprocessableEntityError", "temperature"),
    ({"n": 100}, "UnprocessableEntityError", "n:"),
    ({"seed": 2 ** 70}, "UnprocessableEntityError", "seed:"),
    ({"messages": [{"role": "user", "content": 5}]}, "UnprocessableEntityError", "messages[0].content:"),
])
def test_bad_requests_get_openai_errors(client, kwargs, error, words):
    request = {"model": "sft", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 4, **kwargs}
    with pytest.raises(getattr(openai, error)) as caught:
        client.chat.completions.create(**request)
    assert words in caught.value.message and ".str" not in caught.value.message
    assert caught.value.body["type"] == "invalid_request_error"


def test_malformed_json_and_unknown_paths(server):
    url = server[0]
    response = httpx.post(url + "/v1/chat/completions", content=b"{not json", timeout=30,
                          headers={"Content-Type": "application/json"})
    message = response.json()["error"]["message"]
    assert response.status_code == 400 and "not valid JSON" in message and "at character 1" in message
    response = httpx.post(url + "/v1/chat/completions", content=b"[1, 2]", timeout=30,
                          headers={"Content-Type": "application/json"})
    assert response.status_code == 400 and "JSON object" in response.json()["error"]["message"]
    response = httpx.get(url + "/v1/nothing", timeout=30)
    assert response.status_code == 404 and response.json()["error"]["code"] == "not_found"
    response = httpx.get(url + "/v1/chat/completions", timeout=30)
    assert response.status_code == 405 and "use POST" in response.json()["error"]["message"]


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads resident memory from /proc (Linux)")
def test_32_concurrent_streams_complete_and_memory_returns(server, policy, tokenizer):
    """32 streaming requests at once, each with its own prompt: every stream is well formed and carries the
    answer that prompt gets alone (requests are batched with left padding), and the server's resident memory
    comes back to within 10% of what it was before."""
    url, proc, _ = server
    prompts = [f"{PROMPT}{i}号" for i in range(32)]
    expected = [decode(greedy(policy, chat_prompt_ids(p, tokenizer), 12)[0], tokenizer) for p in prompts]

    def run_all():
        results = [None] * len(prompts)

        def one(i):
            body = {"model": "sft", "messages": [{"role": "user", "content": prompts[i]}], "temperature": 0,
                    "max_tokens": 12, "stream": True}
            with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as response:
                results[i] = (response.status_code, response.read().decode())

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=180)
        return results

    run_all()  # warm up: the first batches allocate what later ones reuse
    before = rss_kib(proc.pid)
    for (status, body), want in zip(run_all(), expected):
        assert status == 200
        events = body.split("\n\n")
        assert events[-2:] == ["data: [DONE]", ""]
        chunks = [json.loads(e[6:]) for e in events[:-2]]
        assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == want
        assert sum(c["choices"][0]["finish_reason"] is not None for c in chunks) == 1
    after = rss_kib(proc.pid)
    assert after <= 1.1 * before, f"resident memory {before} KiB before, {after} KiB after"


@pytest.mark.slow
def test_a_client_that_leaves_frees_its_slot_and_a_slow_one_blocks_nobody(server, client):
    url, _, log_path = server
    body = {"model": "sft", "messages": [{"role": "user", "content": PROMPT}], "temperature": 0,
            "max_tokens": CONTEXT - 20, "stream": True}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        got = [next(lines) for _ in range(6)]  # a few chunks, then the client goes away
    assert all(line.startswith("data: ") or line == "" for line in got)
    deadline = time.time() + 60
    while time.time() < deadline:
        stopped = re.findall(r"stopped 1 row\(s\) whose client left, after (\d+) of (\d+) tokens",
                             log_path.read_text())
        if stopped:
            break
        time.sleep(0.1)
    assert stopped, "the generation thread did not stop the row of the client that left"
    assert int(stopped[-1][0]) < int(stopped[-1][1]) == CONTEXT - 20  # stopped early, not run to max_tokens

    # a client that sends a long streaming request and never reads its answer
    host, port = url.removeprefix("http://").split(":")
    slow = socket.create_connection((host, int(port)))
    payload = json.dumps({**body, "max_tokens": 400}).encode()
    slow.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload)
    try:
        reply = client.chat.completions.create(model="sft", messages=[{"role": "user", "content": "你好"}],
                                               max_tokens=4, temperature=0)
        assert reply.choices[0].finish_reason in ("stop", "length")
    finally:
        slow.close()


@pytest.mark.parametrize("message", [{"role": "user"}, {"role": "user", "content": None}])
def test_a_message_without_content_is_a_400(client, message):
    """{"role": "user"} is no message to answer; it used to be answered as the empty string."""
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="sft", messages=[message], max_tokens=4)
    assert "messages[0].content is missing" in caught.value.message


@pytest.fixture(scope="module")
def short_model():
    """A random 2-layer chat model with a 64-token context, for prompts that do not fit."""
    torch.manual_seed(1)
    return GPTModel(GPTConfig(context_length=64, emb_dim=32, n_heads=2, n_layers=2, drop_rate=0.0)).eval()


def test_a_prompt_that_does_not_fit_is_refused_not_cut(short_model, tokenizer):
    """A 72-token prompt on a 64-token model gets a 400 naming its token count, max_tokens and the context, before
    any generation, streamed or not (it used to be answered from its last 32 tokens); the completions endpoint too."""
    from fastapi.testclient import TestClient

    from serve import create_app

    long_prompt = "好" * 70  # [CLS] + 70 + [ANS] = 72 tokens
    assert len(chat_prompt_ids(long_prompt, tokenizer)) == 72
    with TestClient(create_app(short_model, tokenizer, True, "short")) as http:
        for stream in (False, True):
            response = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": long_prompt}],
                                                               "max_tokens": 8, "stream": stream})
            assert response.status_code == 400, response.text
            error = response.json()["error"]
            assert all(words in error["message"] for words in ("64 tokens", "has 72", "max_tokens 8"))
            assert error["code"] == "context_length_exceeded"
        response = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "好" * 50}],
                                                           "max_tokens": 20})
        assert response.status_code == 400 and "has 52" in response.json()["error"]["message"]
        response = http.post("/v1/completions", json={"prompt": "好" * 60, "max_tokens": 8})
        assert response.status_code == 400 and "has 60" in response.json()["error"]["message"]
        fits = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "好" * 50}],
                                                       "max_tokens": 12, "temperature": 0})
        assert fits.status_code == 200 and fits.json()["usage"]["prompt_tokens"] == 52


def test_truncate_history_drops_whole_oldest_turns_and_keeps_the_system_text(short_model, tokenizer):
    """With truncate_history the oldest (user, assistant) turns go, whole, until prompt + max_tokens fit; the system
    text and the last user turn stay; a last turn that alone does not fit is still refused."""
    from fastapi.testclient import TestClient

    from serve import create_app

    turns = [("system", "你是助手"), ("user", "一" * 12), ("assistant", "二" * 12), ("user", "三" * 12),
             ("assistant", "四" * 12), ("user", "五" * 6)]
    messages = [{"role": r, "content": c} for r, c in turns]
    assert len(chat_messages_ids(turns, tokenizer)) + 16 > 64  # the whole conversation does not fit
    kept = [turns[0]] + turns[3:]  # the system text, the newest exchange and the last question
    assert len(chat_messages_ids(kept, tokenizer)) + 16 <= 64
    with TestClient(create_app(short_model, tokenizer, True, "short")) as http:
        refused = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 16})
        assert refused.status_code == 400 and "truncate_history: true" in refused.json()["error"]["message"]
        reply = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 16, "temperature": 0,
                                                        "truncate_history": True})
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["prompt_tokens"] == len(chat_messages_ids(kept, tokenizer))
        alone = http.post("/v1/chat/completions", json={"messages": messages[:-1] + [
            {"role": "user", "content": "好" * 60}], "max_tokens": 8, "truncate_history": True})
        assert alone.status_code == 400 and "context_length_exceeded" == alone.json()["error"]["code"]


@pytest.mark.slow
def test_an_abandoned_request_stops_generating(server):
    """A non-streamed request whose client leaves after 0.2 s ends its row at the next token: the generation thread
    logs the row it stopped, long before max_tokens (it used to run every step for nobody)."""
    url, _, log_path = server
    body = {"model": "sft", "messages": [{"role": "user", "content": "走了"}], "temperature": 1.0, "top_k": 0,
            "max_tokens": 999}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(url + "/v1/chat/completions", json=body, timeout=0.2)
    deadline = time.time() + 60
    stopped = []
    while time.time() < deadline and not stopped:
        stopped = re.findall(r"stopped 1 row\(s\) whose client left, after (\d+) of 999 tokens", log_path.read_text())
        time.sleep(0.1)
    assert stopped, "the row of the client that left ran on: " + log_path.read_text()[-500:]
    assert int(stopped[-1]) < 999


def test_reward_ranks_the_choices(tiny_policy_and_rm, tokenizer):
    """With a reward model, the n choices come best first, each with the RM's score of its text (in-process); a
    choice cut off at max_tokens is scored without the [SEP] it never wrote."""
    from fastapi.testclient import TestClient

    from plumbing.reward import score_texts
    from serve import create_app

    policy_dir, rm_dir = tiny_policy_and_rm
    model, _, _ = load_checkpoint(str(policy_dir), "gpt")
    rm, _, _ = load_checkpoint(str(rm_dir), "reward")
    with TestClient(create_app(model, tokenizer, True, "sft", rm)) as http:
        reply = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": PROMPT}],
                                                         "n": 4, "max_tokens": 8, "seed": 3}).json()
    rewards = [c["reward"] for c in reply["choices"]]
    assert rewards == sorted(rewards, reverse=True) and [c["index"] for c in reply["choices"]] == [0, 1, 2, 3]
    texts = [c["message"]["content"] for c in reply["choices"]]
    ended = [c["finish_reason"] == "stop" for c in reply["choices"]]
    assert not all(ended)  # so that scoring every choice as finished would fail
    assert rewards == pytest.approx([float(s) for s in score_texts(rm, tokenizer, [PROMPT] * 4, texts, ended=ended)],
                                    abs=1e-3)


def test_a_plain_language_model_only_continues(tiny_pretrain_checkpoint, tokenizer):
    from fastapi.testclient import TestClient

    from serve import create_app

    model, _, _ = load_checkpoint(str(tiny_pretrain_checkpoint), "gpt")
    with TestClient(create_app(model, tokenizer, False, "pretrain")) as http:
        assert http.get("/v1/models").json()["data"][0]["chat"] is False
        response = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "你好"}]})
        assert response.status_code == 400 and "/v1/completions" in response.json()["error"]["message"]
        response = http.post("/v1/completions", json={"prompt": "床前", "max_tokens": 3, "temperature": 0})
        assert response.status_code == 200 and response.json()["choices"][0]["finish_reason"] in ("stop", "length")
        assert http.get("/").text.startswith("<!doctype html>")


@pytest.mark.slow
def test_bad_command_lines_fail_with_one_line(tmp_path, chat_checkpoint):
    from conftest import run_script

    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    try:
        result = run_script("serve.py", "--checkpoint", chat_checkpoint, "--port", busy.getsockname()[1])
    finally:
        busy.close()
    assert result.returncode == 2 and "cannot listen there" in result.stderr and "--port" in result.stderr
    result = run_script("serve.py", "--checkpoint", tmp_path / "missing", "--port", "0")
    assert result.returncode == 2 and "--checkpoint" in result.stderr
    result = run_script("serve.py", "--port", "70000")
    assert result.returncode == 2 and "--port 70000" in result.stderr


def chromium_path():
    return shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


@pytest.mark.slow
def test_the_chat_page_streams_an_answer_in_chromium(server, policy, tokenizer):
    """A headless Chromium types two messages on the page and sees each answer arrive in pieces; the second
    turn is sent with the whole conversation."""
    browser, driver_path = chromium_path(), shutil.which("chromedriver")
    if browser is None or driver_path is None:
        if os.environ.get("REQUIRE_BROWSER"):
            pytest.fail("REQUIRE_BROWSER is set but chromium/chromedriver are missing (Debian: apt-get install "
                        "chromium chromium-driver)")
        pytest.skip("no chromium/chromedriver on this machine (Debian: apt-get install chromium chromium-driver)")
    webdriver = pytest.importorskip("selenium.webdriver")
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"):
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=driver_path))
    try:
        driver.get(server[0] + "/")
        wait = WebDriverWait(driver, 60)
        wait.until(lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-ready") == "true")
        temperature = driver.find_element(By.ID, "temperature")
        temperature.clear()
        temperature.send_keys("0")
        max_tokens = driver.find_element(By.ID, "max_tokens")
        max_tokens.clear()
        max_tokens.send_keys("10")
        history = []
        for text in ("你好", PROMPT):
            driver.find_element(By.ID, "input").send_keys(text)
            driver.find_element(By.ID, "send").click()
            wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, ".assistant")) == len(history) // 2 + 1 and
                       d.find_elements(By.CSS_SELECTOR, ".assistant")[-1].get_attribute("data-done") == "true")
            answer = driver.find_elements(By.CSS_SELECTOR, ".assistant")[-1]
            history.append(("user", text))
            ids = chat_messages_ids(history, tokenizer)
            want = decode(greedy(policy, ids, 10)[0], tokenizer)
            assert answer.text.startswith(want) and int(answer.get_attribute("data-chunks")) > 1
            assert f"提示 {len(ids)} token" in answer.text  # the page sent the whole conversation
            history.append(("assistant", want))
    finally:
        driver.quit()
