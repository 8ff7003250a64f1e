"""The per-step planner and steering composition, without an engine."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from capsteer.capture.spec import CaptureSpec, parse_capture_spec
from capsteer.engine_ext.plan import (
    GENERATED,
    PROMPT,
    RequestHooks,
    build_step_plan,
    compose_entries,
)
from capsteer.engine_ext.runtime import STREAM, SUB, HookRuntime, StepPlan, hook_point
from capsteer.steering.spec import parse_steering_spec
from tests.unit.helpers import HIDDEN, LAYERS, hooks_for, runtime


def test_hook_points_share_sites():
    assert hook_point("resid_post", 0, LAYERS) == hook_point("resid_pre", 1, LAYERS) == (STREAM, 2)
    assert hook_point("attn_out", 1, LAYERS) == (SUB, 3)
    assert hook_point("mlp_out", LAYERS - 1, LAYERS) == (SUB, 2 * LAYERS)


def test_mlp_in_steers_and_copies_its_own_tensor_at_an_inner_site():
    """Host mode: a request steering and capturing mlp_in(1) uses site 2N+2 only; the op
    edits the tensor it is given there (the MLP's input), and the copy is the steered
    value."""
    rt = runtime()
    site = 2 * LAYERS + 2
    h = hooks_for("m", 2, rt=rt, capture={"hooks": ["mlp_in"], "layers": [1]},
                  steering={"vectors": [{"hook": "mlp_in", "layer": 1, "vector": [0.5] * HIDDEN}]})
    assert h.points == {(SUB, site): (("mlp_in", 1),)}
    assert {(k, s) for k, s, _ in h.entries} == {(SUB, site)} and h.sites == {site}
    plan = build_step_plan(["m"], np.array([0, 2]), np.array([0]), {"m": h}, None)
    rt.set_plan(plan, 2)
    normed = torch.randn(2, HIDDEN)
    want = normed + 0.5
    for s in range(rt.num_sites):
        if s != site:
            rt.tap(torch.zeros(2, HIDDEN), None, s, 3)
    rt.tap(normed, None, site, 1)
    torch.testing.assert_close(normed, want)
    torch.testing.assert_close(rt.take_captured()[(SUB, site)], want)


def test_plan_maps_rows_to_requests_and_positions():
    rt = runtime()
    a = hooks_for("a", 5, capture={"hooks": ["resid_post"], "layers": [0], "positions": "generated"},
                  rt=rt)
    b = hooks_for("b", 3, capture={"hooks": ["resid_pre"], "layers": [1], "positions": "all"}, rt=rt)
    ids = torch.arange(100, 112)
    # batch: plain request (2 rows), a decoding at position 5 (1 row), b prefilling 0..2
    plan = build_step_plan(["plain", "a", "b"], np.array([0, 2, 3, 6]),
                                   np.array([7, 5, 0]), {"a": a, "b": b}, ids)
    # resid_post(0) and resid_pre(1) are one copy: (STREAM, 2) holds a's row then b's rows
    assert list(plan.capture) == [(STREAM, 2)]
    assert plan.capture[(STREAM, 2)].tolist() == [2, 3, 4, 5]
    assert [(r.capture_id, r.offset, r.positions.tolist()) for r in plan.routes] == [
        ("cap-a", 0, [5]), ("cap-b", 1, [0, 1, 2])]
    # Only generated tokens are recorded: the prompt's are known.
    assert a.tokens == {5: 102} and b.tokens == {}
    assert a.fed_len == 6 and b.fed_len == 3
    # Without host token ids, the same generated rows are gathered on the device.
    plan = build_step_plan(["plain", "a", "b"], np.array([0, 2, 3, 6]),
                           np.array([7, 6, 0]), {"a": a, "b": b}, None)
    assert plan.token_rows.tolist() == [2]
    assert [(r, p.tolist()) for r, p in plan.token_owners] == [("a", [6])]


@pytest.mark.parametrize("positions", ["all", "prompt", "generated", "last_prompt", "last",
                                       [0, 3, 6, -1]])
def test_routes_keep_what_the_position_rule_keeps(positions):
    """Range kinds take slices of each request's run of positions, the others a mask;
    both route exactly the positions (and rows, and generated tokens) the rule keeps,
    for chunks before, across and after the prompt's end."""
    rt = runtime()
    prompt_len = 6
    rng = np.random.default_rng(1)
    for _ in range(40):
        hooks = {r: hooks_for(r, prompt_len, capture={"hooks": ["resid_post"], "layers": [0],
                                                     "positions": positions}, rt=rt)
                 for r in ("a", "b", "c")}
        starts = rng.integers(0, 10, 3)
        lens = rng.integers(1, 6, 3)
        qsl = np.concatenate([[0], np.cumsum(lens)])
        ids = torch.arange(1000, 1000 + int(qsl[-1]))
        plan = build_step_plan(list(hooks), qsl, starts, hooks, ids)
        got = {r.capture_id: (r.positions.tolist(), r.rows.tolist()) for r in plan.routes}
        for j, name in enumerate(hooks):
            pos = np.arange(starts[j], starts[j] + lens[j])
            keep = hooks[name].capture.positions.candidate(pos, prompt_len)
            want_rows = (qsl[j] + np.flatnonzero(keep)).tolist()
            if keep.any():
                assert got[f"cap-{name}"] == (pos[keep].tolist(), want_rows)
            else:
                assert f"cap-{name}" not in got
            gen = [(int(p), 1000 + int(r)) for p, r in zip(pos[keep], want_rows, strict=True)
                   if p >= prompt_len]
            assert hooks[name].tokens == dict(gen)


def test_steering_rows_follow_position_class():
    rt = runtime()
    s = hooks_for("s", 4, steering={"vectors": [
        {"hook": "resid_post", "layer": 0, "vector": [1.0] * HIDDEN, "positions": "generated"},
        {"hook": "attn_out", "layer": 2, "vector": [1.0] * HIDDEN}]}, rt=rt)
    plan = build_step_plan(["s"], np.array([0, 3]), np.array([2]), {"s": s}, None)
    rows, entries = plan.steer[(STREAM, 2)]
    assert rows.tolist() == [2]  # only position 4 is generated
    assert entries.tolist() == [s.entries[(STREAM, 2, GENERATED)]]
    assert plan.steer[(SUB, 5)][0].tolist() == [0, 1, 2]
    s.release(rt)
    assert rt.live_entries() == 0


def test_identical_steering_shares_entries():
    rt = runtime()
    steering = {"vectors": [{"hook": "resid_post", "layers": "all", "vector": [0.5] * HIDDEN}]}
    a = hooks_for("a", 4, steering=steering, rt=rt)
    b = hooks_for("b", 9, steering=steering, rt=rt)
    c = hooks_for("c", 4, rt=rt, steering={"vectors": [
        {"hook": "resid_post", "layers": "all", "vector": [0.25] * HIDDEN}]})
    assert a.entries == b.entries and set(a.entries.values()).isdisjoint(c.entries.values())
    used = rt.live_entries()
    # two specs x layers: a point steered alike at prompt and generated positions holds one
    # entry for both classes
    assert used == 2 * LAYERS == 1023 - len(rt.free_entries)
    assert all(a.entries[(k, s, PROMPT)] == a.entries[(k, s, GENERATED)] for k, s, _ in a.entries)
    a.release(rt)
    assert rt.live_entries() == used  # b still holds them
    b.release(rt)
    c.release(rt)
    assert rt.live_entries() == 0


def test_a_released_spec_keeps_its_entries_until_the_table_needs_room():
    """A spec whose last request left is not uploaded again when it comes back (batches
    of one spec); when the table is full, the longest-idle spec's entries are freed."""
    rt = HookRuntime(LAYERS, HIDDEN, torch.float32, torch.device("cpu"), max_tokens=16,
                     max_entries=1 + 2, device_driven=True)  # room for two specs (one entry each)

    def steer(value):
        return {"vectors": [{"hook": "resid_post", "layer": 0, "vector": [value] * HIDDEN}]}
    a = hooks_for("a", 3, rt=rt, steering=steer(0.5))
    kept = dict(a.entries)
    w_before = rt.w.clone()
    a.release(rt)
    uploads = []
    rt.alloc_entry = lambda *args, real=rt.alloc_entry: uploads.append(1) or real(*args)
    again = hooks_for("a2", 3, rt=rt, steering=steer(0.5))
    assert again.entries == kept and uploads == [] and torch.equal(rt.w, w_before)
    again.release(rt)
    b = hooks_for("b", 3, rt=rt, steering=steer(0.25))  # fits beside the idle spec
    assert set(b.entries.values()).isdisjoint(kept.values()) and len(uploads) == 1
    b_key = b.steering_key
    b.release(rt)
    c = hooks_for("c", 3, rt=rt, steering=steer(0.75))  # the table is full: `a` goes first
    assert set(c.entries.values()) == set(kept.values())
    assert list(rt.idle) == [b_key]
    d = hooks_for("d", 3, rt=rt, steering=steer(0.5))  # `a` again: rebuilt in b's entries
    assert rt.live_entries() == 2 and not rt.idle
    assert torch.allclose(rt.w[d.entries[(STREAM, 2, 0)]], torch.full((HIDDEN,), 0.5))
    with pytest.raises(RuntimeError, match="steering table full"):
        hooks_for("e", 3, rt=rt, steering=steer(0.125))


def test_compose_add_then_ablate_then_add():
    u = np.zeros(HIDDEN)
    u[0] = 2.0
    spec = parse_steering_spec({"vectors": [
        {"hook": "resid_mid", "layer": 1, "vector": [1.0] * HIDDEN, "scale": 2.0},
        {"hook": "resid_mid", "layer": 1, "vector": u.tolist(), "op": "ablate"},
        {"hook": "resid_mid", "layer": 1, "vector": [0.5] * HIDDEN},
    ]}, num_layers=LAYERS, hidden_size=HIDDEN)
    ((key, (uu, alpha, w, gate, _)), *rest) = compose_entries(spec, HIDDEN, LAYERS).items()
    assert gate is None
    x = torch.randn(HIDDEN)
    want = x + 2.0
    want = want - (want @ (torch.tensor(u) / 2).float()) * (torch.tensor(u) / 2).float()
    want = want + 0.5
    got = x + alpha * (x @ uu) * uu + w
    torch.testing.assert_close(got, want)
    assert key[:2] == (STREAM, 3) and len(rest) == 1 and rest[0][0][2] == GENERATED
    assert key[2] == PROMPT


@pytest.mark.parametrize("bad", [
    {"vectors": [{"hook": "post_mlp", "layer": 0, "vector": [0.0] * HIDDEN}]},
    {"vectors": [{"layer": 9, "vector": [0.0] * HIDDEN}]},
    {"vectors": [{"layer": 0, "vector": [0.0] * (HIDDEN + 1)}]},
    {"vectors": [{"layer": 0, "vector": [float("nan")] * HIDDEN}]},
    {"vectors": [{"layer": 0, "vector": [1.0] * HIDDEN, "op": "ablate"},
                 {"layer": 0, "vector": [1.0] * HIDDEN, "op": "clamp", "value": 1}]},
    {"vectors": [{"layer": 0, "vector": [0.0] * HIDDEN, "op": "ablate"}]},
    {"vectors": [{"layer": 0, "vector": [1.0] * HIDDEN, "scale": float("inf")}]},
    {"vectors": [{"layer": 0, "vector": {"name": "x"}}]},
    {"vectors": [{"layer": 0, "vector": {"b64": "!!"}}]},
    {"vectors": [{"layer": 0, "vector": [1.0] * HIDDEN, "colour": 1}]},
    # resid_post(0) and resid_pre(1) are one stream point: two projections there clash
    {"vectors": [{"hook": "resid_post", "layer": 0, "vector": [1.0] * HIDDEN, "op": "ablate"},
                 {"hook": "resid_pre", "layer": 1, "vector": [0.5] * HIDDEN, "op": "ablate"}]},
    {"vectors": [{"layer": 0, "vector": [1.0] * HIDDEN, "scale": 10**400}]},
    {"vectors": [{"layer": 0, "vector": [1e39] + [0.0] * (HIDDEN - 1)}]},
    {"vectors": [{"layer": 0, "vector": [10**400] + [0.0] * (HIDDEN - 1)}]},
    {"vectors": [{"layer": 0, "vector": {"b64": "AAAA", "dtype": ["float32"]}}]},
    {"vectors": [{"layer": 0, "vector": {"name": 7}}]},
])
def test_bad_steering_names_the_field(bad):
    from capsteer.steering.spec import SteeringSpecError

    with pytest.raises(SteeringSpecError) as err:
        parse_steering_spec(bad, num_layers=LAYERS, hidden_size=HIDDEN)
    assert err.value.field.startswith("steering.vectors")


def test_steering_roundtrip_and_salt():
    spec = parse_steering_spec({"vectors": [{"layers": "0:2", "vector": [0.25] * HIDDEN}]},
                               num_layers=LAYERS, hidden_size=HIDDEN)
    again = type(spec).from_dict(spec.to_dict())
    assert [op.layer for op in again.ops] == [0, 1]
    assert again.cache_salt() == spec.cache_salt()
    other = parse_steering_spec({"vectors": [{"layers": "0:2", "vector": [0.5] * HIDDEN}]},
                                num_layers=LAYERS, hidden_size=HIDDEN)
    assert other.cache_salt() != spec.cache_salt()


def test_position_limited_steering_never_shares_cache_blocks():
    prompt_only = parse_steering_spec(
        {"vectors": [{"layer": 0, "vector": [0.5] * HIDDEN, "positions": "prompt"}]},
        num_layers=LAYERS, hidden_size=HIDDEN)
    assert prompt_only.cache_salt() != prompt_only.cache_salt()
    assert prompt_only.sharing_key == prompt_only.sharing_key  # table entries still shared


def test_version_and_architecture_refused():
    from torch import nn

    from capsteer.engine_ext.vllm.refusals import check_architecture
    from capsteer.engine_ext.vllm.version import UnsupportedError, check_vllm_version

    check_vllm_version("0.32.0")
    check_vllm_version("0.26.0")
    with pytest.raises(UnsupportedError, match=r"supports vLLM 0\.26\.x and 0\.32\.x"):
        check_vllm_version("0.30.1")

    class GPTJForCausalLM(nn.Module):
        pass

    with pytest.raises(UnsupportedError, match="cannot hook architecture GPTJForCausalLM"):
        check_architecture(GPTJForCausalLM())


def test_the_launching_process_refuses_from_vllms_resolved_config():
    """The verdict before any engine starts, from the HF config's architecture and vLLM's
    registry markers, in the workers' words."""
    from types import SimpleNamespace

    from capsteer.engine_ext.vllm.refusals import config_architecture_problem

    def config(arch: str | None, **markers: bool) -> SimpleNamespace:
        info = SimpleNamespace(**{"supports_multimodal": False, "is_hybrid": False,
                                  "is_pooling_model": False, **markers})
        return SimpleNamespace(hf_config=SimpleNamespace(architectures=[arch] if arch else None),
                               _model_info=info)

    assert config_architecture_problem(config("LlamaForCausalLM")) is None
    assert config_architecture_problem(config(None)) is None  # cannot tell: the workers check
    assert config_architecture_problem(SimpleNamespace()) is None
    assert "GPTJForCausalLM: no hook layout" in config_architecture_problem(config("GPTJForCausalLM"))
    # without a row but run by vLLM's Transformers backend: the stream-only layout
    backend = config("PhiForCausalLM")
    backend._model_info.architecture = "TransformersForCausalLM"
    assert config_architecture_problem(backend) is None
    assert "no hook layout" in config_architecture_problem(config("PhiForCausalLM"))
    assert "LlamaForCausalLM: hybrid state-space model" in config_architecture_problem(
        config("LlamaForCausalLM", is_hybrid=True))  # a marker refuses a known name too
    assert "LlamaForCausalLM: multimodal model" in config_architecture_problem(
        config("LlamaForCausalLM", supports_multimodal=True))
    assert "LlamaForCausalLM: pooling model" in config_architecture_problem(
        config("LlamaForCausalLM", is_pooling_model=True))
    # the name's own reason comes first, as in the workers
    assert "BertModel: encoder model" in config_architecture_problem(
        config("BertModel", is_pooling_model=True))


def test_the_launching_process_refuses_engine_features_from_the_config():
    """Speculative decoding, dual-batch overlap, context parallelism, an extraction's
    shards under PP and a materialized family under PP: the workers' refusals, before
    the engine starts."""
    from types import SimpleNamespace

    from capsteer.engine_ext.vllm.refusals import engine_config_problem

    def config(arch: str = "LlamaForCausalLM", section: dict | None = None,
               speculative: object = None, moe: bool = False,
               **parallel: object) -> SimpleNamespace:
        info = SimpleNamespace(supports_multimodal=False, is_hybrid=False,
                               is_pooling_model=False, architecture=arch)
        model = SimpleNamespace(hf_config=SimpleNamespace(architectures=[arch]),
                                _model_info=info, is_moe=moe)
        par = SimpleNamespace(**{"pipeline_parallel_size": 1, "enable_dbo": False, **parallel})
        return SimpleNamespace(model_config=model, parallel_config=par,
                               speculative_config=speculative,
                               additional_config={"capsteer": section or {}})

    assert engine_config_problem(config()) is None
    assert engine_config_problem(config(pipeline_parallel_size=2)) is None  # llama: fine
    assert "speculative decoding" in engine_config_problem(config(speculative=object()))
    assert "dual-batch overlap" in engine_config_problem(config(enable_dbo=True))
    assert "decode_context_parallel_size > 1" in engine_config_problem(
        config(decode_context_parallel_size=2))
    assert "extraction job's shards" in engine_config_problem(
        config(section={"sharded": True}, pipeline_parallel_size=2))
    assert engine_config_problem(config(section={"sharded": True})) is None
    assert "granite family under pipeline parallelism" in engine_config_problem(
        config("GraniteForCausalLM", pipeline_parallel_size=2))
    assert engine_config_problem(config("GraniteForCausalLM")) is None
    assert "no hook layout" in engine_config_problem(config("GPTJForCausalLM"))
    # data parallelism: served, a dense model passes (its engines reach the workers as
    # DP=1 engines) and a mixture-of-experts model is refused, as its workers would
    served = {"frontend": "server"}
    assert engine_config_problem(config(section=served, data_parallel_size=2)) is None
    assert "--data-parallel-size with a mixture-of-experts model" in engine_config_problem(
        config("Qwen3MoeForCausalLM", section=served, moe=True, data_parallel_size=2))
    assert engine_config_problem(config("Qwen3MoeForCausalLM", section=served, moe=True)) is None
    assert "in the in-process engine" in engine_config_problem(config(data_parallel_size=2))
    assert "--data-parallel-backend ray" in engine_config_problem(
        config(section=served, data_parallel_size=2, data_parallel_backend="ray"))
    # the workers' order: a feature before the architecture
    assert "speculative decoding" in engine_config_problem(
        config("GPTJForCausalLM", speculative=object()))
    # vLLM's Transformers backend materializes every family, as in the workers
    backend = config(pipeline_parallel_size=2)
    backend.model_config._model_info.architecture = "TransformersForCausalLM"
    assert "llama family under pipeline parallelism" in engine_config_problem(backend)
    backend.model_config.using_transformers_backend = lambda: False  # vLLM's own answer wins
    assert engine_config_problem(backend) is None
    # a generative class run as a pooling model: the workers see the converted model
    pooled = config()
    pooled.model_config.runner_type = "pooling"
    assert "LlamaForCausalLM: pooling model" in engine_config_problem(pooled)


def test_vllms_config_step_refuses_only_capsteers_engines(tmp_path):
    """vLLM's own EngineArgs on demo models: capsteer's worker class is refused an
    unhookable model at create_engine_config, before an engine starts; another worker
    class (stock vLLM) is untouched, and a hookable model passes."""
    from vllm.engine.arg_utils import EngineArgs

    from capsteer.demo_model import write_demo_model
    from capsteer.engine_ext.payload import WORKER_CLS
    from capsteer.engine_ext.vllm import refusals

    before = EngineArgs.create_engine_config  # an earlier test may have installed it
    original = getattr(before, "__wrapped__", before)
    accepted: list[str] = []
    try:
        refusals.refuse_at_vllm_config_step(WORKER_CLS)
        # twice: one wrapper; the server's hint waits for a config that passes
        refusals.refuse_at_vllm_config_step(WORKER_CLS, on_accept=lambda: accepted.append("hint"))
        assert EngineArgs.create_engine_config.__wrapped__ is original
        llama = str(write_demo_model(tmp_path / "llama", "llama", seed=1))
        jamba = str(write_demo_model(tmp_path / "jamba", "jamba", seed=1))
        with pytest.raises(refusals.UnsupportedError,
                           match="cannot hook architecture JambaForCausalLM: hybrid"):
            EngineArgs(model=jamba, worker_cls=WORKER_CLS, max_model_len=256).create_engine_config()
        stock = EngineArgs(model=jamba, max_model_len=256).create_engine_config()
        assert stock.model_config.architecture == "JambaForCausalLM"
        # served data parallelism: vLLM's own is_moe decides (a dense model passes below)
        moe = str(write_demo_model(tmp_path / "moe", "qwen3_moe", seed=1))
        with pytest.raises(refusals.UnsupportedError, match="with a mixture-of-experts model"):
            EngineArgs(model=moe, worker_cls=WORKER_CLS, max_model_len=256, data_parallel_size=2,
                       additional_config={"capsteer": {"frontend": "server"}}
                       ).create_engine_config()
        assert accepted == []  # neither the refusal nor another worker class's engine
        for _ in range(2):
            kept = EngineArgs(model=llama, worker_cls=WORKER_CLS, max_model_len=256,
                              additional_config={"capsteer": "not a section"}
                              ).create_engine_config()
            assert kept.model_config.architecture == "LlamaForCausalLM"
        dense = EngineArgs(model=llama, worker_cls=WORKER_CLS, max_model_len=256,
                           data_parallel_size=2,
                           additional_config={"capsteer": {"frontend": "server"}}
                           ).create_engine_config()
        assert dense.parallel_config.data_parallel_size == 2
        assert accepted == ["hint"]  # once
    finally:
        EngineArgs.create_engine_config = before
        refusals._ON_ACCEPT.clear()


def test_device_mode_equals_host_mode():
    """The graph-safe dense path steers and captures exactly what the host path does."""
    torch.manual_seed(0)
    modes = {}
    for dense in (False, True):
        rt = HookRuntime(LAYERS, HIDDEN, torch.float32, torch.device("cpu"), max_tokens=16,
                         max_requests=4, staging_rows=64, device_driven=dense)
        reqs = {
            "a": hooks_for("a", 3, rt=rt, capture={"hooks": ["resid_mid", "attn_out"],
                                                   "positions": "generated"},
                           steering={"vectors": [{"hook": "attn_out", "layer": 1,
                                                  "vector": [0.3] * HIDDEN, "scale": 2.0}]}),
            "b": hooks_for("b", 2, rt=rt, steering={"vectors": [
                {"hook": "resid_mid", "layer": 1, "vector": [1.0] + [0.0] * (HIDDEN - 1),
                 "op": "clamp", "value": 4.0}]}),
            "c": hooks_for("c", 4, rt=rt, capture={"hooks": ["resid_pre"], "layers": [1]}),
        }
        plan = build_step_plan(["a", "plain", "b", "c"], np.array([0, 3, 5, 9, 12]),
                               np.array([2, 0, 0, 1]), reqs, None)
        rt.set_plan(plan, 13)
        gen = torch.Generator().manual_seed(1)
        x = torch.randn(13, HIDDEN, generator=gen)
        res = torch.randn(13, HIDDEN, generator=gen)
        out = {}
        for site in range(2 * LAYERS + 1):
            rt.tap(x, res, site)
        if dense:
            staged = rt.staging[: plan.staging_rows]
            out = {(*r.point, r.capture_id): staged[plan.staging_offset[r.point] + r.offset:
                                                     plan.staging_offset[r.point] + r.offset
                                                     + len(r.positions)] for r in plan.routes}
        else:
            got = rt.take_captured()
            out = {(*r.point, r.capture_id): got[r.point][r.offset: r.offset + len(r.positions)]
                   for r in plan.routes}
        modes[dense] = (x.clone(), out)
    torch.testing.assert_close(modes[True][0], modes[False][0])
    assert sorted(modes[True][1]) == sorted(modes[False][1]) and modes[True][1]
    for key, value in modes[False][1].items():
        torch.testing.assert_close(modes[True][1][key], value)


def test_payload_may_arrive_as_json_text():
    import json

    extra = {"capsteer": json.dumps({
        "capture": parse_capture_spec({"hooks": ["mlp_out"]}, num_layers=LAYERS).to_dict(),
        "capture_id": "cap-x"})}
    hooks = RequestHooks.from_extra_args("x", extra, 3, runtime())
    assert hooks.capture_id == "cap-x" and set(hooks.points) == {(SUB, 2), (SUB, 4), (SUB, 6)}


def test_memory_sink_reports_a_failed_capture():
    from capsteer.capture.sink import CaptureRequest, MemorySink

    sink = MemorySink()
    spec = parse_capture_spec({"hooks": ["resid_post"]}, num_layers=LAYERS)
    sink.open(CaptureRequest("cap-f", "r", "m", spec, (1, 2, 3), torch.float32, HIDDEN, LAYERS))
    sink.write("cap-f", "resid_post", 0, np.array([0]), torch.zeros(1, HIDDEN))
    sink.abort("cap-f", "staging too small")
    taken = sink.take(["cap-f"])["cap-f"]
    assert taken.error == "staging too small" and not taken.tensors


def test_wire_form_encodes_each_vector_once_and_workers_skip_known_specs():
    spec = parse_steering_spec({"vectors": [
        {"layers": "all", "vector": [0.25] * HIDDEN},
        {"hook": "attn_out", "layer": 1, "vector": [0.5] * HIDDEN, "scale": 3.0}]},
        num_layers=LAYERS, hidden_size=HIDDEN)
    wire = spec.to_dict()
    assert len(wire["vectors_b64"]) == 2 and len(wire["ops"]) == LAYERS + 1
    again = type(spec).from_dict(wire)
    for a, b in zip(again.ops, spec.ops, strict=True):
        assert (a.hook, a.layer, a.scale) == (b.hook, b.layer, b.scale)
        np.testing.assert_array_equal(a.vector, b.vector)
    assert again.sharing_key == spec.sharing_key == wire["key"]
    entries = 2 * (LAYERS + 1)
    rt = HookRuntime(LAYERS, HIDDEN, torch.float32, torch.device("cpu"), max_tokens=64,
                     max_entries=1 + entries // 2)  # room for this spec alone (classes share)
    first = RequestHooks.from_extra_args("a", {"capsteer": {"steering": wire}}, 4, rt)
    # Same key, unreadable table: a live spec is found by its key, never decoded again.
    broken = {**wire, "vectors_b64": ["!"]}
    second = RequestHooks.from_extra_args("b", {"capsteer": {"steering": broken}}, 4, rt)
    assert second.entries == first.entries and len(first.entries) == entries
    kept = dict(first.entries)
    first.release(rt)
    second.release(rt)
    third = RequestHooks.from_extra_args("c", {"capsteer": {"steering": broken}}, 4, rt)
    assert third.entries == kept  # released but kept (idle): found by its key
    third.release(rt)
    other = parse_steering_spec({"vectors": [{"layers": "all", "vector": [0.5] * HIDDEN}]},
                                num_layers=LAYERS, hidden_size=HIDDEN).to_dict()
    RequestHooks.from_extra_args("d", {"capsteer": {"steering": other}}, 4, rt).release(rt)
    with pytest.raises((ValueError, IndexError)):  # its entries were needed: decoded again
        RequestHooks.from_extra_args("e", {"capsteer": {"steering": broken}}, 4, rt)


def test_steering_travels_as_json_text_with_its_key():
    """build_payload sends the spec as JSON text with its key beside it (vLLM deep-copies
    each request's SamplingParams; a str is not copied): it is cheap to copy, decodes to
    the same entries as the mapping form, and a worker that knows the key never parses it."""
    import copy

    from capsteer.engine_ext.payload import build_payload

    spec = parse_steering_spec({"vectors": [{"layers": "all", "vector": [0.25] * HIDDEN,
                                             "scale": 2.0}]},
                               num_layers=LAYERS, hidden_size=HIDDEN)
    payload = build_payload(None, spec).extra_args
    wire = payload["capsteer"]["steering"]
    assert isinstance(wire, str) and payload["capsteer"]["steering_key"] == spec.sharing_key
    assert type(spec).from_wire(wire).sharing_key == spec.sharing_key
    assert copy.deepcopy(payload)["capsteer"]["steering"] is wire  # copied by reference
    rt = HookRuntime(LAYERS, HIDDEN, torch.float32, torch.device("cpu"), max_tokens=64)
    text = RequestHooks.from_extra_args("a", payload, 4, rt)
    mapping_rt = HookRuntime(LAYERS, HIDDEN, torch.float32, torch.device("cpu"), max_tokens=64)
    mapped = RequestHooks.from_extra_args("b", {"capsteer": {"steering": spec.to_dict()}}, 4,
                                          mapping_rt)
    assert text.entries.keys() == mapped.entries.keys() and text.steering_key == spec.sharing_key
    for k, e in text.entries.items():
        torch.testing.assert_close(rt.w[e], mapping_rt.w[mapped.entries[k]])
    # Known key, unreadable text: found by the key, not parsed.
    again = RequestHooks.from_extra_args(
        "c", {"capsteer": {"steering": "not json", "steering_key": spec.sharing_key}}, 4, rt)
    assert again.entries == text.entries
    # Text without a key (an old front end): parsed, same entries.
    keyless = RequestHooks.from_extra_args("d", {"capsteer": {"steering": wire}}, 4, rt)
    assert keyless.entries == text.entries


def test_device_mode_clears_copy_routes_after_a_captured_step():
    rt = HookRuntime(LAYERS, HIDDEN, torch.float32, torch.device("cpu"), max_tokens=16,
                     max_requests=4, staging_rows=64, device_driven=True)
    reqs = {"a": hooks_for("a", 3, rt=rt, capture={"hooks": ["resid_pre"], "layers": [1]},
                           steering={"vectors": [{"layer": 0, "vector": [0.3] * HIDDEN}]})}
    plan = build_step_plan(["a"], np.array([0, 3]), np.array([0]), reqs, None,
                           host_steering=False)
    rt.set_plan(plan, 3)
    slot = reqs["a"].slot
    assert rt.tok_slot[:3].tolist() == [slot] * 3 and rt.tok_rank[:3].tolist() == [0, 1, 2]
    assert int((rt.point_base >= 0).sum()) == 1
    rt.reset_dense()
    reqs["a"].capture = None  # e.g. its capture was shed: steering only from now on
    reqs["a"].points = {}
    plan = build_step_plan(["a"], np.array([0, 1]), np.array([3]), reqs, None,
                           host_steering=False)
    rt.set_plan(plan, 1)
    assert rt.tok_slot[:1].tolist() == [slot] and rt.tok_gen[:1].tolist() == [1]
    assert rt.tok_rank[:1].tolist() == [-1] and int((rt.point_base >= 0).sum()) == 0


def test_device_rows_are_expanded_from_per_request_arrays():
    """Device mode finds each row's slot and position class on the device from a few
    numbers per request: on random batches (requests with and without hooks, prompt
    chunks, decode rows, a chunk crossing into generation, padding rows) they equal the
    per-row answer, and a steering-only step uploads one block of 3 x requests + 2."""
    rng = np.random.default_rng(7)
    rt = HookRuntime(LAYERS, HIDDEN, torch.float32, torch.device("cpu"), max_tokens=256,
                     max_requests=64, staging_rows=64, device_driven=True)
    uploads = []
    upload = rt._upload_into
    rt._upload_into = lambda dst, host: uploads.append(len(host)) or upload(dst, host)
    steer = {"vectors": [{"hook": "resid_post", "layer": 1, "vector": [0.5] * HIDDEN}]}
    other = {"vectors": [{"hook": "resid_mid", "layer": 0, "vector": [0.2] * HIDDEN}]}
    for trial in range(30):
        n_req = int(rng.integers(1, 12))
        ids, reqs, lens, starts = [], {}, [], []
        for r in range(n_req):
            rid = f"t{trial}-{r}"
            prompt = int(rng.integers(1, 20))
            fed = int(rng.integers(0, prompt + 5))
            k = 1 if fed >= prompt else int(rng.integers(1, prompt - fed + 3))  # may cross
            ids.append(rid)
            lens.append(k)
            starts.append(fed)
            if rng.random() < 0.7:
                reqs[rid] = hooks_for(rid, prompt, rt=rt,
                                      steering=steer if rng.random() < 0.5 else other)
        qsl = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
        n = int(qsl[-1]) + int(rng.integers(0, 9))  # padded rows after the batch's tokens
        plan = build_step_plan(ids, qsl, np.array(starts, np.int32), reqs, None,
                               host_steering=False)
        uploads.clear()
        rt.set_plan(plan, n)
        want_slot, want_gen = np.zeros(n, np.int64), np.zeros(n, np.int64)
        for b, rid in enumerate(ids):
            if rid in reqs:
                rows = np.arange(qsl[b], qsl[b + 1])
                want_slot[rows] = reqs[rid].slot
                want_gen[rows] = (starts[b] + rows - qsl[b]) >= reqs[rid].prompt_len
        got_slot = rt.tok_slot[:n].numpy()
        assert np.array_equal(got_slot, want_slot)
        hooked = want_slot != 0  # a row without hooks may have either class
        assert np.array_equal(rt.tok_gen[:n].numpy()[hooked], want_gen[hooked])
        assert set(rt.tok_gen[:n].tolist()) <= {0, 1}  # always a valid table index
        assert rt.tok_rank[:n].tolist() == [-1] * n
        if reqs.keys() & set(ids):
            assert uploads[-1] == 3 * n_req + 2  # no per-row upload for steering
            assert plan.all_generated == all(
                starts[b] >= reqs[rid].prompt_len for b, rid in enumerate(ids) if rid in reqs)
        for h in reqs.values():
            h.release(rt)


def test_device_ranks_of_a_copying_step_never_outlive_it():
    """A copying step whose forward failed (no reset after it) leaves no ranks behind:
    the next steering-only step clears them, so no stale copy could be routed."""
    rt = HookRuntime(LAYERS, HIDDEN, torch.float32, torch.device("cpu"), max_tokens=16,
                     max_requests=4, staging_rows=64, device_driven=True)
    reqs = {"a": hooks_for("a", 3, rt=rt, capture={"hooks": ["resid_pre"], "layers": [1]}),
            "b": hooks_for("b", 3, rt=rt, steering={"vectors": [
                {"layer": 0, "vector": [0.3] * HIDDEN}]})}
    plan = build_step_plan(["a", "b"], np.array([0, 3, 6]), np.array([0, 0]), reqs, None,
                           host_steering=False)
    rt.set_plan(plan, 6)
    assert rt.tok_rank[:6].tolist() == [0, 1, 2, -1, -1, -1]
    plan = build_step_plan(["b"], np.array([0, 1]), np.array([3]), reqs, None,
                           host_steering=False)  # no reset_dense in between
    rt.set_plan(plan, 6)
    assert rt.tok_rank[:6].tolist() == [-1] * 6
    assert rt.tok_slot[:6].tolist() == [reqs["b"].slot] + [0] * 5


def test_device_mode_copy_table_follows_the_batch_as_it_changes():
    """point_base is updated by the entries that change only: after every step it equals
    the table built from scratch for that step's routes (-1 everywhere else), as
    captures join, overlap and leave."""
    rt = HookRuntime(LAYERS, HIDDEN, torch.float32, torch.device("cpu"), max_tokens=16,
                     max_requests=4, staging_rows=64, device_driven=True)
    reqs = {r: hooks_for(r, 8, rt=rt, capture={"hooks": hooks, "layers": layers})
            for r, hooks, layers in (("a", ["resid_pre"], [1]), ("b", ["resid_post"], [0, 2]),
                                     ("c", ["mlp_out"], [2]))}

    def expected(plan) -> torch.Tensor:
        base = torch.full(tuple(rt.point_base.shape), -1, dtype=torch.int64)
        for route in plan.routes:
            kind, site = route.point
            base[route.slot, kind, site] = plan.staging_offset[route.point] + route.offset
        return base

    steps = [(["a"], [0, 3], [0]), (["a", "b"], [0, 2, 5], [3, 0]), (["b", "c"], [0, 3, 5], [3, 0]),
             (["c"], [0, 3], [2]), (["a", "c"], [0, 1, 2], [5, 5])]
    seen = 0
    for ids, qsl, starts in steps:
        plan = build_step_plan(ids, np.array(qsl), np.array(starts), reqs, None,
                               host_steering=False)
        rt.set_plan(plan, qsl[-1])
        assert torch.equal(rt.point_base, expected(plan)), ids
        seen += len(plan.routes)
        rt.reset_dense()
    assert seen > 5
    plan = build_step_plan(["d"], np.array([0, 2]), np.array([0]), reqs, None, host_steering=False)
    rt.set_plan(plan, 2)  # a step with no routes clears what the last one set
    assert int((rt.point_base >= 0).sum()) == 0 and len(rt.point_base_set) == 0


def test_device_mode_skips_only_sites_no_request_uses():
    """Outside graph capture the dense tap returns at once at sites no hooked request of
    the step uses (eager prefill pays no launch there) and still acts at the others."""
    rt = HookRuntime(LAYERS, HIDDEN, torch.float32, torch.device("cpu"), max_tokens=16,
                     max_requests=4, staging_rows=64, device_driven=True)
    a = hooks_for("a", 2, rt=rt, steering={"vectors": [
        {"hook": "resid_post", "layer": 0, "vector": [1.0] * HIDDEN, "scale": 1.0}]})
    c = hooks_for("c", 2, rt=rt, capture={"hooks": ["mlp_out"], "layers": [2]})
    assert a.sites == {2} and c.sites == {2 * LAYERS}
    plan = build_step_plan(["a", "c"], np.array([0, 2, 4]), np.array([2, 0]), {"a": a, "c": c},
                           None)
    assert plan.active_sites == {2, 2 * LAYERS}
    assert build_step_plan(["plain"], np.array([0, 3]), np.array([0]), {"a": a}, None
                           ).active_sites == frozenset()
    # Requests using the same sites share one set object (the plan collects the batch's
    # sets every step; comparing equal copies element by element cost ~0.5 us a request).
    b = hooks_for("b", 2, rt=rt, steering={"vectors": [
        {"hook": "resid_post", "layer": 0, "vector": [2.0] * HIDDEN, "scale": 1.0}]})
    assert b.sites is a.sites
    reqs = {"a": a, "b": b, "c": c}
    assert build_step_plan(["b", "a", "c"], np.array([0, 1, 2, 3]), np.array([2, 2, 0]), reqs,
                           None).active_sites == {2, 2 * LAYERS}
    rt.set_plan(plan, 4)
    calls = []
    rt._tap_dense = lambda x, r, site, kinds: calls.append(site)  # record, don't compute
    for site in range(2 * LAYERS + 1):
        rt.tap(torch.zeros(4, HIDDEN), torch.zeros(4, HIDDEN), site)
    assert calls == [2, 2 * LAYERS]
    rt.reset_dense()  # no plan: no site is used
    calls.clear()
    for site in range(2 * LAYERS + 1):
        rt.tap(torch.zeros(4, HIDDEN), torch.zeros(4, HIDDEN), site)
    assert calls == []


def test_device_slot_rows_hold_entries_only_for_steered_requests():
    """A steered request's slot row holds its entries from the next step on and is cleared
    when it leaves; a capture-only request gets a slot whose row is already the identity
    (all zeros), with no write on arrival and none when it leaves, even when it takes a
    slot a steered request left."""
    rt = HookRuntime(LAYERS, HIDDEN, torch.float32, torch.device("cpu"), max_tokens=16,
                     max_requests=1, staging_rows=64, device_driven=True)
    steer = {"vectors": [{"hook": "resid_post", "layer": 0, "vector": [0.5] * HIDDEN}]}
    s = hooks_for("s", 3, rt=rt, steering=steer)
    assert s.slot == 1 and rt.steered_slots == {1}
    rt.set_plan(StepPlan(), 4)  # the step's plan writes the rows of new requests first
    assert int(rt.slot_entry[1].count_nonzero()) == 2  # prompt and generated, one site
    s.release(rt)
    assert rt.steered_slots == set()
    rt.set_plan(StepPlan(), 0)
    assert int(rt.slot_entry.count_nonzero()) == 0
    writes = []
    original = rt.slot_entry
    rt.slot_entry = type("Watch", (), {  # any write to a row would show up here
        "__getitem__": lambda self, i: writes.append(i) or original[i],
        "index_copy_": lambda self, *a: writes.append(a)})()
    c = hooks_for("c", 3, rt=rt, capture={"hooks": ["resid_post"], "layers": [0]})
    assert c.slot == 1 and rt.steered_slots == set()
    rt.flush_slot_writes()
    c.release(rt)
    rt.flush_slot_writes()
    assert writes == [] and rt.free_slots == [1]


def test_device_slot_rows_of_a_step_are_written_by_one_upload():
    """Requests arriving and leaving in one step cost one upload and one kernel, and a
    slot left and taken again before the step holds only its new request's entries."""
    rt = HookRuntime(LAYERS, HIDDEN, torch.float32, torch.device("cpu"), max_tokens=16,
                     max_requests=4, staging_rows=64, device_driven=True)
    uploads = []
    upload = rt._upload_into
    rt._upload_into = lambda dst, host: uploads.append(len(host)) or upload(dst, host)

    def steer(layer):
        return {"vectors": [{"hook": "resid_post", "layer": layer, "vector": [0.5] * HIDDEN}]}
    a, b = hooks_for("a", 3, rt=rt, steering=steer(0)), hooks_for("b", 3, rt=rt, steering=steer(1))
    rt.set_plan(StepPlan(), 4)
    assert len(uploads) == 1  # the slot rows (a plan with no hooked rows uploads no index)
    for h, site in ((a, 2), (b, 4)):
        row = rt.slot_entry[h.slot]
        assert set(row.nonzero()[:, -1].tolist()) == {site}  # only its own site is steered
    b_slot = b.slot
    b.release(rt)
    c = hooks_for("c", 3, rt=rt, steering=steer(2))  # takes b's slot back in the same step
    d = hooks_for("d", 3, rt=rt, capture={"hooks": ["resid_post"], "layers": [0]})
    assert c.slot == b_slot
    uploads.clear()
    rt.set_plan(StepPlan(), 0)
    assert len(uploads) == 1
    assert set(rt.slot_entry[c.slot].nonzero()[:, -1].tolist()) == {6}
    assert int(rt.slot_entry[d.slot].count_nonzero()) == 0
    assert set(rt.slot_entry[a.slot].nonzero()[:, -1].tolist()) == {2}
    for h in (a, c, d):
        h.release(rt)
    rt.set_plan(StepPlan(), 0)
    assert int(rt.slot_entry.count_nonzero()) == 0


def test_device_requests_with_one_steering_spec_share_one_slot_row():
    """Steering-only requests with the same spec share one row: written once when the spec
    arrives and cleared when its last request leaves, nothing in between. A request that
    also captures gets a row of its own (its copies are routed by its row) with the same
    entries, and a different spec gets another row."""
    rt = HookRuntime(LAYERS, HIDDEN, torch.float32, torch.device("cpu"), max_tokens=16,
                     max_requests=4, staging_rows=64, device_driven=True)
    spec = {"vectors": [{"hook": "resid_post", "layer": 0, "vector": [0.5] * HIDDEN}]}
    first = [hooks_for(f"s{i}", 3, rt=rt, steering=spec) for i in range(3)]
    assert {h.slot for h in first} == {first[0].slot} and len(rt.slot_writes) == 1
    rt.set_plan(StepPlan(), 0)
    shared_row = rt.slot_entry[first[0].slot].clone()
    assert int(shared_row.count_nonzero()) == 2
    cap = hooks_for("cap", 3, rt=rt, steering=spec,
                    capture={"hooks": ["resid_post"], "layers": [1]})
    other = hooks_for("o", 3, rt=rt, steering={"vectors": [
        {"hook": "resid_post", "layer": 1, "vector": [0.5] * HIDDEN}]})
    assert len({first[0].slot, cap.slot, other.slot}) == 3
    rt.set_plan(StepPlan(), 0)
    assert torch.equal(rt.slot_entry[cap.slot], shared_row)
    late = hooks_for("late", 3, rt=rt, steering=spec)  # a later request of the same spec
    assert late.slot == first[0].slot and rt.slot_writes == {}
    row = first[0].slot
    for h in first:
        h.release(rt)
    assert rt.slot_writes == {} and row not in rt.free_slots  # `late` still holds it
    rt.set_plan(StepPlan(), 0)
    assert torch.equal(rt.slot_entry[row], shared_row)
    late.release(rt)
    assert row in rt.free_slots
    for h in (cap, other):
        h.release(rt)
    rt.set_plan(StepPlan(), 0)
    assert int(rt.slot_entry.count_nonzero()) == 0 and rt.key_slots == {}
    assert sorted(rt.free_slots) == [1, 2, 3, 4]


def test_capture_spec_travels_as_json_text():
    """The capture spec rides in extra_args as its canonical JSON text (cheap for vLLM's
    per-request deep copy); the worker reads it as it reads the mapping form."""
    from capsteer.engine_ext.payload import build_payload

    spec = parse_capture_spec({"hooks": ["resid_post", "mlp_out"], "layers": [0, 2],
                               "positions": "prompt"}, num_layers=LAYERS)
    fields = build_payload(spec, None, durable=True).extra_args["capsteer"]
    assert isinstance(fields["capture"], str)
    text = RequestHooks.from_extra_args("a", {"capsteer": fields}, 4, runtime())
    mapped = RequestHooks.from_extra_args(
        "b", {"capsteer": {**fields, "capture": spec.to_dict()}}, 4, runtime())
    assert text.capture == mapped.capture == spec
    assert text.points == mapped.points and text.sites == mapped.sites and text.points
    again = RequestHooks.from_extra_args("c", {"capsteer": fields}, 4, runtime())
    assert again.capture is text.capture  # one parse per distinct text, shared (frozen)
    other = parse_capture_spec({"hooks": ["resid_post"], "layers": [1], "positions": "prompt"},
                               num_layers=LAYERS)
    assert CaptureSpec.from_wire(other.to_json()) == other != spec


def test_only_captures_of_generated_positions_wait_for_an_end_report():
    """`Engine.generate` reports output lengths (a blocking RPC per finishing step) only
    for durable captures whose kept positions can lie past the prompt; the worker closes
    the others once their prompt is fed."""
    from capsteer.engine_ext.payload import build_payload, needs_end_report

    def spec(positions):
        return parse_capture_spec({"hooks": ["resid_post"], "layers": [0],
                                   "positions": positions}, num_layers=LAYERS)

    assert not needs_end_report(spec("prompt"), 10)
    assert not needs_end_report(spec("last_prompt"), None)
    for kind in ("all", "generated", "last"):
        assert needs_end_report(spec(kind), 10)
    assert not needs_end_report(spec([0, 9, -1]), 10)
    assert needs_end_report(spec([0, 10]), 10)
    assert needs_end_report(spec([0]), None)  # prompt length unknown: ask for the report
    fields = build_payload(spec("prompt"), None, durable=True, await_end=False).extra_args
    hooks = RequestHooks.from_extra_args("a", fields, 10, runtime())
    assert hooks.durable and not hooks.await_end and not hooks.needs_output_length
    assert build_payload(spec("all"), None, durable=True).extra_args["capsteer"]["await_end"]


def test_device_batch_steered_by_one_shared_row_needs_no_per_row_index():
    """When every request of a step steers through one shared row that is the same at
    prompt and generated positions, the plan is that slot alone: the index is filled once
    (no upload, no expansion while such steps follow), and x is steered exactly as host
    mode steers it. A request without hooks, or a spec limited to prompt positions, brings
    the per-row index back, and rows without hooks stay untouched."""
    torch.manual_seed(0)
    everywhere = {"vectors": [{"hook": "resid_post", "layers": "all", "vector": [0.5] * HIDDEN},
                              {"hook": "attn_out", "layer": 1, "vector": [0.1] * HIDDEN,
                               "op": "ablate"}]}
    prompt_only = {"vectors": [{"hook": "resid_post", "layer": 0, "positions": "prompt",
                                "vector": [0.5] * HIDDEN}]}
    batch = (["a", "b", "c"], np.array([0, 4, 5, 7]), np.array([0, 6, 3]))  # b decodes
    modes = {}
    for dense in (False, True):
        rt = HookRuntime(LAYERS, HIDDEN, torch.float32, torch.device("cpu"), max_tokens=16,
                         max_requests=4, staging_rows=64, device_driven=dense)
        reqs = {r: hooks_for(r, 5, rt=rt, steering=everywhere) for r in "abc"}
        uploads = []
        upload = rt._upload_into
        rt._upload_into = (lambda dst, host, up=upload, log=uploads:
                           log.append(len(host)) or up(dst, host))
        outs = []
        steps = [batch, batch, (["a", "plain", "c"], *batch[1:]), batch]
        for step, (ids, qsl, starts) in enumerate(steps):
            plan = build_step_plan(ids, qsl, starts, reqs, None, host_steering=not dense,
                                   uniform_slots=rt.uniform_slots if dense else ())
            uploads.clear()
            rt.set_plan(plan, 9)  # two padding rows
            if dense:
                assert bool(plan.uniform_slot) == ("plain" not in ids)
                assert (plan.batch_hooks is None) == ("plain" not in ids)
                if step == 1:
                    assert uploads == []  # the index of step 0 still holds
                if plan.uniform_slot:
                    assert rt.tok_slot.tolist() == [reqs["a"].slot] * 16
                else:
                    assert rt.tok_slot[4:5].tolist() == [0]  # the plain request's row
            gen = torch.Generator().manual_seed(step)
            x = torch.randn(9, HIDDEN, generator=gen)
            res = torch.randn(9, HIDDEN, generator=gen)
            for site in range(2 * LAYERS + 1):
                rt.tap(x, res, site)
            outs.append(x[:7].clone())  # padding rows are dropped by the engine
        modes[dense] = outs
        if dense:
            limited = hooks_for("d", 5, rt=rt, steering=prompt_only)
            assert limited.shared_slot and limited.slot not in rt.uniform_slots
            plan = build_step_plan(["d"], np.array([0, 3]), np.array([0]), {"d": limited},
                                   None, host_steering=False, uniform_slots=rt.uniform_slots)
            assert not plan.uniform_slot and plan.batch_hooks is not None
            slot = reqs["a"].slot
            for h in reqs.values():
                h.release(rt)
            assert slot not in rt.uniform_slots
    for got, want in zip(modes[True], modes[False], strict=True):
        torch.testing.assert_close(got, want)


def test_captured_rows_are_laid_out_writer_by_writer():
    """Captures going to different writer processes (`RequestHooks.group`) get their rows
    of a step laid out group by group, batch order within a group, so each writer's rows
    are one span of the staging buffer; every route still holds its own request's rows
    (device mode equals host mode)."""
    modes = {}
    ids = ["c0", "c1", "plain", "c2", "c3"]
    qsl, starts = np.array([0, 4, 8, 9, 13, 17]), np.array([0, 0, 0, 2, 0])
    for dense in (False, True):
        rt = HookRuntime(LAYERS, HIDDEN, torch.float32, torch.device("cpu"), max_tokens=32,
                         max_requests=8, staging_rows=64, device_driven=dense)
        reqs = {r: hooks_for(r, 5, rt=rt, capture={"hooks": ["resid_post", "attn_out"],
                                                  "layers": [1]}) for r in ids if r != "plain"}
        for i, h in enumerate(reqs.values()):
            h.group = i % 2
        plan = build_step_plan(ids, qsl, starts, reqs, None, host_steering=not dense)
        for point in {r.point for r in plan.routes}:
            routes = [r for r in plan.routes if r.point == point]
            assert [r.capture_id for r in routes] == ["cap-c0", "cap-c2", "cap-c1", "cap-c3"]
            assert [r.offset for r in routes] == [0, 4, 8, 12]
        rt.set_plan(plan, 17)
        gen = torch.Generator().manual_seed(3)
        x, res = torch.randn(17, HIDDEN, generator=gen), torch.randn(17, HIDDEN, generator=gen)
        for site in range(2 * LAYERS + 1):
            rt.tap(x, res, site)
        if dense:
            modes[dense] = {(*r.point, r.capture_id): rt.staging[
                plan.staging_offset[r.point] + r.offset:][: len(r.positions)].clone()
                for r in plan.routes}
        else:
            got = rt.take_captured()
            modes[dense] = {(*r.point, r.capture_id): got[r.point][r.offset:][: len(r.positions)]
                            for r in plan.routes}
    assert sorted(modes[True]) == sorted(modes[False]) and len(modes[True]) == 8
    for key, value in modes[False].items():
        torch.testing.assert_close(modes[True][key], value)


def test_a_uniform_plan_is_reused_while_the_batch_stays_the_same():
    """Steady decode of a uniformly steered batch reuses its plan (the filled index holds):
    the reuse key is the batch's requests and rows; a plan that copies rows never is."""
    from types import SimpleNamespace

    from capsteer.engine_ext.vllm.batch import BatchLayout
    from capsteer.engine_ext.worker import EngineHooks

    rt = HookRuntime(LAYERS, HIDDEN, torch.float32, torch.device("cpu"), max_tokens=16,
                     max_requests=4, staging_rows=64, device_driven=True)
    spec = {"vectors": [{"hook": "resid_post", "layers": "all", "vector": [0.5] * HIDDEN}]}
    reqs = {r: hooks_for(r, 3, rt=rt, steering=spec) for r in "ab"}
    layout = BatchLayout(["a", "b"], np.array([0, 1, 2]), np.array([5, 7]), 2, None)
    plan = build_step_plan(layout.req_ids, layout.query_start_loc, layout.start_positions,
                           reqs, None, host_steering=False, uniform_slots=rt.uniform_slots)
    assert plan.uniform_slot
    hooks = SimpleNamespace(requests=reqs, reuse=None)
    hooks.reuse = EngineHooks._reuse_key(hooks, plan, layout)
    assert EngineHooks._same_steady_batch(hooks, layout)
    moved = BatchLayout(["a", "b"], np.array([0, 2, 3]), np.array([5, 7]), 3, None)
    assert not EngineHooks._same_steady_batch(hooks, moved)
    reqs["c"] = hooks_for("c", 3, rt=rt, capture={"hooks": ["resid_post"], "layers": [0]})
    copying = build_step_plan(["a", "c"], np.array([0, 1, 4]), np.array([5, 0]), reqs, None,
                              host_steering=False, uniform_slots=rt.uniform_slots)
    assert not copying.uniform_slot and copying.routes
    assert EngineHooks._reuse_key(hooks, copying, layout) is None


def test_a_steps_copies_into_writer_rings_are_one_per_writer_and_point(monkeypatch):
    """`_copy_to_sinks` with captures at two points each, spread over two writers: it
    reserves point by point, so each writer's rows of a point are one span of staging
    and of its ring (four copies, not one per request and point), and every reservation
    holds its own route's rows."""
    from types import SimpleNamespace

    from capsteer.engine_ext import delivery

    class Ring:
        supports_spans = False  # CaptureSink's declaration: no reserve_span

        def __init__(self) -> None:
            self.rows, self.head = torch.zeros(64, HIDDEN), 0

        def reserve_rows(self, capture_id, shape, dtype):
            got = SimpleNamespace(writer=self, rows=self.rows[self.head: self.head + shape[0]])
            self.head += shape[0]
            return got

    rt = HookRuntime(LAYERS, HIDDEN, torch.float32, torch.device("cpu"), max_tokens=32,
                     max_requests=8, staging_rows=64, device_driven=True)
    ids = [f"c{i}" for i in range(4)]
    reqs = {r: hooks_for(r, 4, rt=rt, capture={"hooks": ["resid_post", "attn_out"],
                                               "layers": [1]}) for r in ids}
    rings = [Ring(), Ring()]
    for i, h in enumerate(reqs.values()):
        h.group = i % 2
    plan = build_step_plan(ids, np.array([0, 4, 8, 12, 16]), np.zeros(4, np.int64), reqs, None,
                           host_steering=False)
    assert len(plan.routes) == 8
    rt.staging[: plan.staging_rows] = torch.arange(plan.staging_rows * HIDDEN,
                                                   dtype=torch.float32).view(-1, HIDDEN)
    sinks = {f"cap-{r}": rings[reqs[r].group] for r in ids}
    merged = []
    real = delivery.merge_row_copies
    monkeypatch.setattr(delivery, "merge_row_copies",
                        lambda copies: merged.append(real(copies)) or merged[-1])
    hooks = SimpleNamespace(runtime=rt, ring_copies=0)
    direct, rest = delivery.Delivery._copy_to_sinks(hooks, plan, sinks)
    assert rest.routes == [] and len(direct) == 8 and len(merged[0]) == 4
    assert hooks.ring_copies == 4  # the counter capsteer_stats reports
    for route, sink, reserved in direct:
        assert reserved.writer is sink
        torch.testing.assert_close(reserved.rows, rt.staging[delivery._staging_span(plan, route)])


def test_a_steps_copies_into_span_writers_are_one_reservation_per_writer_and_point():
    """With writers that reserve spans (`reserve_span`), `_copy_to_sinks` asks each writer
    once per point for all its routes' rows there (one copy each); a writer that refuses
    the span gets its routes reserved one by one (`reserve_rows`), and what does not fit
    even so goes to the harvester's path. Every route gets its own rows."""
    from types import SimpleNamespace

    from capsteer.engine_ext import delivery

    class Ring:
        supports_spans = True  # CaptureSink's declaration: reserve_span is asked first

        def __init__(self, spans: bool, room: int = 64) -> None:
            self.rows, self.head, self.spans, self.room = torch.zeros(64, HIDDEN), 0, spans, room
            self.span_calls, self.row_calls = [], 0

        def group_of(self, capture_id):
            return 0

        def reserve_rows(self, capture_id, shape, dtype):
            self.row_calls += 1
            if self.head + shape[0] > self.room:
                return None
            got = SimpleNamespace(writer=self, rows=self.rows[self.head: self.head + shape[0]])
            self.head += shape[0]
            return got

        def reserve_span(self, capture_ids, shapes, dtype):
            self.span_calls.append(list(capture_ids))
            if not self.spans:
                return None
            n = sum(shape[0] for shape in shapes)
            dst, parts, at = self.rows[self.head: self.head + n], [], self.head
            for shape in shapes:
                parts.append(SimpleNamespace(writer=self, rows=self.rows[at: at + shape[0]]))
                at += shape[0]
            self.head += n
            return dst, parts

    rt = HookRuntime(LAYERS, HIDDEN, torch.float32, torch.device("cpu"), max_tokens=32,
                     max_requests=8, staging_rows=64, device_driven=True)
    ids = [f"c{i}" for i in range(4)]
    reqs = {r: hooks_for(r, 4, rt=rt, capture={"hooks": ["resid_post", "attn_out"],
                                               "layers": [1]}) for r in ids}
    for i, h in enumerate(reqs.values()):
        h.group = i % 2
    rings = [Ring(spans=True), Ring(spans=False, room=12)]
    plan = build_step_plan(ids, np.array([0, 4, 8, 12, 16]), np.zeros(4, np.int64), reqs, None,
                           host_steering=False)
    rt.staging[: plan.staging_rows] = torch.arange(plan.staging_rows * HIDDEN,
                                                   dtype=torch.float32).view(-1, HIDDEN)
    sinks = {f"cap-{r}": rings[reqs[r].group] for r in ids}
    hooks = SimpleNamespace(runtime=rt, ring_copies=0)
    direct, rest = delivery.Delivery._copy_to_sinks(hooks, plan, sinks)
    assert rings[0].span_calls == [["cap-c0", "cap-c2"]] * 2 and rings[0].row_calls == 0
    assert rings[1].span_calls == [["cap-c1", "cap-c3"]] * 2 and rings[1].row_calls == 4
    assert len(direct) == 7 and len(rest.routes) == 1  # 3 x 4 rows fit the second ring
    assert rest.routes[0].capture_id == "cap-c3"
    for route, sink, reserved in direct:
        assert reserved.writer is sink
        torch.testing.assert_close(reserved.rows, rt.staging[delivery._staging_span(plan, route)])


def test_the_harvester_carries_only_the_rows_of_routes_that_missed_the_rings(monkeypatch):
    """Routes whose rows went GPU -> a writer's ring stay off the harvester's copy: it
    packs only the staged routes' spans (touching spans merged into one copy), and each
    staged route reads its own rows back from the packed slot."""
    from capsteer.engine_ext import delivery

    rt = HookRuntime(LAYERS, HIDDEN, torch.float32, torch.device("cpu"), max_tokens=32,
                     max_requests=8, staging_rows=64, device_driven=True)
    ids = [f"c{i}" for i in range(4)]
    reqs = {r: hooks_for(r, 4, rt=rt, capture={"hooks": ["resid_post", "attn_out"],
                                               "layers": [1, 2]}) for r in ids}
    plan = build_step_plan(ids, np.array([0, 4, 8, 12, 16]), np.zeros(4, np.int64), reqs, None,
                           host_steering=False)
    rt.staging[: plan.staging_rows] = torch.arange(plan.staging_rows * HIDDEN,
                                                   dtype=torch.float32).view(-1, HIDDEN)

    def packed(routes):
        spans, where = delivery.staged_row_spans(plan, routes)
        slot = torch.cat([rt.staging[b:e] for b, e in spans]) if spans else rt.staging[:0]
        for route in routes:
            torch.testing.assert_close(slot[where[id(route)]],
                                       rt.staging[delivery._staging_span(plan, route)])
        return spans, slot.shape[0]

    everything, rows = packed(plan.routes)
    assert rows == plan.staging_rows  # every row once, adjacent routes' spans merged
    assert len(everything) < len(plan.routes)
    missed = [r for r in plan.routes if r.capture_id in ("cap-c1", "cap-c3")]
    spans, rows = packed(missed)
    assert rows == sum(len(r.positions) for r in missed) < plan.staging_rows
    assert all(e - b > 0 for b, e in spans)
    assert packed([]) == ([], 0)
    by_row = sorted(plan.routes, key=lambda r: delivery._staging_span(plan, r).start)
    scattered = by_row[::2]  # no two touching: a span each, unless too many
    spans, _ = packed(scattered)
    assert len(spans) == len(scattered) > 1
    monkeypatch.setattr(delivery, "MAX_SLOT_COPIES", 1)
    spans, rows = packed(scattered)
    assert len(spans) == 1 and rows == spans[0][1] - spans[0][0]


def test_a_capture_the_worker_cannot_serve_ends_with_an_error_receipt():
    """A payload whose hooks cannot be registered (here: the steering table is full) runs
    without hooks, and its capture still ends: an error naming why, never silence (the
    client's wait and the server's budget would be held until the capture is forgotten)."""
    from types import MethodType, SimpleNamespace

    from capsteer.capture.sink import MemorySink
    from capsteer.engine_ext.worker import EngineHooks

    rt = HookRuntime(LAYERS, HIDDEN, torch.float32, torch.device("cpu"), max_tokens=16,
                     max_entries=2, max_requests=4)
    steer = {"vectors": [{"hook": "resid_post", "layers": "all", "vector": [0.5] * HIDDEN}]}
    with pytest.raises(RuntimeError, match="steering table full"):
        hooks_for("a", 3, rt=rt, steering=steer, capture={"hooks": ["resid_post"]})
    assert rt.free_slots == list(range(4, 0, -1))  # nothing half-registered stays behind
    extra = {"capsteer": {
        "capture": parse_capture_spec({"hooks": ["resid_post"]}, num_layers=LAYERS).to_dict(),
        "capture_id": "cap-a", "durable": False,
        "steering": parse_steering_spec(steer, num_layers=LAYERS, hidden_size=HIDDEN).to_dict()}}
    memory = MemorySink(final_positions=False)
    worker = SimpleNamespace(
        capture_rank=True, memory=memory, writer=None, sharded=None, runtime=rt,
        model_name="m", stage=0, num_stages=1, device_driven=False,
        sites=SimpleNamespace(hidden_size=HIDDEN, num_layers=LAYERS))
    for name in ("_sink_for", "_capture_request", "_run_on_sink_thread", "_refuse_capture",
                 "_open_and_abort"):
        setattr(worker, name, MethodType(getattr(EngineHooks, name), worker))
    worker._refuse_capture("a", [1, 2, 3], extra["capsteer"], "capsteer: steering table full")
    result = memory.take(["cap-a"])["cap-a"]
    assert result.error == "capsteer: steering table full"
    worker._refuse_capture("b", [1], {"steering": extra["capsteer"]["steering"]}, "no capture")
    worker._refuse_capture("c", [1], {**extra["capsteer"], "capture_id": "../x"}, "bad id")
    assert memory.take(["../x"]) == {}  # an id no path may hold: nothing opened, no crash
    assert memory.take(["cap-b"]) == {}  # steering only: no capture to answer for


def test_steering_a_worker_cannot_apply_is_counted_not_silent():
    """A steered request whose hooks cannot be installed runs unsteered: the worker counts
    it in capsteer_steering_refused_total (once per stage, on TP rank 0), so operators see
    what the client cannot tell from the response; its capture ends with the error."""
    from types import MethodType, SimpleNamespace

    from capsteer.capture import metrics
    from capsteer.capture.sink import MemorySink
    from capsteer.engine_ext.worker import EngineHooks

    rt = HookRuntime(LAYERS, HIDDEN, torch.float32, torch.device("cpu"), max_tokens=16,
                     max_entries=2, max_requests=4)
    steer = parse_steering_spec({"vectors": [{"hook": "resid_post", "layers": "all",
                                              "vector": [0.5] * HIDDEN}]},
                                num_layers=LAYERS, hidden_size=HIDDEN).to_dict()
    capture = parse_capture_spec({"hooks": ["resid_post"]}, num_layers=LAYERS).to_dict()

    def worker(rank0: bool):
        w = SimpleNamespace(
            capture_rank=rank0, memory=MemorySink(final_positions=False), writer=None,
            sharded=None, runtime=rt, model_name="m", stage=0, num_stages=1,
            device_driven=False, sites=SimpleNamespace(hidden_size=HIDDEN, num_layers=LAYERS))
        for name in ("_sink_for", "_capture_request", "_run_on_sink_thread", "_refuse_capture",
                     "_open_and_abort", "_hooks_refused", "_fail_readout"):
            setattr(w, name, MethodType(getattr(EngineHooks, name), w))
        return w

    def refused() -> float:
        return metrics.REGISTRY.get_sample_value("capsteer_steering_refused_total") or 0.0

    before = refused()
    full = RuntimeError("capsteer: steering table full (raise max_entries)")
    w = worker(True)
    w._hooks_refused("a", [1, 2], {"steering": steer}, full)
    assert refused() == before + 1
    w._hooks_refused("b", [1, 2], {"steering": steer, "capture": capture, "capture_id": "cap-b",
                                   "durable": False}, full)
    assert refused() == before + 2
    assert w.memory.take(["cap-b"])["cap-b"].error == f"capsteer: {full}"
    w._hooks_refused("c", [1], {"capture": capture, "capture_id": "cap-c", "durable": False},
                     ValueError("bad capture"))
    assert refused() == before + 2  # no steering asked: the capture's error receipt says it
    worker(False)._hooks_refused("d", [1], {"steering": steer}, full)
    assert refused() == before + 2  # TP ranks > 0 repeat rank 0's work: counted once


def test_a_servers_workers_act_only_on_payloads_it_signed(monkeypatch):
    """capsteer serve puts a key in its processes' environment; payloads built there carry
    it, and a worker expecting it ignores any payload without it (one that reached vLLM
    around the front end's checks). The in-process engine has no key and trusts its own."""
    from capsteer.engine_ext.payload import PAYLOAD_KEY_ENV, build_payload, payload_is_trusted

    capture = parse_capture_spec({"hooks": ["resid_post"]}, num_layers=LAYERS)
    monkeypatch.delenv(PAYLOAD_KEY_ENV, raising=False)
    unsigned = build_payload(capture, None).extra_args["capsteer"]
    assert "key" not in unsigned and payload_is_trusted(unsigned, None)
    monkeypatch.setenv(PAYLOAD_KEY_ENV, "k1")
    signed = build_payload(capture, None).extra_args["capsteer"]
    assert signed["key"] == "k1" and payload_is_trusted(signed, "k1")
    assert not payload_is_trusted(unsigned, "k1")
    assert not payload_is_trusted({**signed, "key": "guess"}, "k1")
