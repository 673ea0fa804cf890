"""Wire messages and the engine-process loop, in process (no HTTP, no subprocess)."""

from __future__ import annotations

import pytest
import zmq

from longctx.server import messages as m
from longctx.server.engine_proc import EngineLoop
from longctx.server.fake_engine import FakeEngine

SP = m.WireSamplingParams(max_new_tokens=3, temperature=0.0, stop=("out", "batch"))


@pytest.mark.parametrize(
    "msg",
    [
        m.AddRequest("r1", (1, 2, 3), SP, True),
        m.AbortRequest("r1"),
        m.PinDocument(7, (5, 6)),
        m.UnpinDocument(8, "doc-1"),
        m.StatsQuery(9),
        m.ResetPrefixCache(10),
        m.Shutdown(),
        m.EngineReady(4096, 320, (257,), {"fake": True}),
        m.EngineFailed("boom"),
        m.OutputBatch(
            (
                m.TokenOutput(
                    "r", (1, 2), True, "stop", 3, 3, 0, (m.WireLogprob(1, -0.5, ((1, -0.5), (2, -1.5))),)
                ),
            ),
            2,
            1,
            {"pages_used": 3, "x": 1.5},
        ),
        m.RpcReply(3, True, ("doc-1", 100)),  # arrays decode as tuples
        m.RpcReply(4, False, error="no document", error_code="invalid_value"),
    ],
)
def test_round_trip(msg):
    assert m.decode(m.encode(msg)) == msg


def test_garbage_is_a_value_error():
    with pytest.raises(ValueError):
        m.decode(b"\xc1\xc1")
    with pytest.raises(TypeError):
        m.encode(object())


class _Loop:
    """An EngineLoop wired to this test through inproc sockets."""

    def __init__(self, engine):
        self.ctx = zmq.Context()
        self.to_engine, pull = self.ctx.socket(zmq.PUSH), self.ctx.socket(zmq.PULL)
        self.to_engine.bind("inproc://to")
        pull.connect("inproc://to")
        push, self.from_engine = self.ctx.socket(zmq.PUSH), self.ctx.socket(zmq.PULL)
        self.from_engine.bind("inproc://from")
        push.connect("inproc://from")
        self.loop = EngineLoop(engine, pull, push)
        self.socks = [self.to_engine, pull, push, self.from_engine]

    def send(self, msg):
        self.to_engine.send(m.encode(msg))

    def run(self, n=1):
        outs, replies = [], []
        for _ in range(n):
            self.loop.run_once(idle_timeout_ms=5)
            while self.from_engine.poll(0):
                msg = m.decode(self.from_engine.recv())
                if isinstance(msg, m.OutputBatch):
                    outs.extend(msg.outputs)
                else:
                    replies.append(msg)
        return outs, replies

    def close(self):
        for s in self.socks:
            s.close(0)
        self.ctx.term()


@pytest.fixture
def loop():
    lp = _Loop(FakeEngine(max_context=256, step_delay_s=0.0))
    yield lp
    lp.close()


def test_loop_generates_aborts_and_isolates_errors(loop):
    loop.send(m.AddRequest("good", (104, 105), m.WireSamplingParams(max_new_tokens=3, temperature=0.0)))
    loop.send(m.AddRequest("bad", (), m.WireSamplingParams(max_new_tokens=3)))  # empty prompt
    loop.send(m.AddRequest("neg", (1,), m.WireSamplingParams(max_new_tokens=3, temperature=-1.0)))
    loop.send(m.AddRequest("long", (1,) * 300, m.WireSamplingParams(max_new_tokens=1)))
    loop.send(m.AddRequest("slow", (1, 2), m.WireSamplingParams(max_new_tokens=100)))
    outs, _ = loop.run(6)
    by = {}
    for o in outs:
        by.setdefault(o.rid, []).append(o)
    assert [t for o in by["good"] for t in o.new_token_ids] == [104, 105, 104]
    assert by["good"][-1].finished and by["good"][-1].finish_reason == "length"
    for rid in ("bad", "neg", "long"):
        assert len(by[rid]) == 1 and by[rid][0].error and by[rid][0].error_code == "invalid_value"
    assert not by["slow"][-1].finished
    loop.send(m.AbortRequest("slow"))
    outs, _ = loop.run(1)
    assert [(o.rid, o.finish_reason) for o in outs] == [("slow", "abort")]
    assert loop.loop.eng.stats()["pages_used"] == 0


def test_loop_rpcs(loop):
    loop.send(m.PinDocument(1, tuple(range(100))))
    loop.send(m.StatsQuery(2))
    loop.send(m.ResetPrefixCache(5))
    _, replies = loop.run(1)
    assert replies[0] == m.RpcReply(1, True, ("doc-1", 100))
    assert replies[1].ok and replies[1].result["pages_used"] == 1
    assert replies[2] == m.RpcReply(5, True, {"freed_pages": 0, "kept_pages": 1})  # (the document's page)
    loop.send(m.UnpinDocument(3, "doc-404"))
    loop.send(m.UnpinDocument(4, "doc-1"))
    _, replies = loop.run(1)
    assert not replies[0].ok and "doc-404" in replies[0].error and replies[0].error_code == "invalid_value"
    assert replies[1].ok


def test_loop_survives_a_failing_step(loop):
    loop.send(m.AddRequest("a", (1, 2), m.WireSamplingParams(max_new_tokens=50)))
    loop.run(2)
    real_step = loop.loop.eng.step

    def boom():
        raise RuntimeError("device fell over\nsecond line")

    loop.loop.eng.step = boom
    outs, _ = loop.run(1)
    assert [(o.rid, o.error_code, o.error) for o in outs] == [("a", None, "RuntimeError: device fell over")]
    loop.loop.eng.step = real_step
    loop.send(m.AddRequest("b", (3,), m.WireSamplingParams(max_new_tokens=1)))
    outs, _ = loop.run(3)
    assert any(o.rid == "b" and o.finished and o.new_token_ids for o in outs)


