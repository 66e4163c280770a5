"""Past one machine on Ray (extra ``[ray]``): the corpus and its features on a pool of Ray workers, the server on Ray
Serve replicas, on one local Ray instance started for this module, with the tiny random Llama. The faults of
docs/scaling.md are made here: a worker killed in the middle of a shard, a worker that cannot load the model, a
replica killed under load, a client that leaves mid-stream. Every test is bounded in time.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
import torch

ray = pytest.importorskip("ray", reason="the [ray] extra is not installed")

from kangaroo_apps.cli import main  # noqa: E402
from kangaroo_apps.cli_options import EngineOptions  # noqa: E402
from kangaroo_apps.ray_launch import engine_of  # noqa: E402
from kangaroo_apps.serve.local import LocalServer  # noqa: E402
from kangaroo_tools import corpus_ray  # noqa: E402
from kangaroo_tools.corpus import Corpus, CorpusError, CorpusSettings, build, read_shard  # noqa: E402

from conftest import write_prompts  # noqa: E402

# the functions below that run in Ray workers (faults, slow engines) travel by value: workers cannot import tests
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
pytestmark = [pytest.mark.usefixtures("one_torch_thread"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning:ray")]  # Ray Serve's own pydantic fields
#: no test here may run longer (a hang in Ray fails the test instead of stalling CI)
TEST_SECONDS = 150
SETTINGS = CorpusSettings(max_new_tokens=12, heldout_prompts=3, shard_size=4)
LOG = functools.partial(print, file=sys.stderr)


@pytest.fixture(autouse=True)
def bounded():
    """Every test is bounded in time: an alarm raises in the main thread, wherever it waits."""

    def expired(_signum, _frame):
        raise TimeoutError(f"the test ran longer than {TEST_SECONDS} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(TEST_SECONDS)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


@pytest.fixture(scope="module")
def ray_instance():
    """One local Ray instance for the whole module: 4 logical CPUs (2 workers or replicas, room for a restart), a
    small object store, no dashboard."""
    ray.init(num_cpus=4, include_dashboard=False, object_store_memory=128 * 1024 * 1024,
             logging_level=logging.WARNING)
    yield
    from ray import serve

    serve.shutdown()
    ray.shutdown()


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    return write_prompts(tmp_path_factory.mktemp("prompts") / "prompts.jsonl", 15)


def records(directory: Path) -> dict:
    corpus = Corpus(directory)
    return {name: read_shard(directory / name) for name in corpus.manifest()["shards"]}


@pytest.fixture(scope="module")
def reference_dir(tmp_path_factory, tiny_model_dir, prompts, one_torch_thread):
    """The undisturbed in-process build of the same prompts and settings."""
    directory = tmp_path_factory.mktemp("reference") / "corpus"
    engine = EngineOptions(model=str(tiny_model_dir), threads=1).engine(vanilla=True)
    build(Corpus(directory), engine, prompts, SETTINGS, progress=False, log=lambda m: None)
    return directory


@pytest.fixture(scope="module")
def reference(reference_dir):
    return records(reference_dir)


# -- a worker that dies in the middle of a shard --------------------------------------------------------------------
def dying_engine(options: EngineOptions, marker: str):
    """Runs in a Ray worker (pickled by value): the engine, with the first training shard any worker starts made
    slow and announced in ``marker`` (the worker's pid), so the test kills that process in the middle of it."""
    from kangaroo_tools import corpus as corpus_module

    real = corpus_module.batched_greedy_answers

    def announced(*args, **kwargs):
        try:
            fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return real(*args, **kwargs)
        os.write(fd, str(os.getpid()).encode())
        os.close(fd)
        time.sleep(30)  # killed long before this ends
        return real(*args, **kwargs)

    corpus_module.batched_greedy_answers = announced
    return engine_of(options, True)


def test_a_worker_killed_mid_shard_costs_only_that_shard(ray_instance, tiny_model_dir, prompts, reference, tmp_path,
                                                         monkeypatch):
    """Two workers; the first training shard's worker is SIGKILLed while answering it: the shard is redone, every
    shard is written once, and the corpus (after a second sitting that resumes it from the command line) equals the
    undisturbed in-process build."""
    marker = tmp_path / "started"
    directory = tmp_path / "corpus"
    saved = []
    real_save = corpus_ray.save_shard
    monkeypatch.setattr(corpus_ray, "save_shard", lambda corpus, manifest, job, *a: (saved.append(job.name),
                                                                                      real_save(corpus, manifest, job, *a)))
    killed = []

    def killer():
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not (marker.exists() and marker.read_text()):
            time.sleep(0.05)
        pid = int(marker.read_text())
        os.kill(pid, signal.SIGKILL)
        killed.append(pid)

    watcher = threading.Thread(target=killer, daemon=True)
    watcher.start()
    options = EngineOptions(model=str(tiny_model_dir), threads=1)
    summary = corpus_ray.build_on_ray(Corpus(directory), functools.partial(dying_engine, options, str(marker)), prompts,
                                      SETTINGS, workers=2, threads=1, max_train_shards=2, progress=False, log=LOG,
                                      num_cpus=1)
    watcher.join(timeout=5)
    assert killed, "the worker was not killed"
    assert summary["ray"]["shards_redone"] == 1
    assert sorted(saved) == sorted(set(saved)) == ["heldout-00000.safetensors", "train-00000.safetensors",
                                                   "train-00001.safetensors"]
    assert not list(directory.glob(".*.tmp"))
    stamp = (directory / "train-00000.safetensors").stat().st_mtime_ns

    # the second sitting: the command line, resuming the same corpus (only the missing shard is answered)
    code = main(["corpus", "build", "--out", str(directory), "--model", str(tiny_model_dir), "--prompts", str(prompts),
                 "--max-new-tokens", str(SETTINGS.max_new_tokens), "--heldout-prompts", str(SETTINGS.heldout_prompts),
                 "--shard-size", str(SETTINGS.shard_size), "--ray", "--workers", "2", "--no-progress"])
    assert code == 0
    assert (directory / "train-00000.safetensors").stat().st_mtime_ns == stamp
    assert records(directory) == reference
    entries = json.loads((directory / "corpus.json").read_text())["shards"]
    assert {e["worker"] for e in entries.values()} == {"ray"} and {e["threads"] for e in entries.values()} == {1}


def test_a_worker_that_cannot_load_the_model_stops_the_build_in_one_line(ray_instance, tmp_path, prompts):
    directory = tmp_path / "corpus"
    missing = EngineOptions(model=str(tmp_path / "no-such-model"))
    with pytest.raises(CorpusError) as caught:
        corpus_ray.build_on_ray(Corpus(directory), functools.partial(engine_of, missing, True), prompts, SETTINGS,
                                workers=2, threads=1, progress=False, log=LOG, num_cpus=1)
    message = str(caught.value)
    assert "\n" not in message and "could not load the model" in message and "no-such-model" in message, message
    assert "nothing was written" in message and not directory.exists()


def test_the_command_line_refuses_ray_flags_without_ray(tmp_path, prompts, capsys):
    assert main(["corpus", "build", "--out", str(tmp_path / "c"), "--prompts", str(prompts), "--workers", "2"]) == 2
    assert "--workers and --threads-per-worker apply to --ray" in capsys.readouterr().err
    assert main(["serve", "--replicas", "0-x"]) == 2
    assert "--replicas takes N" in capsys.readouterr().err
    assert main(["train-adapter", "--out", str(tmp_path / "a"), "--ray"]) == 2
    assert "--ray computes the features of a corpus (--corpus)" in capsys.readouterr().err


def test_without_the_extra_the_ray_flags_say_how_to_install_it(tmp_path, prompts):
    """Ray not importable: one line naming the extra, before any model loads."""
    script = ("import sys\n"
              "class Block:\n"
              "    def find_spec(self, name, path=None, target=None):\n"
              "        if name.split('.')[0] == 'ray':\n"
              "            raise ImportError(f'{name} is blocked', name=name)\n"
              "sys.meta_path.insert(0, Block())\n"
              "from kangaroo_apps.cli import main\n"
              f"sys.exit(main(['corpus', 'build', '--out', {str(tmp_path / 'c')!r}, '--prompts', {str(prompts)!r}, "
              "'--ray']))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert lines == ["kangaroo: error: --ray and --replicas need the [ray] extra (ray is missing): "
                     "pip install 'ray[serve]' (kangaroo's [ray] extra)"], done.stderr


def test_features_on_ray_equal_the_in_process_pass(ray_instance, tiny_model_dir, reference_dir, tmp_path, capsys):
    """`train-adapter --corpus DIR --ray`: the feature shards the workers compute are the in-process pass's, tensor
    for tensor; a rerun with every shard on disk starts no worker."""
    from safetensors.torch import load_file

    from kangaroo_tools.features import corpus_feature_shards

    work = tmp_path / "work"
    args = ["train-adapter", "--model", str(tiny_model_dir), "--corpus", str(reference_dir), "--work-dir", str(work),
            "--num-prompts", "8", "--epochs", "1", "--batch-size", "2", "--ray", "--workers", "2"]
    assert main([*args, "--out", str(tmp_path / "adapter")]) == 0, capsys.readouterr().err
    assert "Ray workers x 1 thread(s) compute the features" in capsys.readouterr().err
    model = EngineOptions(model=str(tiny_model_dir), threads=1).backend(vanilla=True).base_model()
    corpus = Corpus(reference_dir)
    here = [*corpus_feature_shards(corpus, model, tmp_path / "here", "heldout", layers=[2], top_k=32, progress=False),
            *corpus_feature_shards(corpus, model, tmp_path / "here", "train", layers=[2], top_k=32, max_prompts=8,
                                   progress=False)]
    there = sorted((work / "features").glob("*.safetensors"))
    assert [p.name for p in there] == sorted(p.name for p in here)
    for path in here:
        mine, theirs = load_file(path), load_file(work / "features" / path.name)
        assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine), path.name
    assert main([*args, "--out", str(tmp_path / "again")]) == 0
    assert "compute the features" not in capsys.readouterr().err  # nothing missing: no worker started


