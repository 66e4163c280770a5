"""``kangaroo serve`` defects a probe found, one test (or a few) per fix: lone surrogates, image content parts,
a Retry-After that reflects the queue, the live page after a failed run, and the latency / batch histograms.

The real server runs on the tiny model of :mod:`test_serve` (its fixtures are reused, not duplicated); the queue
estimate is checked on the engine worker with a tiny engine whose requests take a known time.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from pathlib import Path

import attrs
import httpx
import openai
import pytest

from kangaroo_core.config import SamplingConfig
from kangaroo_apps.serve.metrics import ServerMetrics
from kangaroo_apps.serve.protocol import ApiError
from kangaroo_apps.serve.worker import EngineWorker, Job

from kangaroo_policies.threshold import ThresholdPolicy
from test_serve import CHROMIUM, build_engine, client, launch_chromium, engine, metric, server  # noqa: F401  (module fixtures, reused)


@pytest.fixture
def error_log():
    """Records what the server logs at ERROR (a traceback of an unhandled exception lands here)."""
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record)

    handler = Keep(level=logging.ERROR)
    loggers = [logging.getLogger(name) for name in ("uvicorn.error", "kangaroo.serve", "")]
    for logger in loggers:
        logger.addHandler(handler)
    yield records
    for logger in loggers:
        logger.removeHandler(handler)


def post(server, route: str, body: dict) -> httpx.Response:
    """``body`` as JSON text as a client writes it: a lone surrogate becomes the escape ``\\ud800`` (valid JSON)."""
    return httpx.post(server.url + route, content=json.dumps(body).encode("ascii"),
                      headers={"content-type": "application/json"}, timeout=60)


# -- 1. lone surrogates: a 400 naming the field, not a 500 from the tokenizer ------------------------------------
LONE = "bad \ud800 text"
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


@pytest.mark.parametrize("route,fields,where", [
    (CHAT, {"messages": [{"role": "user", "content": LONE}]}, "messages.0.content"),
    (CHAT, {"messages": [{"role": "system", "content": "hi"}, {"role": "user", "content": [
        {"type": "text", "text": "hello"}, {"type": "text", "text": LONE}]}]}, "messages.1.content.1.text"),
    (CHAT, {"messages": [{"role": "user", "content": "hi"}], "stop": ["ok", LONE]}, "stop.1"),
    (CHAT, {"messages": [{"role": "user", "content": "hi"}], "stop": LONE}, "stop"),
    (COMPLETIONS, {"prompt": LONE}, "prompt"),
    (COMPLETIONS, {"prompt": [LONE]}, "prompt.0"),
    (COMPLETIONS, {"prompt": "hi", "stop": [LONE]}, "stop.0"),
])
def test_a_lone_surrogate_is_a_400_naming_the_field(server, error_log, route, fields, where):
    response = post(server, route, {"model": server.model, "max_tokens": 4, **fields})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["message"] == f"{where}: contains a lone surrogate (\\ud800); text must be valid Unicode"
    assert error["param"] == where and error["type"] == "invalid_request_error"
    assert not error_log, [r.getMessage() for r in error_log]  # no traceback: nothing but the access line


def test_a_lone_surrogate_anywhere_else_is_refused_too_and_pairs_are_fine(server, error_log):
    bad_model = post(server, CHAT, {"model": "m\udfff", "messages": [{"role": "user", "content": "hi"}]})
    assert bad_model.status_code == 400 and bad_model.json()["error"]["param"] == "model"
    assert "(\\udfff)" in bad_model.json()["error"]["message"]
    pair = post(server, CHAT, {"model": server.model, "max_tokens": 3,  # an emoji: a valid surrogate pair in JSON
                               "messages": [{"role": "user", "content": "hello \U0001F998 world"}]})
    assert pair.status_code == 200, pair.text
    assert not error_log, [r.getMessage() for r in error_log]
    assert 'status="500"' not in httpx.get(server.url + "/metrics").text


# -- 2. content parts: text parts work, image parts get one clear line ------------------------------------------
def test_text_content_parts_answer_like_a_plain_string(server, client):
    plain = client.chat.completions.create(model=server.model, max_tokens=8,
                                           messages=[{"role": "user", "content": "tell me a story"}])
    parts = client.chat.completions.create(model=server.model, max_tokens=8, messages=[{"role": "user", "content": [
        {"type": "text", "text": "tell me "}, {"type": "text", "text": "a story"}]}])
    assert parts.choices[0].message.content == plain.choices[0].message.content
    assert parts.usage.prompt_tokens == plain.usage.prompt_tokens


@pytest.mark.parametrize("part,text", [
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
     "messages.0.content.1: image parts are not supported (this server serves a text-only model); send text parts "
     "only"),
    ({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
     "messages.0.content.1: 'input_audio' parts are not supported (this server serves a text-only model); send text "
     "parts only"),
])
def test_an_image_part_is_refused_in_one_clear_line(server, client, part, text):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=server.model, max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "text", "text": "what is in this picture"}, part]}])
    assert info.value.body["message"] == text
    assert info.value.body["param"] == "messages.0.content.1"


def test_content_of_a_wrong_type_still_names_the_field(server):
    response = post(server, CHAT, {"model": server.model, "messages": [{"role": "user", "content": 5}]})
    assert response.status_code == 400
    assert response.json()["error"]["message"].startswith("messages.0.content: ")
    assert ".str" not in response.json()["error"]["message"]


# -- 3. Retry-After: queue length x the measured mean service time ----------------------------------------------
def test_retry_after_grows_with_the_queue():
    metrics = ServerMetrics(gamma=2)
    assert metrics.retry_after(5) == "1"  # nothing measured and nothing running: the floor
    metrics.observe_service(2.0)
    estimates = [int(metrics.retry_after(depth)) for depth in range(1, 7)]
    assert estimates == [2, 4, 6, 8, 10, 12]
    metrics.observe_service(0.1)  # a moving mean: recent requests weigh more, older ones still count
    assert 0.1 < metrics.mean_service_seconds < 2.0
    assert metrics.retry_after(1) == str(math.ceil(metrics.mean_service_seconds))
    assert metrics.retry_after(0) == "1"  # at least one second, whatever the estimate


@attrs.define
class GatedPolicy(ThresholdPolicy):
    """Each generation waits on ``gate`` (when it is cleared), then takes ``seconds`` before its first pass."""

    seconds: float = 0.0
    gate: threading.Event = attrs.field(factory=threading.Event)

    def __attrs_post_init__(self):
        self.gate.set()

    def prepare(self, engine, prompt_ids, max_new_tokens):
        self.gate.wait(30)
        time.sleep(self.seconds)


def gated_engine(model_dir, seconds: float):
    """A tiny engine whose requests take a known time; its policy's ``gate`` holds them."""
    engine = build_engine(model_dir, policy=GatedPolicy(seconds=seconds), max_new_tokens=4)
    return engine, engine.policy.gate


