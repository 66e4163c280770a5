"""``kangaroo serve --max-batch N``: requests decode together, each answer exactly its single-stream answer.

The real server on the tiny model of :mod:`test_serve` (its fixtures and helpers are reused): concurrent requests
against the engine run alone, ``/metrics`` showing merged passes, a client that hangs up mid-stream beside others,
stop strings, the queue estimate, the fallback for engines that cannot batch, and the ``--max-batch`` flag.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from kangaroo_core.config import SamplingConfig
from kangaroo_apps.serve.app import create_app
from kangaroo_apps.serve.local import LocalServer
from kangaroo_apps.serve.metrics import ServerMetrics
from kangaroo_apps.serve.worker import EngineWorker

from test_serve import CHROMIUM, PROMPTS, launch_chromium, SlowPolicy, build_engine, engine, local, metric, server  # noqa: F401

CHAT = "/v1/chat/completions"
SIX = PROMPTS + ["the cat sat on the mat", "a dog runs in the park"]


@pytest.fixture(scope="module")
def batch_server(engine):
    with LocalServer(create_app(engine, queue_size=8, max_batch=3)) as running:
        running.model = running.server.config.app.state.model_id
        yield running


def chat(server, prompt: str, **options) -> dict:
    body = {"model": server.model, "messages": [{"role": "user", "content": prompt}], **options}
    response = httpx.post(server.url + CHAT, json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def streamed(server, prompt: str, **options) -> tuple[str, list[dict]]:
    """The text of a streamed chat and its chunks."""
    body = {"model": server.model, "messages": [{"role": "user", "content": prompt}], "stream": True, **options}
    chunks = []
    with httpx.stream("POST", server.url + CHAT, json=body, timeout=60) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    assert "error" not in chunks[-1], chunks[-1]
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]), chunks


def together(calls) -> list:
    """Run the calls on threads released at once; their results in order (an exception is re-raised)."""
    results, start = [None] * len(calls), threading.Barrier(len(calls))

    def run(i, call):
        start.wait()
        try:
            results[i] = call()
        except BaseException as exc:  # noqa: BLE001  (handed to the test)
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i, c)) for i, c in enumerate(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results


def test_six_concurrent_requests_answer_what_each_prompt_answers_alone(batch_server, engine):
    references = [local(engine, p, max_new_tokens=20) for p in SIX]  # before the server works: one engine user
    passes_before = metric(batch_server, "kangaroo_batch_size_count")
    calls = [(lambda p=p: chat(batch_server, p, max_tokens=20)) for p in SIX[:4]]
    calls += [(lambda p=p: streamed(batch_server, p, max_tokens=20)) for p in SIX[4:]]
    replies = together(calls)
    for reply, reference in zip(replies[:4], references):
        choice = reply["choices"][0]
        assert choice["message"]["content"] == reference.text
        assert choice["finish_reason"] == ("stop" if reference.stopped_on_eos else "length")
        assert reply["usage"]["completion_tokens"] == reference.new_tokens
        stats = reply["kangaroo"]
        assert stats["verify_passes"] == reference.num_rounds
        assert stats["mean_accepted_tokens"] == pytest.approx(reference.mean_accepted_tokens, abs=1e-3)
    for (text, chunks), reference in zip(replies[4:], references[4:]):
        assert text == reference.text
        assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == (
            "stop" if reference.stopped_on_eos else "length")
        segments = [s for c in chunks if c["choices"] for s in c.get("kangaroo", {}).get("segments", [])]
        assert "".join(s["text"] for s in segments) == text
    # /metrics: merged passes held several requests; nothing runs or waits any more
    count = metric(batch_server, "kangaroo_batch_size_count")
    assert count > passes_before
    assert metric(batch_server, "kangaroo_batch_size_bucket", '{le="1.0"}') < count  # observations > 1
    assert metric(batch_server, "kangaroo_batch_size_sum") > count  # mean streams per merged pass > 1
    assert metric(batch_server, "kangaroo_batch_passes_total") == count
    rows = metric(batch_server, "kangaroo_batch_stream_passes_total")
    assert rows == metric(batch_server, "kangaroo_batch_size_sum")
    assert metric(batch_server, "kangaroo_streams_per_pass") == pytest.approx(rows / count)
    assert metric(batch_server, "kangaroo_streams_per_pass") > 1.0
    assert metric(batch_server, "kangaroo_running_requests") == 0
    assert metric(batch_server, "kangaroo_queue_depth") == 0
    health = httpx.get(batch_server.url + "/health").json()
    assert health["status"] == "ok" and health["max_batch"] == 3 and health["queue_depth"] == 0


def same_answer(reply: dict) -> tuple:
    """What a request answers, less ids and timings."""
    stats = {k: v for k, v in reply["kangaroo"].items() if not k.endswith(("seconds", "per_second"))}
    return reply["choices"][0]["message"]["content"], reply["choices"][0]["finish_reason"], reply["usage"], stats


def test_a_stop_string_under_batching(batch_server, server, engine):
    reference = local(engine, PROMPTS[2], max_new_tokens=20).text
    words = reference.split()
    stop = " " + words[len(words) // 2]
    expected = reference[: reference.find(stop)]
    others = [local(engine, p, max_new_tokens=20) for p in (PROMPTS[0], PROMPTS[1])]
    plain, text_streamed, a, b = together([
        lambda: chat(batch_server, PROMPTS[2], max_tokens=20, stop=[stop]),
        lambda: streamed(batch_server, PROMPTS[2], max_tokens=20, stop=stop)[0],
        lambda: chat(batch_server, PROMPTS[0], max_tokens=20),
        lambda: chat(batch_server, PROMPTS[1], max_tokens=20),
    ])
    assert plain["choices"][0]["message"]["content"] == expected and plain["choices"][0]["finish_reason"] == "stop"
    assert text_streamed == expected
    assert [r["choices"][0]["message"]["content"] for r in (a, b)] == [o.text for o in others]
    # the unbatched server (--max-batch 1): the same answer, the same tokens decoded before the stop string ended it
    alone = chat(server, PROMPTS[2], max_tokens=20, stop=[stop])
    assert same_answer(plain) == same_answer(alone)
    assert plain["usage"]["completion_tokens"] < local(engine, PROMPTS[2], max_new_tokens=20).new_tokens


@pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="Debian's chromium is not installed")
def test_the_live_page_streams_beside_other_requests(batch_server, engine):
    from playwright.sync_api import sync_playwright

    prompt = PROMPTS[0]
    expected, other = local(engine, prompt, max_new_tokens=40).text, local(engine, PROMPTS[3], max_new_tokens=40).text
    with sync_playwright() as p:
        browser = launch_chromium(p)
        try:
            page = browser.new_page()
            page.goto(batch_server.url + "/")
            page.fill("#prompt", prompt)
            page.fill("#max", "40")
            box: list = []
            beside = threading.Thread(target=lambda: box.append(chat(batch_server, PROMPTS[3], max_tokens=40)))
            page.click("#go")
            beside.start()
            page.wait_for_function("document.getElementById('state').textContent.startsWith('done')", timeout=30000)
            beside.join(60)
            assert page.text_content("#answer") == expected and page.text_content("#error") == ""
            assert page.locator("#answer span.draft").count() > 0 and page.locator("#answer span.target").count() > 0
            assert box[0]["choices"][0]["message"]["content"] == other
        finally:
            browser.close()


# -- a client that hangs up mid-stream beside others (a slow engine: every draft decision sleeps) -----------------
@pytest.fixture
def slow_batch_server(tiny_model_dir):
    engine = build_engine(tiny_model_dir, policy=SlowPolicy(eta=0.0), max_new_tokens=100)
    with LocalServer(create_app(engine, queue_size=2, max_batch=3)) as running:
        running.model = running.server.config.app.state.model_id
        yield running


def _leave_after_first_token(server, box: list) -> None:
    body = {"model": server.model, "messages": [{"role": "user", "content": "tell me a story"}], "max_tokens": 100,
            "stream": True}
    with httpx.stream("POST", server.url + CHAT, json=body, timeout=60) as response:
        box.append(response.status_code)
        for line in response.iter_lines():
            if line.startswith("data: ") and json.loads(line[6:])["choices"][0]["delta"].get("content"):
                box.append(line)
                break  # hang up mid-generation: the connection closes here


def test_a_cancelled_stream_does_not_disturb_the_others(slow_batch_server, engine):
    server = slow_batch_server
    references = [local(engine, p, max_new_tokens=24) for p in PROMPTS[:2]]  # greedy: any policy, the same text
    replies: list = [None, None]

    def ask(i):
        replies[i] = chat(server, PROMPTS[i], max_tokens=24)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 20
    while metric(server, "kangaroo_running_requests") < 2:  # both decode before the third joins and leaves
        assert time.monotonic() < deadline
        time.sleep(0.02)
    box: list = []
    _leave_after_first_token(server, box)
    assert box[0] == 200 and len(box) == 2
    for t in threads:
        t.join(60)
    assert [r["choices"][0]["message"]["content"] for r in replies] == [r.text for r in references]
    assert [r["usage"]["completion_tokens"] for r in replies] == [r.new_tokens for r in references]
    deadline = time.monotonic() + 20
    while metric(server, "kangaroo_cancelled_total") < 1:
        assert time.monotonic() < deadline, "the generation went on after its client left"
        time.sleep(0.05)
    # the cancelled stream never finished: only the two answers count as generated tokens
    assert metric(server, "kangaroo_new_tokens_total") == sum(r.new_tokens for r in references)
    assert metric(server, "kangaroo_running_requests") == 0 and metric(server, "kangaroo_queue_depth") == 0
    assert metric(server, "kangaroo_batch_size_bucket", '{le="1.0"}') < metric(server, "kangaroo_batch_size_count")
    again = httpx.post(server.url + "/v1/completions", json={"model": server.model, "prompt": "hi", "max_tokens": 3},
                       timeout=30)
    assert again.status_code == 200


def test_the_queue_bound_counts_waiting_requests_only(slow_batch_server):
    """--max-batch 3, --queue-size 2: 3 decode and 2 wait; the sixth is answered 429 at once."""
    server, release, threads = slow_batch_server, threading.Event(), []

    def hold(box):
        body = {"model": server.model, "messages": [{"role": "user", "content": "tell me a story"}],
                "max_tokens": 100, "stream": True}
        with httpx.stream("POST", server.url + CHAT, json=body, timeout=60) as response:
            box.append(response.status_code)
            for _ in response.iter_lines():
                if release.is_set():
                    break  # hang up: cancels it, running or waiting

    for _ in range(5):
        box: list = []
        threads.append((threading.Thread(target=hold, args=(box,)), box))
        threads[-1][0].start()
    try:
        deadline = time.monotonic() + 20
        while metric(server, "kangaroo_queue_depth") < 5 or metric(server, "kangaroo_running_requests") < 3:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert httpx.get(server.url + "/health").json()["queue_depth"] == 5
        started = time.monotonic()
        refused = httpx.post(server.url + CHAT, timeout=30, json={
            "model": server.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
        assert refused.status_code == 429 and time.monotonic() - started < 2
        assert refused.json()["error"]["code"] == "queue_full" and int(refused.headers["retry-after"]) >= 1
    finally:
        release.set()
        for thread, box in threads:
            thread.join(60)
    assert all(box[0] == 200 for _, box in threads)
    deadline = time.monotonic() + 20
    while metric(server, "kangaroo_queue_depth") > 0:  # all five cancelled: running ones stopped, waiting ones skipped
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert metric(server, "kangaroo_cancelled_total") == 5


def test_seeded_sampling_per_request_under_batching(batch_server, engine):
    settings = [SamplingConfig(temperature=0.9, top_p=0.95, top_k=20, seed=s) for s in (7, 8)]
    references = [local(engine, PROMPTS[1], max_new_tokens=20, sampling=s).text for s in settings]
    greedy = local(engine, PROMPTS[0], max_new_tokens=20).text
    replies = together([
        lambda: chat(batch_server, PROMPTS[1], max_tokens=20, temperature=0.9, top_p=0.95, top_k=20, seed=7),
        lambda: chat(batch_server, PROMPTS[1], max_tokens=20, temperature=0.9, top_p=0.95, top_k=20, seed=8),
        lambda: chat(batch_server, PROMPTS[0], max_tokens=20),
    ])
    assert [r["choices"][0]["message"]["content"] for r in replies] == references + [greedy]


def test_stopping_the_server_fails_the_running_streams_with_503(tiny_model_dir):
    import asyncio

    from kangaroo_apps.serve.worker import Failed, Job

    engine = build_engine(tiny_model_dir, policy=SlowPolicy(eta=0.0), max_new_tokens=100)
    metrics, loop = ServerMetrics(gamma=engine.config.gamma), asyncio.new_event_loop()
    worker = EngineWorker(engine, metrics, queue_size=2, max_batch=2)
    worker.start()
    try:
        jobs = [Job(engine.encode(p), 100, SamplingConfig(), (), loop) for p in ("tell me a story", "hello world")]
        for job in jobs:
            worker.submit(job)
        deadline = time.monotonic() + 20
        while len(worker.active) < 2 or any(r.stats["new_tokens"] == 0 for r in list(worker.active.values())):
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert worker.depth() == 2
        worker.stop()
        assert not worker.alive and not worker.active
        loop.run_until_complete(asyncio.sleep(0.05))  # hand the events over
        for job in jobs:
            events = []
            while not job.events.empty():
                events.append(job.events.get_nowait())
            assert isinstance(events[-1], Failed) and events[-1].error.code == "shutdown"
        assert metrics.cancelled._value.get() == 2 and metrics.running._value.get() == 0
    finally:
        worker.stop()
        loop.close()


# -- pieces ------------------------------------------------------------------------------------------------------
def test_retry_after_divides_by_the_requests_decoding_at_once():
    metrics = ServerMetrics(gamma=2)
    metrics.observe_service(2.0)  # each request takes ~2 s, 3 of them at once
    assert [metrics.retry_after(depth, parallel=3) for depth in (3, 6, 9)] == ["2", "4", "6"]
    assert metrics.retry_after(6) == "12"  # one at a time: as before


def test_an_engine_that_cannot_batch_serves_one_at_a_time(caplog):
    def no_views():
        raise NotImplementedError("the 'fake' backend cannot decode several streams at once")

    engine = SimpleNamespace(backend=SimpleNamespace(stream_view=no_views), drafter=None)
    with caplog.at_level("WARNING", logger="kangaroo.serve"):
        worker = EngineWorker(engine, ServerMetrics(gamma=2), max_batch=4)
    assert worker.max_batch == 1 and "cannot decode several streams" in caplog.text
    with pytest.raises(ValueError):
        EngineWorker(engine, ServerMetrics(gamma=2), max_batch=0)


def test_the_serve_command_passes_max_batch(tiny_model_dir, monkeypatch):
    import uvicorn

    from kangaroo_apps.cli import main

    served = {}
    monkeypatch.setattr(uvicorn, "run", lambda app, **options: served.update(app=app, **options))
    assert main(["serve", "--model", str(tiny_model_dir), "--max-batch", "2", "--port", "1"]) == 0
    assert served["app"].state.worker.max_batch == 2 and served["port"] == 1
    assert main(["serve", "--model", str(tiny_model_dir), "--max-batch", "0"]) == 2