# -- the server on Ray Serve replicas -------------------------------------------------------------------------------
PROMPTS = ["tell me a story about the sea", "why is the sky blue", "write a poem about the cat", "hello world"]
SERVE_OPTIONS = dict(exit_layer=1, max_new_tokens=24, threads=1)


def slow_engine(options: EngineOptions, delay: float):
    """Runs in a replica (pickled by value): the engine, each round (or merged pass of a batch) ``delay`` seconds
    slower, so that requests are still decoding when a client leaves or a replica is killed (the tiny model answers
    in milliseconds)."""
    from kangaroo_core.batching import Batch
    from kangaroo_core.engine import Engine

    real, real_step = Engine.decode, Batch.step

    def step(self, *args, **kwargs):
        time.sleep(delay)
        return real_step(self, *args, **kwargs)

    def decode(self, prompt_ids, max_new_tokens):
        rounds = real(self, prompt_ids, max_new_tokens)
        try:
            while True:
                time.sleep(delay)
                yield next(rounds)
        except StopIteration as done:
            return done.value
        finally:
            rounds.close()

    Engine.decode, Batch.step = decode, step
    return engine_of(options, False)


@pytest.fixture(scope="module")
def served(ray_instance, tiny_model_dir):
    """Two replicas (1 thread each, 2 requests decoding together in each, passes slowed down to 20 ms) behind the
    OpenAI front, on loopback."""
    from kangaroo_apps.serve.dispatch import deploy_replicas, replica_app, shutdown_replicas

    options = EngineOptions(model=str(tiny_model_dir), **SERVE_OPTIONS)
    handle = deploy_replicas(functools.partial(slow_engine, options, 0.02), replicas=(2, 2), threads=1, queue_size=8,
                             max_batch=2, num_cpus=1)
    with LocalServer(replica_app(handle, replicas=2, queue_size=8, max_batch=2)) as server:
        server.model = server.server.config.app.state.model_id
        server.handle = handle
        yield server
    shutdown_replicas()