def job(loop) -> Job:
    return Job([1, 2], 4, SamplingConfig(), (), loop)


def fill(worker: EngineWorker, loop, waiting: int) -> None:
    """One request running (held by the engine policy's gate), ``waiting`` more queued behind it."""
    worker.submit(job(loop))
    deadline = time.monotonic() + 10
    while not worker.active or worker.queue.qsize():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    for _ in range(waiting):
        worker.submit(job(loop))


def refusal(worker: EngineWorker, loop) -> ApiError:
    with pytest.raises(ApiError) as info:
        worker.submit(job(loop))
    return info.value


def test_a_full_queue_answers_an_estimate_measured_by_the_worker(tiny_model_dir):
    """Requests of ~0.6 s: a refusal behind 2 requests says 2 s, behind 4 says 3 s (not 1 s for all)."""
    import asyncio

    answers = {}
    for queue_size in (1, 3):
        loop = asyncio.new_event_loop()  # never run: the jobs' events just pile up
        (engine, gate), metrics = gated_engine(tiny_model_dir, 0.6), ServerMetrics(gamma=2)
        worker = EngineWorker(engine, metrics, queue_size=queue_size)
        worker.start()
        try:
            worker.submit(job(loop))  # one request measured by the worker: ~0.6 s of service
            deadline = time.monotonic() + 10
            while metrics.mean_service_seconds is None:
                assert time.monotonic() < deadline
                time.sleep(0.02)
            mean = metrics.mean_service_seconds
            assert 0.55 <= mean < 2.0
            gate.clear()  # the next one blocks the engine: the queue fills behind it
            fill(worker, loop, queue_size)
            refused = refusal(worker, loop)
            assert refused.status == 429 and refused.code == "queue_full"
            assert refused.headers["Retry-After"] == str(math.ceil((queue_size + 1) * mean))
            answers[queue_size] = int(refused.headers["Retry-After"])
        finally:
            gate.set()
            worker.stop()
            loop.close()
    assert 1 < answers[1] < answers[3]