def test_loop_reports_a_dead_engine_and_stops(loop):
    """A stage process died (EngineDeadError): every step would fail from now on, so after failing
    the loop tells the frontend (EngineFailed), which fails the live requests with 503 engine_dead
    and turns /health unhealthy, and stops. No request gets an error of its own (that would be a 500)."""
    from longctx.errors import EngineDeadError

    loop.send(m.AddRequest("a", (1, 2), m.WireSamplingParams(max_new_tokens=50)))
    loop.run(2)

    def dead():
        raise EngineDeadError("stage 1 (layers [3, 6], tp rank 0) exited with code -9")

    loop.loop.eng.step = dead
    outs, replies = loop.run(1)
    assert outs == []
    assert replies == [
        m.EngineFailed("EngineDeadError: stage 1 (layers [3, 6], tp rank 0) exited with code -9")
    ]
    assert loop.loop.stop


def test_wire_sampling_params_reach_the_engine_field_for_field() -> None:
    """WireSamplingParams and the engine's SamplingParams keep the same fields (a new sampling field is
    added to both or a request loses it on the way), and one sent over the wire arrives as the engine's
    own params, tuples and all."""
    import dataclasses

    from longctx.engine.request import SamplingParams
    from longctx.server.engine_proc import sampling_params

    wire = {f.name: f.type for f in dataclasses.fields(m.WireSamplingParams)}
    engine = {f.name: f.type for f in dataclasses.fields(SamplingParams)}
    assert wire == engine
    sent = m.WireSamplingParams(
        max_new_tokens=7, temperature=0.7, top_p=0.9, top_k=5, seed=3, stop_token_ids=(1, 2), stop=("x",),
        ignore_eos=True, logprobs=2, presence_penalty=0.1, frequency_penalty=0.2, repetition_penalty=1.1,
        min_tokens=1, min_p=0.05, logit_bias=((4, -1.5), (9, 2.0)), prompt_logprobs=1,
    )  # fmt: skip
    got = m.decode(m.encode(m.AddRequest("r", (1,), sent))).params
    params = sampling_params(got)
    assert params == SamplingParams(**dataclasses.asdict(sent))
    assert isinstance(params.stop_token_ids, tuple) and isinstance(params.logit_bias[0], tuple)
    params.validate()


def test_loop_signalled_alone_exits_after_its_grace(loop):
    """A SIGTERM of the engine process alone (its frontend alive and not shutting it down) ends the
    loop once `term_grace_s` has passed, aborting what is still live."""
    import time

    loop.send(m.AddRequest("a", (1, 2), m.WireSamplingParams(max_new_tokens=10_000)))
    loop.run(2)
    el = loop.loop
    el.term_grace_s = 0.2
    el.term_at.append(time.monotonic())
    t0 = time.monotonic()
    el.run()
    assert 0.2 <= time.monotonic() - t0 < 10 and not el.eng.has_work()


def test_loop_compiles_a_new_guide_off_the_step_loop(eng, monkeypatch):
    """A request's new guide compiles on a worker thread: the running requests go on stepping meanwhile, the
    request is added once its guide is ready, a bad guide ends it with the field at fault, and an abort while it
    compiles ends it at once."""
    import random
    import re
    import threading

    from longctx.engine.guided import GuideCache

    gate = threading.Event()
    real = GuideCache._compile
    monkeypatch.setattr(GuideCache, "_compile", staticmethod(lambda k, s: (gate.wait(10), real(k, s))[1]))
    lp = _Loop(eng)
    try:
        tag = random.randrange(1 << 30)
        pattern = f"(?P<t{tag}>[a-f]{{3}})"  # (a new guide to this engine: a group name of its own)
        lp.send(m.AddRequest("plain", (104, 105), m.WireSamplingParams(max_new_tokens=40, ignore_eos=True)))
        lp.send(m.AddRequest("g", (97,), m.WireSamplingParams(max_new_tokens=8, guided=("regex", pattern))))
        lp.send(m.AddRequest("bad", (97,), m.WireSamplingParams(max_new_tokens=8, guided=("regex", "(?=y)"))))
        lp.send(
            m.AddRequest(
                "gone", (97,), m.WireSamplingParams(max_new_tokens=8, guided=("regex", pattern + "z"))
            )
        )
        outs, _ = lp.run(4)
        assert {"g", "bad", "gone"} <= set(lp.loop.compiling) and "plain" in lp.loop.live
        assert (
            sum(len(o.new_token_ids) for o in outs if o.rid == "plain") >= 3
        )  # (stepping while it compiles)
        assert not [o for o in outs if o.rid != "plain"]
        lp.send(m.AbortRequest("gone"))
        outs, _ = lp.run(1)
        assert [(o.rid, o.finish_reason) for o in outs if o.rid == "gone"] == [("gone", "abort")]
        gate.set()
        by: dict[str, list] = {}
        for _ in range(200):
            outs, _ = lp.run(1)
            for o in outs:
                by.setdefault(o.rid, []).append(o)
            if by.get("g") and by["g"][-1].finished and by.get("bad"):
                break
        (bad,) = by["bad"]
        assert (
            bad.finish_reason == "error" and bad.error_param == "guided_regex" and "lookarounds" in bad.error
        )
        text = bytes(t for o in by["g"] for t in o.new_token_ids).decode()
        assert re.fullmatch(pattern, text) and by["g"][-1].finish_reason == "stop", text
        assert "gone" not in by and not lp.loop.compiling
    finally:
        gate.set()
        lp.close()
        while eng.has_work():
            eng.step()