@pytest.fixture(scope="module")
def expected(tiny_model_dir):
    """What the engine answers in this process: every replica must answer the same."""
    engine = EngineOptions(model=str(tiny_model_dir), **SERVE_OPTIONS).engine()
    return {p: engine.generate(p, chat=True).text for p in PROMPTS}


def client_of(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def stream_text(client, model, prompt) -> str:
    pieces = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], stream=True) if c.choices]
    return "".join(pieces)


def test_replicas_answer_what_one_engine_answers_with_metrics_and_page(served, expected):
    client = client_of(served)
    with ThreadPoolExecutor(4) as pool:
        streamed = list(pool.map(lambda p: stream_text(client, served.model, p), PROMPTS * 2))
    assert streamed == [expected[p] for p in PROMPTS * 2]
    whole = client.chat.completions.create(model=served.model, messages=[{"role": "user", "content": PROMPTS[0]}])
    assert whole.choices[0].message.content == expected[PROMPTS[0]] and whole.usage.completion_tokens > 0
    health = httpx.get(served.url + "/health", timeout=10).json()
    assert health["status"] == "ok" and health["replicas"] == 2
    assert "kangaroo" in httpx.get(served.url + "/", timeout=10).text
    deadline = time.monotonic() + 10  # the last request's books close just after its answer
    while time.monotonic() < deadline:
        metrics = scrape(served)
        if metrics.get("kangaroo_running_requests") == 0:
            break
        time.sleep(0.1)
    assert metrics["kangaroo_verify_passes_total"] > 0 and metrics["kangaroo_new_tokens_total"] > 0
    assert metrics["kangaroo_queue_wait_seconds_count"] == 9 and metrics["kangaroo_running_requests"] == 0
    assert metrics['kangaroo_requests_total{endpoint="/v1/chat/completions",status="200"}'] == 9