def test_before_any_request_finished_the_running_one_stands_in_for_the_mean(tiny_model_dir):
    import asyncio

    loop = asyncio.new_event_loop()
    (engine, gate), metrics = gated_engine(tiny_model_dir, 0.0), ServerMetrics(gamma=2)
    gate.clear()
    worker = EngineWorker(engine, metrics, queue_size=4)
    worker.start()
    try:
        fill(worker, loop, 4)
        time.sleep(1.2)  # the running request has taken 1.2 s so far: each waiting one is guessed at least as long
        assert metrics.mean_service_seconds is None
        assert int(refusal(worker, loop).headers["Retry-After"]) >= 5  # 4 waiting x 1.2 s
    finally:
        gate.set()
        worker.stop()
        loop.close()


# -- 5. histograms -----------------------------------------------------------------------------------------------
HISTOGRAMS = ("kangaroo_time_to_first_token_seconds", "kangaroo_queue_wait_seconds",
              "kangaroo_request_tokens_per_second", "kangaroo_batch_size")


def test_latency_and_batch_histograms(server, client):
    before = {name: metric(server, name + "_count") if name + "_count" in httpx.get(server.url + "/metrics").text
              else 0.0 for name in HISTOGRAMS}
    chunks = list(client.chat.completions.create(model=server.model, max_tokens=12, stream=True,
                                                 messages=[{"role": "user", "content": "why is the sky blue"}]))
    stats = chunks[-1].model_extra["kangaroo"]
    passes = stats["verify_passes"]
    text = httpx.get(server.url + "/metrics").text
    for name in HISTOGRAMS:
        assert f"# TYPE {name} histogram" in text
        assert f'{name}_bucket{{le="+Inf"}}' in text and f"{name}_sum" in text
    for name in HISTOGRAMS[:3]:  # once per request
        assert metric(server, name + "_count") == before[name] + 1
    # the batch size: once per pass of the model, always 1 request with --max-batch 1: the prefill's two passes, then
    # per round one M[:l] pass for x_n, two per draft (the drafter's step, then M[:l] over the draft), and the verify
    # pass of M[l:]
    observed = metric(server, "kangaroo_batch_size_count") - before["kangaroo_batch_size"]
    assert observed == 2 + 2 * passes + 2 * stats["drafted"]
    assert metric(server, "kangaroo_batch_size_bucket", '{le="1.0"}') == metric(server, "kangaroo_batch_size_count")
    assert metric(server, "kangaroo_time_to_first_token_seconds_sum") > 0
    for name in ("kangaroo_requests_total", "kangaroo_request_seconds_bucket", "kangaroo_compression_rate",
                 "kangaroo_queue_depth", "kangaroo_tokens_per_second"):  # the existing metrics stay
        assert name in text


def test_observe_batch_is_the_hook_for_a_batching_worker():
    metrics = ServerMetrics(gamma=2)
    for size in (1, 3, 8):
        metrics.observe_batch(size)
    text = metrics.exposition().decode()
    assert 'kangaroo_batch_size_bucket{le="2.0"} 1.0' in text and 'kangaroo_batch_size_bucket{le="8.0"} 3.0' in text
    assert "kangaroo_batch_size_sum 12.0" in text and "kangaroo_batch_size_count 3.0" in text


# -- 4. the live page after a failed run -------------------------------------------------------------------------
@pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="Debian's chromium is not installed")
def test_the_live_page_clears_its_stats_when_a_run_fails(server):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = launch_chromium(p)
        try:
            page = browser.new_page()
            page.goto(server.url + "/")
            page.fill("#prompt", "tell me a story about the sea")
            page.fill("#max", "16")
            page.click("#go")
            page.wait_for_function("document.getElementById('state').textContent.startsWith('done')", timeout=30000)
            assert int(page.text_content("#tokens")) > 0 and page.text_content("#cr") != "–"
            page.fill("#temp", "5")  # out of range: the server answers 400
            page.click("#go")
            page.wait_for_function("document.getElementById('state').textContent === 'error'", timeout=30000)
            assert "temperature" in page.text_content("#error")
            assert page.text_content("#answer") == ""
            assert [page.text_content(f"#{stat}") for stat in ("tps", "cr", "tokens", "drafted")] == ["–"] * 4
        finally:
            browser.close()
