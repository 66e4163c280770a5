"""``kangaroo serve``: one Kangaroo engine behind an OpenAI-compatible HTTP API, with Prometheus metrics and a live
page (optional extra ``[serve]``: FastAPI + uvicorn + prometheus-client).

* :mod:`kangaroo_apps.serve.protocol` — the OpenAI wire format: validated requests, responses, errors.
* :mod:`kangaroo_apps.serve.worker` — the engine thread and its bounded queue; text segments tagged draft/target.
* :mod:`kangaroo_apps.serve.metrics` — the Prometheus metrics.
* :mod:`kangaroo_apps.serve.app` — the FastAPI app (routes, streaming, error bodies); ``page.html`` is the live page.
"""