def scrape(server) -> dict[str, float]:
    return {line.split(" ")[0]: float(line.split(" ")[1]) for line in
            httpx.get(server.url + "/metrics", timeout=10).text.splitlines() if line and line[0] != "#"}


def test_a_client_that_leaves_stops_its_generation_on_the_replica(served):
    """The front cancels the replica's stream; the replica's worker stops the job between two rounds (counted as
    cancelled: the count arrives with that replica's next answer)."""
    client = client_of(served)
    before = scrape(served)["kangaroo_cancelled_total"]
    body = {"model": served.model, "messages": [{"role": "user", "content": PROMPTS[0]}], "stream": True,
            "max_tokens": 90}
    with httpx.stream("POST", served.url + "/v1/chat/completions", json=body, timeout=30) as response:
        for number, _line in enumerate(response.iter_lines()):
            if number >= 4:
                break  # the client leaves after a few chunks, long before 90 tokens (~40 rounds of 20 ms)
    deadline = time.monotonic() + 20
    while scrape(served)["kangaroo_cancelled_total"] == before and time.monotonic() < deadline:
        stream_text(client, served.model, PROMPTS[1])  # each replica's next answer carries its books
    assert scrape(served)["kangaroo_cancelled_total"] == before + 1


def replica_pids(handle, want: int = 2, tries: int = 40) -> set[int]:
    pids = set()
    for _ in range(tries):
        pids.add(handle.pid.remote().result(timeout_s=30))
        if len(pids) == want:
            break
    return pids


def test_a_replica_killed_under_load_fails_only_its_requests(served, expected):
    """8 clients stream requests; one replica is SIGKILLed once answers flow. Every request either gets the engine's
    answer or a clear replica_failed error; new requests are answered afterwards; the server stays up."""
    client = client_of(served)
    pids = replica_pids(served.handle)
    assert len(pids) == 2
    victim = sorted(pids)[0]
    flowing = threading.Event()
    outcomes = []

    def one(prompt):
        try:
            text = stream_text(client, served.model, prompt)
            flowing.set()
            return ("ok", prompt, text)
        except openai.APIError as exc:
            return ("error", prompt, str(exc))

    def load(index):
        return [one(PROMPTS[(index + k) % len(PROMPTS)]) for k in range(4)]

    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(load, i) for i in range(8)]
        assert flowing.wait(30)
        os.kill(victim, signal.SIGKILL)
        for future in futures:
            outcomes.extend(future.result(timeout=90))
    assert len(outcomes) == 32
    for kind, prompt, text in outcomes:
        if kind == "ok":
            # a stream cut mid-answer ends with an error event, which the openai client raises, or is whole
            assert text == expected[prompt]
        else:
            assert "replica" in text and "failed" in text, text
    assert sum(kind == "ok" for kind, *_ in outcomes) >= 16
    after = [stream_text(client, served.model, p) for p in PROMPTS]
    assert after == [expected[p] for p in PROMPTS]
    assert httpx.get(served.url + "/health", timeout=10).json()["status"] == "ok"
    deadline = time.monotonic() + 10  # the dead replica's requests are closed by the front, not left running
    while scrape(served)["kangaroo_running_requests"] != 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert scrape(served)["kangaroo_running_requests"] == 0 and scrape(served)["kangaroo_queue_depth"] == 0
