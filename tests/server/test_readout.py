"""Readouts through the server: probe scores and SAE features per token, inline and
streamed, equal to HF activations read by the same probe and by SAELens's own
`SAE.encode`; bad readout input is a 400 naming the field."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.readout_refs import D_SAE, HIDDEN, ITEMS, check_against_hf, reader_bodies

from .helpers import ADMIN_KEY, PROMPT, metric_value, scrape

pytestmark = [pytest.mark.server, pytest.mark.uses_engine("server")]
ADMIN = {"X-Admin-Key": ADMIN_KEY}


@pytest.fixture(scope="module")
def readers(tmp_path_factory):
    """Readers uploaded once: a sigmoid probe and one SAE per architecture."""
    return reader_bodies(tmp_path_factory)


def _upload(http, bodies) -> None:
    for name, body in bodies.items():
        params = {"activation": "sigmoid"} if name == "probe" else {}
        r = http.put(f"/v1/readers/ro-{name}", content=body, headers=ADMIN, params=params)
        assert r.status_code == 201, r.text


def _chat(client, items, **kw):
    return client.chat.completions.create(
        model=client.models.list().data[0].id, messages=[{"role": "user", "content": PROMPT}],
        max_tokens=6, temperature=0, extra_body={"readout": items}, **kw)


def test_readout_equals_hf_and_streams_the_same(server, client, http, hf_models, readers):
    saes, bodies = readers
    _upload(http, bodies)
    rows_before = metric_value(scrape(server.url), "capsteer_readout_rows_total")
    done = _chat(client, ITEMS)
    results = done.model_extra["readout_results"]
    after = scrape(server.url)
    assert metric_value(after, "capsteer_readout_rows_total") - rows_before == \
        sum(len(r["positions"]) for r in results)
    assert metric_value(after, "capsteer_readers") == len(http.get("/v1/readers").json()["data"])
    assert [r["item"] for r in results] == list(range(len(ITEMS)))
    assert "prompt_token_ids" not in (done.model_extra or {})  # not asked for: not added
    prompt_len = check_against_hf(hf_models["qwen3"], saes, results)
    fed = len(results[0]["positions"])
    assert fed == prompt_len + done.usage.completion_tokens - 1
    assert results[2]["positions"] == list(range(prompt_len, fed))  # generated
    assert results[4]["positions"] == [0, 3, prompt_len - 1]  # explicit, -1 = prompt's last
    assert any(r["features"] and r["features"][0] for r in results[1:4])  # features fired
    hooks = {h["name"]: h for h in http.get("/v1/capsteer/hooks").json()["hooks"]}
    assert {"ro-probe", "ro-sae-topk"} <= set(hooks["resid_post"]["readers"])

    # Streaming: each chunk carries the scores of the steps that produced its tokens
    # (log-probs count a chunk's tokens: vLLM merges tokens into one chunk under load).
    stream = _chat(client, ITEMS, stream=True, logprobs=True)
    seen = {i: {"positions": [], "token_ids": [], "values": []} for i in range(len(ITEMS))}
    generated = 0
    for chunk in stream:
        extra = chunk.model_extra or {}
        if not chunk.choices:
            continue
        ids = (chunk.choices[0].model_extra or {}).get("token_ids")
        assert ids is None  # the client did not ask for token ids
        logprobs = chunk.choices[0].logprobs
        brought = len(logprobs.content or []) if logprobs else 0
        for entry in extra.get("readout", []):
            assert "error" not in entry, entry
            # Scores of positions fed so far: the prompt, then each token but the newest.
            fed_so_far = prompt_len + max(generated + brought - 1, 1)
            assert all(p < fed_so_far for p in entry["positions"]), \
                (entry["positions"], generated, brought)
            into = seen[entry["item"]]
            into["positions"] += entry["positions"]
            into["token_ids"] += entry["token_ids"]
            into["values"] += entry.get("scores", entry.get("features"))
        generated += brought
    for i, full in enumerate(results):
        got = seen[i]
        assert got["positions"] == full["positions"]
        assert got["token_ids"] == full["token_ids"]
        key = "scores" if "scores" in full else "features"
        assert _flat(got["values"]) == pytest.approx(_flat(full[key]), abs=1e-5)


def _flat(values) -> list[float]:
    if isinstance(values, (list, tuple)):
        return [v for part in values for v in _flat(part)]
    return [float(values)]


def test_readout_leaves_plain_requests_alone(server, client, http, readers):
    _upload(http, readers[1])
    model = client.models.list().data[0].id

    def plain():
        return client.completions.create(model=model, prompt=PROMPT, max_tokens=8,
                                         temperature=0, logprobs=1)

    alone = plain()
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(4) as pool:
        busy = [pool.submit(_chat, client, ITEMS) for _ in range(2)]
        beside = pool.submit(plain)
        for f in busy:
            assert "error" not in f.result().model_extra["readout_results"][0]
        beside = beside.result()
    assert beside.choices[0].text == alone.choices[0].text
    assert np.allclose(beside.choices[0].logprobs.token_logprobs,
                       alone.choices[0].logprobs.token_logprobs, atol=1e-5)


BAD = [
    ([{"reader": {"name": "absent"}, "layer": 0}], "readout[0].reader.name"),
    ([{"reader": {"name": "ro-sae-topk"}, "layer": 0, "top_k": 0}], "readout[0].top_k"),
    ([{"reader": {"name": "ro-sae-topk"}, "layer": 0, "top_k": D_SAE + 1}], "readout[0].top_k"),
    ([{"reader": {"name": "ro-probe"}, "layer": 0, "top_k": 3}], "readout[0].top_k"),
    ([{"reader": {"weight": [[0.5] * (HIDDEN + 1)]}, "layer": 0}], "readout[0].reader.weight"),
    ([{"reader": {"weight": [[float("nan")] * HIDDEN]}, "layer": 0}],
     "readout[0].reader.weight"),
    ([{"reader": {"name": "ro-probe"}, "layer": 99}], "readout[0].layer"),
    ([{"reader": {"name": "ro-probe"}, "layer": 0, "hook": "nope"}], "readout[0].hook"),
    ("probe", "readout"),
]


@pytest.mark.parametrize("items,param", BAD, ids=[p for _, p in BAD])
def test_bad_readout_is_a_400_naming_the_field(server, http, readers, items, param):
    _upload(http, readers[1])
    body = {"model": http.get("/v1/models").json()["data"][0]["id"], "max_tokens": 2,
            "messages": [{"role": "user", "content": "hi"}], "readout": items}
    r = http.post("/v1/chat/completions", content=json.dumps(body),  # NaN as JSON allows it
                  headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


def test_readout_with_capture_or_n_is_refused(server, http, readers):
    _upload(http, readers[1])
    base = {"model": http.get("/v1/models").json()["data"][0]["id"], "max_tokens": 2,
            "prompt": "hi", "readout": [{"reader": {"name": "ro-probe"}, "layer": 0}]}
    r = http.post("/v1/completions", json={**base, "capture": {"hooks": ["resid_post"]}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "readout", r.text
    r = http.post("/v1/completions", json={**base, "n": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text
