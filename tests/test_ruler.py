"""RULER workload: scoring, length fitting, determinism, oracle runs, resume, report, CLI."""

from __future__ import annotations

import itertools
import json
import threading
import time
from functools import partial
from pathlib import Path

import httpx
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from longctx.cli import main
from longctx.errors import LongctxError
from longctx.workloads import cli_args, clients, jsonl
from longctx.workloads.clients import Client, GenRequest, GenResult
from longctx.workloads.fit import LengthError
from longctx.workloads.prose import essay_sentences
from longctx.workloads.ruler_cli import parse_lengths
from longctx.workloads.ruler_runner import RunPlan, plan_keys, read_rows, run_samples, write_report
from longctx.workloads.ruler_tasks import TASKS, RulerGenerator, parse_tasks, raw_render
from longctx.workloads.scoring import (
    effective_length,
    postprocess,
    sample_match_all,
    string_match_all,
    string_match_part,
)
from longctx.workloads.tokens import ByteCounter, HFCounter
from tests.conftest import byte_level_counter, tiny_config

# ---- scoring ---------------------------------------------------------------------------------


def test_string_match_all_hand_cases():
    assert string_match_all(["The special magic number is 1234567."], [["1234567"]]) == 100.0
    assert string_match_all(["alpha and beta"], [["alpha", "gamma"]]) == 50.0
    assert string_match_all(["ALPHA Beta"], [["alpha", "beta"]]) == 100.0  # case-insensitive
    assert string_match_all(["1", "2"], [["1"], ["3"]]) == 50.0  # mean over samples
    assert string_match_all(["a b c"], [["a", "b", "x"]]) == 66.67  # rounded to 2 decimals
    assert string_match_all(["nothing"], [["x", "y"]]) == 0.0
    assert string_match_all([], []) == 0.0


def test_string_match_part_hand_cases():
    assert string_match_part(["Paris"], [["paris", "Lyon"]]) == 100.0  # any reference counts fully
    assert string_match_part(["Lyon!"], [["Paris", "LYON"]]) == 100.0
    assert string_match_part(["Rome"], [["Paris", "Lyon"]]) == 0.0
    assert string_match_part(["x", "y", "z", "w"], [["x"], ["q"], ["z"], ["q"]]) == 50.0
    # The two metrics differ exactly when only some references are found.
    assert string_match_all(["x"], [["x", "y"]]) == 50.0
    assert string_match_part(["x"], [["x", "y"]]) == 100.0


def test_postprocess_and_substring_semantics():
    assert postprocess("\t 123\x00 ") == "123"
    assert postprocess("a\x01b") == "a\nb"
    # Substring, not word, matching (RULER's semantics): "cat" is found inside "concatenate".
    assert sample_match_all("concatenate", ["cat"]) == 1.0
    assert sample_match_all("anything", []) == 0.0


def test_effective_length():
    assert effective_length({4096: 95.0, 8192: 86.0, 16384: 80.0, 32768: 99.0}) == 8192
    assert effective_length({4096: 85.6}) is None  # must be strictly above the threshold
    assert effective_length({4096: 100.0, 131072: 90.0}) == 131072
    assert effective_length({}) is None


# ---- generation ------------------------------------------------------------------------------


def small_bpe() -> HFCounter:
    """A small trained BPE (about 3.5 bytes per token on prose), to cover merging tokenizers."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([s for s, _ in itertools.islice(essay_sentences(9), 1500)], trainer)
    return HFCounter(tok, "bpe")


def test_task_table_matches_ruler():
    assert len(TASKS) == 13
    budgets = {t: s.max_new_tokens for t, s in TASKS.items()}
    assert budgets["niah_single_1"] == 128 and budgets["vt"] == 30 and budgets["cwe"] == 120
    assert budgets["fwe"] == 50 and budgets["qa_1"] == 32
    assert {t for t, s in TASKS.items() if s.metric == "part"} == {"qa_1", "qa_2"}
    assert parse_tasks("all") == list(TASKS)
    assert parse_tasks("vt, cwe,vt") == ["vt", "cwe"]
    for bad in ("niah_single_9", "", " , "):  # (an empty list ran all 13)
        with pytest.raises(LongctxError):
            parse_tasks(bad)


def test_scaled_budget_still_holds_the_answer():
    """A scaled-down budget (the retrieval model's 0.5) never cuts below the answer the task asks for: vt's
    30 bytes of names stay 30, not 15; niah's scaled budget already holds its values; at scale 1 every
    budget is RULER's."""
    from longctx.train.data import answer_text

    for scale in (0.25, 0.5, 1.0):
        gen = RulerGenerator(ByteCounter(), seed=3, max_new_tokens_scale=scale)
        for task in ("vt", "niah_single_3", "niah_multivalue", "niah_multiquery", "niah_multikey_3"):
            for i in range(4):
                s = gen.sample(task, 4096, i)
                assert s.max_new_tokens >= len(answer_text(task, s.outputs).encode()), (scale, task, i)
                assert 0.98 * 4096 <= s.prompt_tokens + s.max_new_tokens <= 4096
        if scale == 1.0:
            assert all(gen.max_new_tokens(t) == spec.max_new_tokens for t, spec in TASKS.items())
    gen = RulerGenerator(ByteCounter(), max_new_tokens_scale=0.5)
    assert gen.max_new_tokens("vt") == 30 and gen.max_new_tokens("niah_single_1") == 64
    # cwe's ten words (the numbered list its example answers with) are not cut either
    for i in range(4):
        s = gen.sample("cwe", 8192, i)
        listing = " " + " ".join(f"{j + 1}. {w}" for j, w in enumerate(s.outputs))
        assert s.max_new_tokens >= len(listing.encode()) and len(s.outputs) == 10
    assert gen.max_new_tokens("cwe") > 60
    assert gen.max_new_tokens("qa_1") == 16  # no floor where the answer is not bounded


@pytest.mark.parametrize("counter_name", ["bytes", "byte-level", "bpe"])
def test_lengths_within_two_percent(counter_name):
    counter = {"bytes": ByteCounter, "byte-level": byte_level_counter, "bpe": small_bpe}[counter_name]()
    gen = RulerGenerator(counter, seed=1)
    targets = [3000, 4096, 10_000, 40_000] if counter_name != "bpe" else [4096, 20_000]
    for task in TASKS:
        for L in targets:
            for i in (0, 1):
                s = gen.sample(task, L, i)
                total = s.prompt_tokens + s.max_new_tokens
                assert 0.98 * L <= total <= L, (task, L, i, total)
                assert s.prompt_tokens == counter.count(raw_render(s.input, s.answer_prefix))


def test_needles_and_answers_are_in_the_prompt():
    gen = RulerGenerator(ByteCounter(), seed=0)
    for task, spec in TASKS.items():
        s = gen.sample(task, 4096, 0)
        if spec.family in ("niah", "vt"):
            for ref in s.outputs:
                assert ref in s.input, (task, ref)
        if spec.family == "niah":
            assert len(s.outputs) == spec.num_v * spec.num_q
            assert s.answer_prefix.startswith(" The special magic")
    mq = gen.sample("niah_multiquery", 8192, 0)
    assert len(mq.outputs) == 4 and ", and " in mq.answer_prefix
    assert "is hidden within" in gen.sample("niah_single_1", 4096, 0).input
    uuid = gen.sample("niah_single_3", 4096, 0).outputs[0]
    assert len(uuid) == 36 and uuid[14] == "4"
    num = gen.sample("niah_single_2", 4096, 0).outputs[0]
    assert len(num) == 7 and num.isdigit()


def test_too_short_length_is_an_error():
    with pytest.raises(LengthError):
        RulerGenerator(ByteCounter()).sample("vt", 300, 0)


def test_determinism_per_seed():
    a = RulerGenerator(ByteCounter(), seed=7)
    b = RulerGenerator(ByteCounter(), seed=7)
    c = RulerGenerator(ByteCounter(), seed=8)
    for task in ("niah_single_2", "niah_multikey_2", "vt", "cwe", "fwe", "qa_2"):
        first = [a.sample(task, 5000, i) for i in range(3)]
        # Order of generation must not matter (sample 2 first in a fresh generator).
        assert b.sample(task, 5000, 2) == first[2]
        assert b.sample(task, 5000, 0) == first[0]
        assert c.sample(task, 5000, 0).input != first[0].input
        assert first[0].input != first[1].input


def test_million_token_prompt_builds_fast():
    import time

    gen = RulerGenerator(ByteCounter(), seed=0)
    t0 = time.perf_counter()
    s = gen.sample("niah_single_2", 1 << 20, 0)
    assert time.perf_counter() - t0 < 20
    assert 0.98 * (1 << 20) <= s.prompt_tokens + s.max_new_tokens <= 1 << 20


# ---- running -----------------------------------------------------------------------------------


class OracleClient(Client):
    """Answers every prompt with its sample's ground truth."""

    def __init__(
        self, answers: dict[str, str], parallel: bool = False, fail_after: int | None = None
    ) -> None:
        self.answers = answers
        self.parallel = parallel
        self.calls = 0
        self.fail_after = fail_after

    def generate(self, reqs: list[GenRequest]) -> list[GenResult]:
        out = []
        for r in reqs:
            if self.fail_after is not None and self.calls >= self.fail_after:
                raise RuntimeError("server went away")
            self.calls += 1
            out.append(GenResult(" " + self.answers[r.prompt], 0.01, None, 5, "stop"))
        return out


def oracle_answers(seed: int, keys) -> dict[str, str]:
    gen = RulerGenerator(ByteCounter(), seed=seed)
    return {raw_render(s.input, s.answer_prefix): " ".join(s.outputs) for s in (gen.sample(*k) for k in keys)}


def make_request(gen: RulerGenerator):
    return lambda s: GenRequest(gen.render(s.input, s.answer_prefix), s.max_new_tokens)


@pytest.mark.parametrize("parallel", [False, True])
def test_oracle_scores_100_on_every_task(tmp_path, parallel):
    keys = plan_keys(RunPlan(tuple(TASKS), (2048, 4096, 8192), 1))
    gen = RulerGenerator(ByteCounter(), seed=5)
    client = OracleClient(oracle_answers(5, keys), parallel=parallel)
    assert run_samples(gen, client, keys, tmp_path, make_request(gen), concurrency=3) == len(keys)
    summary = write_report(tmp_path, {"model": "oracle"})
    for task in TASKS:
        for L in ("2048", "4096", "8192"):
            assert summary["scores"][task][L] == 100.0, (task, L)
            assert summary["samples"][task][L] == 1
    assert summary["effective_length"]["average"] == 8192
    assert summary["average"] == {"2048": 100.0, "4096": 100.0, "8192": 100.0}


def test_resume_skips_finished_samples(tmp_path):
    keys = plan_keys(RunPlan(("niah_single_1", "vt"), (2048,), 3))
    answers = oracle_answers(0, keys)
    gen = RulerGenerator(ByteCounter(), seed=0)
    flaky = OracleClient(answers, fail_after=2)
    with pytest.raises(RuntimeError):
        run_samples(gen, flaky, keys, tmp_path, make_request(gen))
    assert len(read_rows(tmp_path / "results.jsonl")) == 2
    # A torn last line (killed mid-write) is ignored and that sample reruns.
    with (tmp_path / "results.jsonl").open("a") as f:
        f.write('{"task": "vt", "len')
    good = OracleClient(answers)
    assert run_samples(gen, good, keys, tmp_path, make_request(gen)) == 4
    assert good.calls == 4
    again = OracleClient(answers)
    assert run_samples(gen, again, keys, tmp_path, make_request(gen)) == 0
    assert again.calls == 0
    rows = read_rows(tmp_path / "results.jsonl")
    assert sorted((r["task"], r["index"]) for r in rows) == sorted((t, i) for t, _, i in keys)
    # More samples later: only the new ones run.
    more = plan_keys(RunPlan(("niah_single_1", "vt"), (2048,), 4))
    extra = OracleClient(oracle_answers(0, more))
    assert run_samples(gen, extra, more, tmp_path, make_request(gen)) == 2
    # Another seed must not mix into the same file.
    with pytest.raises(LongctxError):
        run_samples(RulerGenerator(ByteCounter(), seed=1), extra, more, tmp_path, make_request(gen))


def test_one_run_at_a_time_writes_a_directory_and_a_sample_counts_once(tmp_path):
    keys = plan_keys(RunPlan(("niah_single_1",), (2048,), 2))
    gen = RulerGenerator(ByteCounter(), seed=0)
    answers = oracle_answers(0, keys)
    refused = []

    class Racing(OracleClient):
        """While this run works, a second run into the same directory is refused, not run twice."""

        def generate(self, reqs):
            if not refused:
                with pytest.raises(LongctxError, match="another run is writing"):
                    run_samples(gen, OracleClient(answers), keys, tmp_path, make_request(gen))
                refused.append(True)
            return super().generate(reqs)

    assert run_samples(gen, Racing(answers), keys, tmp_path, make_request(gen)) == 2 and refused
    assert run_samples(gen, OracleClient(answers), keys, tmp_path, make_request(gen)) == 0  # lock let go
    # the rows of two runs joined into one file (sample 0 wrong the second time): each sample once, its last row
    rows = read_rows(tmp_path / "results.jsonl")
    with (tmp_path / "results.jsonl").open("a") as f:
        for r in rows:
            f.write(json.dumps({**r, "score": 0.0 if r["index"] == 0 else r["score"]}) + "\n")
    summary = write_report(tmp_path, {"model": "m"})
    assert summary["samples"]["niah_single_1"]["2048"] == 2
    assert summary["scores"]["niah_single_1"]["2048"] == 50.0


def test_report_files(tmp_path):
    keys = plan_keys(RunPlan(("niah_single_1", "qa_1"), (2048, 4096), 2))
    gen = RulerGenerator(ByteCounter(), seed=0)
    answers = oracle_answers(0, keys)
    # Wrong answers for qa_1 at 4096 so the table is not flat.
    answers = {p: ("nope" if "Answer the question" in p and len(p) > 3000 else a) for p, a in answers.items()}
    run_samples(gen, OracleClient(answers), keys, tmp_path, make_request(gen))
    summary = write_report(tmp_path, {"model": "m"})
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved == json.loads(json.dumps(summary))
    assert saved["scores"]["qa_1"] == {"2048": 100.0, "4096": 0.0}
    assert saved["effective_length"]["qa_1"] == 2048
    assert saved["effective_length"]["niah_single_1"] == 4096
    assert saved["mean_latency_s"]["qa_1"]["2048"] == 0.01
    assert saved["samples"]["niah_single_1"]["4096"] == 2
    png = (tmp_path / "ruler.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000


# ---- CLI ---------------------------------------------------------------------------------------


def test_parse_lengths():
    assert parse_lengths("4k,32k,128k,1m") == [4096, 32768, 131072, 1048576]
    assert parse_lengths("5000, 4K") == [4096, 5000]
    for bad in ("4x", "", "100", "k"):
        with pytest.raises(LongctxError):
            parse_lengths(bad)
    # (the bench scripts that share it print the message as it is: the setting unnamed)
    with pytest.raises(LongctxError, match=r"^lengths '4x': not a length; use e\.g\. 4k"):
        parse_lengths("1k,4x")


@pytest.mark.parametrize(
    "argv",
    [
        ["--lengths", "4q", "--dump-dir", "D"],
        ["--tasks", "nope", "--dump-dir", "D"],
        ["--tasks", " , ", "--dump-dir", "D"],
        ["--samples", "0", "--dump-dir", "D"],
        ["--seed", "x", "--dump-dir", "D"],
        ["--seed", str(2**63), "--lengths", "1k", "--samples", "1", "--dump-dir", "D"],
        ["--max-new-tokens-scale", "-1", "--dump-dir", "D"],
        ["--max-new-tokens-scale", "inf", "--dump-dir", "D"],
        ["--base-url", "http://127.0.0.1:1", "--out", "O", "--api-key", "k\u00e9y", "--samples", "1"],
        ["--dump-dir", "/dev/null/D", "--samples", "1", "--lengths", "1k", "--tasks", "niah_single_1"],
        ["--model", "M", "--base-url", "http://x", "--out", "O"],
        ["--base-url", "http://x"],  # no --out
        [],  # nothing to do
        ["--model", "/does/not/exist", "--out", "O"],
        ["--base-url", "http://x", "--out", "O", "--index-topk", "64"],  # a server selects its own
        ["--index-topk", "0", "--dump-dir", "D"],
        ["--index-local-window", "-1", "--dump-dir", "D"],
        ["--index-topk-long", "-1", "--dump-dir", "D"],
        ["--index-topk-long-from", "x", "--dump-dir", "D"],
        ["--base-url", "http://x", "--out", "O", "--index-topk-long", "128"],  # (the server's own)
        ["--base-url", "http://x", "--out", "O", "--index-local-window", "8"],  # (the server's own)
        ["--base-url", "http://x", "--out", "O", "--hisparse-device-tokens", "4096"],
        ["--kv-dtype", "fp4", "--dump-dir", "D"],
        ["--kv-fp8-skip-layers", "x", "--dump-dir", "D"],
        ["--base-url", "http://x", "--out", "O", "--kv-fp8-skip-layers", "4"],  # (the server's own)
        ["--base-url", "http://x", "--out", "O", "--kv-dtype", "bf16"],  # (the server's own)
        ["--indices", "0,x", "--dump-dir", "D"],
        ["--indices", "-1", "--dump-dir", "D"],
        ["--indices", "3,3", "--dump-dir", "D"],
        ["--indices", "", "--dump-dir", "D"],
    ],
)
def test_cli_bad_args_exit_2_with_one_line(argv, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["ruler", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("longctx ruler: error:")


def _oracle_transport(answers: dict[str, str], chat: bool, seen: list) -> httpx.MockTransport:
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "oracle-model"}]})
        body = json.loads(request.content)
        seen.append(body)
        if chat:
            assert request.url.path == "/v1/chat/completions"
            text = answers[body["messages"][0]["content"]]
            choice = {"message": {"role": "assistant", "content": text}, "finish_reason": "stop"}
        else:
            assert request.url.path == "/v1/completions"
            choice = {"text": answers[body["prompt"]], "finish_reason": "stop"}
        return httpx.Response(
            200, json={"choices": [choice], "usage": {"prompt_tokens": 11, "completion_tokens": 3}}
        )

    return httpx.MockTransport(handler)


@pytest.mark.parametrize("chat", [False, True])
def test_cli_against_a_server(tmp_path, monkeypatch, capsys, chat):
    tasks = ("niah_single_2", "cwe", "qa_2")
    keys = plan_keys(RunPlan(tasks, (2048, 4096), 2))
    gen = RulerGenerator(ByteCounter(), seed=3, render=(lambda t, p: t) if chat else raw_render)
    answers = {
        gen.render(s.input, s.answer_prefix): " ".join(s.outputs) for s in (gen.sample(*k) for k in keys)
    }
    seen: list = []
    monkeypatch.setattr(
        clients, "HTTPClient", partial(clients.HTTPClient, transport=_oracle_transport(answers, chat, seen))
    )
    out, dump = tmp_path / "out", tmp_path / "dump"
    argv = ["ruler", "--base-url", "http://server:1/v1", "--tasks", ",".join(tasks), "--lengths", "2k,4k"]
    argv += [
        "--samples",
        "2",
        "--seed",
        "3",
        "--out",
        str(out),
        "--dump-dir",
        str(dump),
        "--concurrency",
        "3",
    ]
    argv += ["--chat"] if chat else []
    assert main(argv) == 0
    summary = json.loads((out / "results.json").read_text())
    assert all(v == 100.0 for t in tasks for v in summary["scores"][t].values())
    assert summary["model"] == "http://server:1"
    assert all(b["model"] == "oracle-model" and b["temperature"] == 0.0 for b in seen)
    assert {b["max_tokens"] for b in seen} == {128, 120, 32}
    dumped = read_rows(dump / "samples.jsonl")
    assert len(dumped) == len(keys)
    assert {"task", "length", "input", "outputs"} <= set(dumped[0])
    assert "niah_single_2" in capsys.readouterr().out  # the score table
    # A rerun is a no-op for the server.
    seen.clear()
    assert main(argv) == 0
    assert seen == []


def _busy(transport: httpx.MockTransport, fail) -> httpx.MockTransport:
    """`transport` behind a server that answers `fail(n)` (a Response, an exception to raise, or None:
    pass it on) to its n-th generation request."""
    n = itertools.count()

    def handler(request: httpx.Request) -> httpx.Response:
        reply = fail(next(n)) if request.url.path != "/v1/models" else None
        if isinstance(reply, Exception):
            raise reply
        return reply if reply is not None else transport.handle_request(request)

    return httpx.MockTransport(handler)


def _on_server(tasks: tuple[str, ...], out: Path) -> list[str]:
    """`longctx ruler` against http://srv: 4 samples of each task at 2k, seed 0, 3 in flight."""
    argv = f"ruler --base-url http://srv --tasks {','.join(tasks)} --lengths 2k --samples 4 --seed 0"
    return [*argv.split(), "--concurrency", "3", "--out", str(out)]


def test_cli_rides_out_a_busy_server(tmp_path, monkeypatch):
    """429s (a full queue), 503s and dropped connections are waited out: every sample is scored."""
    tasks = ("niah_single_1", "vt")
    keys = plan_keys(RunPlan(tasks, (2048,), 4))
    answers = oracle_answers(0, keys)
    busy = [
        httpx.Response(429, json={"error": {"message": "too many queued requests", "code": "queue_full"}}),
        httpx.Response(
            503, json={"error": {"message": "server is shutting down"}}, headers={"Retry-After": "1"}
        ),
        httpx.ConnectError("connection refused"),
        None,
    ]
    waits: list[float] = []
    transport = _busy(_oracle_transport(answers, False, []), lambda n: busy[n % 4])
    monkeypatch.setattr(
        clients, "HTTPClient", partial(clients.HTTPClient, transport=transport, sleep=waits.append)
    )
    assert main(_on_server(tasks, tmp_path)) == 0
    rows = read_rows(tmp_path / "results.jsonl")
    assert len(rows) == len(keys) and all(r["score"] == 1.0 for r in rows)
    assert len(waits) == 24  # 3 of every 4 requests answered busy: 8 samples took 32


def test_concurrency_beyond_a_small_queue_fails_no_sample(tmp_path):
    """More requests in flight than a server takes: it answers 429 (queue_full) to the rest. A request
    that keeps losing the freed slot to newer ones is not failed while the server answers others."""
    keys = plan_keys(RunPlan(("niah_single_1", "vt"), (2048,), 12))
    answers = oracle_answers(0, keys)
    slots = threading.BoundedSemaphore(1)  # (a queue of one, every request held 10 ms)

    def handler(request: httpx.Request) -> httpx.Response:
        if not slots.acquire(blocking=False):
            return httpx.Response(429, json={"error": {"message": "too many queued", "code": "queue_full"}})
        try:
            time.sleep(0.01)
            choice = {"text": answers[json.loads(request.content)["prompt"]], "finish_reason": "stop"}
            return httpx.Response(200, json={"choices": [choice]})
        finally:
            slots.release()

    # 3 retries over at most 140 ms: a request that met no free slot for that long failed the run
    retry = clients.Retry(attempts=3, base_s=0.02)
    client = clients.HTTPClient(
        "http://srv", model_name="m", transport=httpx.MockTransport(handler), retry=retry
    )
    gen = RulerGenerator(ByteCounter(), seed=0)
    assert run_samples(gen, client, keys, tmp_path, make_request(gen), concurrency=12) == len(keys)
    assert all(r["score"] == 1.0 for r in read_rows(tmp_path / "results.jsonl"))


def test_a_sample_that_fails_for_good_stops_the_run_and_a_rerun_resumes(tmp_path, monkeypatch, capsys):
    """A request the server refuses (not to be retried) ends the run with one line and exit code 2.
    The samples finished before it are kept, and so is one still running then; the same command
    then runs only the others."""
    tasks = ("niah_single_1", "vt")
    keys = plan_keys(RunPlan(tasks, (2048,), 4))
    answers = oracle_answers(0, keys)
    samples = {k: RulerGenerator(ByteCounter(), seed=0).sample(*k) for k in keys}
    prompt = {k: raw_render(s.input, s.answer_prefix) for k, s in samples.items()}
    slow, bad = prompt[("niah_single_1", 2048, 0)], prompt[("niah_single_1", 2048, 1)]
    refused = threading.Event()
    seen: list = []
    oracle = _oracle_transport(answers, False, seen)

    def handler(request: httpx.Request) -> httpx.Response:
        text = json.loads(request.content)["prompt"] if request.url.path != "/v1/models" else None
        if text == bad:
            refused.set()
            return httpx.Response(
                400, json={"error": {"message": "prompt too long", "code": "context_length_exceeded"}}
            )
        if text == slow:  # still running when the run stops
            refused.wait(5)
            time.sleep(0.2)
        return oracle.handle_request(request)

    monkeypatch.setattr(
        clients, "HTTPClient", partial(clients.HTTPClient, transport=httpx.MockTransport(handler))
    )
    argv = _on_server(tasks, tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        "longctx ruler: error: POST /v1/completions -> HTTP 400: prompt too long; "
        f"the samples done are kept in {tmp_path}, and the same command resumes"
    )
    kept = {(r["task"], r["index"]) for r in read_rows(tmp_path / "results.jsonl")}
    assert ("niah_single_1", 0) in kept and ("niah_single_1", 1) not in kept
    seen.clear()
    monkeypatch.setattr(clients, "HTTPClient", partial(clients.HTTPClient, transport=oracle))
    assert main(argv) == 0
    assert sorted(b["prompt"] for b in seen) == sorted(prompt[k] for k in keys if (k[0], k[2]) not in kept)
    assert len(read_rows(tmp_path / "results.jsonl")) == len(keys)


def test_a_stopping_run_does_not_wait_out_the_retries_of_others(tmp_path):
    """When a sample fails for good, a request waiting to retry (its server answered 503) gives up
    at once instead of sleeping out its backoff: the run stops well before the 10-20 s it would sleep."""
    keys = plan_keys(RunPlan(("niah_single_1",), (2048,), 2))
    gen = RulerGenerator(ByteCounter(), seed=0)
    s0 = gen.sample(*keys[0])
    first = raw_render(s0.input, s0.answer_prefix)
    busy = threading.Event()

    def handler(request: httpx.Request) -> httpx.Response:
        if json.loads(request.content)["prompt"] == first:
            busy.set()
            return httpx.Response(503, json={"error": {"message": "busy"}})
        busy.wait(5)
        return httpx.Response(400, json={"error": {"message": "prompt too long"}})

    retry = clients.Retry(attempts=1, base_s=20.0)
    client = clients.HTTPClient(
        "http://srv", model_name="m", transport=httpx.MockTransport(handler), retry=retry
    )
    t0 = time.monotonic()
    with pytest.raises(clients.ClientError, match="HTTP 400: prompt too long"):
        run_samples(gen, client, keys, tmp_path, make_request(gen), concurrency=2)
    assert time.monotonic() - t0 < 5


def test_a_rerun_under_another_model_or_setting_is_refused(tmp_path, monkeypatch, capsys):
    """OUT/results.jsonl.run.json records what the rows came from (the served model, tokenizer, seed,
    prompt form, output scale): a rerun into OUT under any other stops with one line naming what differs
    (exit 2) before anything is asked; other tasks, lengths or samples resume. A directory from before
    records resumes with one warning, and is recorded from then on."""
    tasks = ("niah_single_1", "vt")
    keys = plan_keys(RunPlan(tasks, (2048,), 3))
    name, seen = ["served"], []
    oracle = _oracle_transport(oracle_answers(0, keys), False, seen)

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": name[0]}]})
        return oracle.handle_request(request)

    monkeypatch.setattr(
        clients, "HTTPClient", partial(clients.HTTPClient, transport=httpx.MockTransport(handler))
    )
    argv = ["ruler", "--base-url", "http://srv", "--tasks", ",".join(tasks), "--lengths", "2k"]
    argv += ["--samples", "2", "--seed", "0", "--out", str(tmp_path)]
    assert main(argv) == 0
    record = json.loads((tmp_path / "results.jsonl.run.json").read_text())
    assert record == {"model": "served", "via": "server", "tokenizer": "bytes", "seed": 0, "form": "raw",
                      "max_new_tokens_scale": 1.0}  # fmt: skip
    assert json.loads((tmp_path / "results.json").read_text())["seed"] == 0
    capsys.readouterr()
    for served, extra, differs in [
        ("other", [], 'model "served" (now "other")'),
        ("served", ["--seed", "1"], "seed 0 (now 1)"),
        ("served", ["--chat"], 'form "raw" (now "chat")'),
        ("served", ["--max-new-tokens-scale", "2"], "max_new_tokens_scale 1.0 (now 2.0)"),
    ]:
        name[0] = served
        seen.clear()
        assert main([*argv, *extra]) == 2
        path = tmp_path / "results.jsonl"
        assert capsys.readouterr().err.strip() == (
            f"longctx ruler: error: {path} holds rows written with other settings: {differs}; "
            f"give another --out for this run (or remove {path} to start over)"
        )
        assert seen == [] and len(read_rows(path)) == 4
    name[0] = "served"
    assert main([*argv, "--samples", "3", "--tasks", "vt"]) == 0  # (the samples to run may change)
    assert len(seen) == 1 and len(read_rows(tmp_path / "results.jsonl")) == 5
    (tmp_path / "results.jsonl.run.json").unlink()  # (a directory written before records were kept)
    name[0] = "other"
    capsys.readouterr()
    assert main(argv) == 0 and capsys.readouterr().err.count("does not record the model and settings") == 1
    assert json.loads((tmp_path / "results.jsonl.run.json").read_text())["model"] == "other"
    assert main(argv) == 0 and "does not record" not in capsys.readouterr().err


def test_the_settings_check_reads_a_results_file_only_to_its_first_row(tmp_path, monkeypatch):
    """`check_settings` asks whether OUT has rows; it read (and parsed) every row to learn that. Now it stops
    at the first: the lines after it are never parsed (bytes that are not even UTF-8 there stopped the old
    read with a UnicodeDecodeError). A missing, empty, blank or torn-only file still has no rows (no record
    needed), and a torn line before the first row is still passed over."""
    target, settings = tmp_path / "results.jsonl", {"model": "m", "seed": 0}
    parsed: list[object] = []
    loads = json.loads
    monkeypatch.setattr(jsonl.json, "loads", lambda text, **kw: parsed.append(text) or loads(text, **kw))
    assert jsonl.check_settings(target, settings)  # (no file)
    for text in (b"", b"\n  \n\n", b'{"task": "vt", "ind'):  # (no record: True only when it has no rows)
        target.write_bytes(text)
        assert jsonl.check_settings(target, settings)
    target.write_bytes(
        b'{"task": "vt", "ind\n\n{"task": "vt", "index": 0}\n' + b"\xff\xfe not a row\n" * 100_000
    )
    parsed.clear()
    assert not jsonl.check_settings(target, settings)  # (rows without a record)
    jsonl.record_settings(target, settings)
    assert jsonl.check_settings(target, settings)
    with pytest.raises(LongctxError, match=r"seed 0 \(now 1\)"):
        jsonl.check_settings(target, {**settings, "seed": 1})
    assert not [t for t in parsed if b"not a row" in (t if isinstance(t, bytes) else t.encode())]


def test_a_damaged_results_file_or_record_is_read_past(tmp_path):
    """A results file with a line that is not UTF-8 failed in read_rows' text decoder (a UnicodeDecodeError's
    traceback on resume, where `has_rows` passed over it), a line that is JSON but no object failed as an
    AttributeError (`row.get`), and a settings record that is not UTF-8 or not an object failed likewise:
    such lines are no rows, and such a record is none (the rows resume as unrecorded ones)."""
    keys = plan_keys(RunPlan(("vt",), (2048,), 3))
    answers = oracle_answers(0, keys)
    gen = RulerGenerator(ByteCounter(), seed=0)
    target = tmp_path / "results.jsonl"
    target.write_bytes(b"\xff\xfe damaged\n[1, 2]\n7\n")
    assert read_rows(target) == [] and not jsonl.has_rows(target)
    assert run_samples(gen, OracleClient(answers), keys[:1], tmp_path, make_request(gen)) == 1
    with target.open("ab") as f:
        f.write(b'{"task": "vt", "\xe9"}\n["not", "a row"]\n')
    assert [r["index"] for r in read_rows(target)] == [0]
    record = jsonl.settings_record(target)
    for damaged in (b"\xff", b'["seed"]', b"null"):
        record.write_bytes(damaged)
        assert not jsonl.check_settings(target, {"seed": 0})
    good = OracleClient(answers)
    assert run_samples(gen, good, keys, tmp_path, make_request(gen)) == 2 and good.calls == 2
    assert sorted(r["index"] for r in read_rows(target)) == [0, 1, 2]


def test_a_row_that_names_no_sample_is_read_past(tmp_path):
    """An object row without a task, or with a length, index or score of the wrong type (a foreign or
    hand-edited line), failed the resume and the report as a KeyError / TypeError: it is passed over."""
    from longctx.workloads.ruler_runner import read_results

    keys = plan_keys(RunPlan(("vt",), (2048,), 2))
    answers = oracle_answers(0, keys)
    gen = RulerGenerator(ByteCounter(), seed=0)
    target = tmp_path / "results.jsonl"
    junk = [
        {"seed": 0},
        {"task": "vt", "length": 2048, "seed": 0},
        {"task": 7, "length": 2048, "index": 0, "seed": 0},
        {"task": "vt", "length": "2048", "index": 0, "seed": 0},
        {"task": "vt", "length": 2048, "index": True, "seed": 0},
        {"task": "vt", "length": 2048, "index": 1, "seed": 0, "score": "high"},
    ]
    target.write_text("".join(json.dumps(r) + "\n" for r in junk))
    assert read_results(target) == []
    good = OracleClient(answers)
    assert run_samples(gen, good, keys, tmp_path, make_request(gen)) == 2 and good.calls == 2
    assert sorted(r["index"] for r in read_results(target)) == [0, 1]
    summary = write_report(tmp_path, {})
    assert summary["scores"]["vt"]["2048"] == 100.0 and summary["samples"]["vt"]["2048"] == 2


def test_the_embedded_engines_flags_are_part_of_the_record(tmp_path, monkeypatch, capsys):
    """With --model: the model directory, the device and the flags that change what the engine selects or
    stores; a run under others is refused before the model loads (not for HiSparse's cap: it moves KV)."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(tiny_config().to_hf_dict()))
    keys = plan_keys(RunPlan(("niah_single_1",), (2048,), 2))
    answers = oracle_answers(0, keys)
    engines: list[dict] = []

    class FakeEngineClient(OracleClient):
        def __init__(self, model_dir: str, **kw: object) -> None:
            super().__init__(answers)
            engines.append(kw)

    monkeypatch.setattr(clients, "EngineClient", FakeEngineClient)
    out = tmp_path / "out"
    argv = ["ruler", "--model", str(model), "--tasks", "niah_single_1", "--lengths", "2k", "--samples", "2"]
    argv += ["--seed", "0", "--device", "cpu", "--out", str(out)]
    assert main([*argv, "--kv-dtype", "bf16"]) == 0
    record = json.loads((out / "results.jsonl.run.json").read_text())
    assert record["model"] == str(model.resolve()) and record["via"] == "engine" and record["device"] == "cpu"
    assert record["kv_dtype"] == "bf16" and record["index_topk"] is None
    capsys.readouterr()
    assert main([*argv, "--kv-dtype", "fp8_e4m3"]) == 2
    assert 'kv_dtype "bf16" (now "fp8_e4m3"); give another --out' in capsys.readouterr().err
    assert main([*argv, "--kv-dtype", "bf16", "--index-topk", "8"]) == 2
    assert "index_topk null (now 8)" in capsys.readouterr().err
    assert len(engines) == 1  # no model was loaded for a refused run
    monkeypatch.setenv("LONGCTX_TOPK_LONG_DECODE", "0")  # an evaluation's selection A/B counts too
    assert main([*argv, "--kv-dtype", "bf16"]) == 2
    assert 'topk_long_decode null (now "0")' in capsys.readouterr().err
    monkeypatch.delenv("LONGCTX_TOPK_LONG_DECODE")
    assert main([*argv, "--kv-dtype", "bf16", "--hisparse-device-tokens", "512"]) == 0
    # run_samples itself refuses other settings too (under its lock, for callers other than the CLI)
    gen = RulerGenerator(ByteCounter(), seed=0)
    with pytest.raises(LongctxError, match=r'model ".*" \(now "/else"\)'):
        run_samples(gen, OracleClient(answers), keys, out, make_request(gen), settings={"model": "/else"})


def test_a_flag_equal_to_the_models_own_value_is_the_flag_left_out(tmp_path, monkeypatch, capsys):
    """The record compares the engine flags as they take effect: `--index-topk 16` on a model whose own
    index_topk is 16 was refused as other than a run that gave no flag (`index_topk null (now 16)`), and the
    other way round; likewise `--kv-dtype auto` (the engine's default), `model` where auto is the model dtype
    (the CPU), and `--kv-fp8-skip-layers none` on a model that keeps no layer out of fp8. A real difference is
    still refused, in the same words."""
    model = tmp_path / "model"
    model.mkdir()
    cfg = tiny_config(index_local_window=4)
    (model / "config.json").write_text(json.dumps(cfg.to_hf_dict()))
    answers = oracle_answers(0, plan_keys(RunPlan(("niah_single_1",), (2048,), 2)))
    monkeypatch.setattr(clients, "EngineClient", lambda model_dir, **kw: OracleClient(answers))
    argv = ["ruler", "--model", str(model), "--tasks", "niah_single_1", "--lengths", "2k", "--samples", "2"]
    argv += ["--seed", "0", "--device", "cpu", "--out", str(tmp_path / "out")]
    record = tmp_path / "out" / "results.jsonl.run.json"
    own = ["--index-topk", "16", "--index-local-window", "4", "--index-topk-long", "0"]
    own += ["--kv-dtype", "auto", "--kv-fp8-skip-layers", "none"]
    assert main(argv) == 0
    assert json.loads(record.read_text())["index_topk"] is None
    for flags in ([*own[:2]], own, ["--kv-dtype", "model"], [], own, own[2:4], []):
        capsys.readouterr()
        assert main([*argv, *flags]) == 0, (flags, capsys.readouterr().err)
        assert json.loads(record.read_text())["index_topk"] == (16 if "--index-topk" in flags else None)
    path = tmp_path / "out" / "results.jsonl"
    for flags, differs in [
        (["--index-topk", "8"], "index_topk null (now 8)"),
        (["--index-local-window", "0"], "index_local_window null (now 0)"),
        (["--kv-dtype", "bf16"], 'kv_dtype null (now "bf16")'),
        (["--kv-fp8-skip-layers", "1"], "kv_fp8_skip_layers null (now [1])"),
    ]:
        assert main([*argv, *flags]) == 2
        assert capsys.readouterr().err.strip().splitlines()[-1] == (
            f"longctx ruler: error: {path} holds rows written with other settings: {differs}; "
            f"give another --out for this run (or remove {path} to start over)"
        )
    assert main([*argv, *own[:2]]) == 0  # (recorded as given: 16)
    capsys.readouterr()
    assert main([*argv, "--index-topk", "8"]) == 2
    assert "index_topk 16 (now 8)" in capsys.readouterr().err
    # run_samples itself compares them so too (under its lock, for callers other than the CLI)
    gen = RulerGenerator(ByteCounter(), seed=0)
    keys = plan_keys(RunPlan(("niah_single_1",), (2048,), 2))
    settings = {**json.loads(record.read_text()), "index_topk": None}
    with pytest.raises(LongctxError, match=r"index_topk 16 \(now null\)"):
        run_samples(gen, OracleClient(answers), keys, tmp_path / "out", make_request(gen), settings=settings)
    effective = cli_args.settings_in_effect(str(model))
    run_samples(gen, OracleClient(answers), keys, tmp_path / "out", make_request(gen), 1, settings, effective)


def test_a_refused_rerun_writes_no_dump(tmp_path, monkeypatch, capsys):
    """A rerun into OUT under other settings is refused before it writes anything: --dump-dir's samples were
    written first, and the run refused after. A rerun under the same settings dumps them as before."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(tiny_config().to_hf_dict()))
    answers = oracle_answers(0, plan_keys(RunPlan(("niah_single_1",), (2048,), 2)))
    monkeypatch.setattr(clients, "EngineClient", lambda model_dir, **kw: OracleClient(answers))
    argv = ["ruler", "--model", str(model), "--tasks", "niah_single_1", "--lengths", "2k", "--samples", "2"]
    argv += ["--seed", "0", "--device", "cpu", "--out", str(tmp_path / "out")]
    assert main([*argv, "--kv-dtype", "bf16"]) == 0
    dump = tmp_path / "dump"
    capsys.readouterr()
    assert main([*argv, "--kv-dtype", "fp8_e4m3", "--dump-dir", str(dump)]) == 2
    assert "holds rows written with other settings" in capsys.readouterr().err
    assert not dump.exists()
    assert main([*argv, "--kv-dtype", "bf16", "--dump-dir", str(dump)]) == 0
    assert len(read_rows(dump / "samples.jsonl")) == 2


def test_cli_dump_only(tmp_path):
    assert (
        main(
            ["ruler", "--tasks", "fwe,qa_1", "--lengths", "4k", "--samples", "3", "--dump-dir", str(tmp_path)]
        )
        == 0
    )
    rows = read_rows(tmp_path / "samples.jsonl")
    assert [(r["task"], r["index"]) for r in rows] == [
        ("fwe", 0),
        ("fwe", 1),
        ("fwe", 2),
        ("qa_1", 0),
        ("qa_1", 1),
        ("qa_1", 2),
    ]
    assert all(0.98 * 4096 <= r["prompt_tokens"] + r["max_new_tokens"] <= 4096 for r in rows)


def test_cli_indices_run_those_samples(tmp_path):
    """--indices picks the samples (any order, in place of 0..N-1), each the same sample as in a full run,
    and a later run of more indices adds only the new ones."""
    argv = ["ruler", "--tasks", "niah_single_1,vt", "--lengths", "4k", "--concurrency", "2"]
    assert main([*argv, "--indices", "5,1,3", "--dump-dir", str(tmp_path / "a")]) == 0
    rows = read_rows(tmp_path / "a" / "samples.jsonl")
    assert [(r["task"], r["index"]) for r in rows] == [
        ("niah_single_1", 5), ("niah_single_1", 1), ("vt", 5), ("vt", 1), ("niah_single_1", 3), ("vt", 3),
    ]  # fmt: skip
    assert main([*argv, "--samples", "6", "--dump-dir", str(tmp_path / "b")]) == 0
    full = {(r["task"], r["index"]): r for r in read_rows(tmp_path / "b" / "samples.jsonl")}
    assert all(full[(r["task"], r["index"])] == r for r in rows)
    assert main([*argv, "--indices", "1,0", "--dump-dir", str(tmp_path / "a")]) == 0
    more = read_rows(tmp_path / "a" / "samples.jsonl")
    assert [(r["task"], r["index"]) for r in more[len(rows) :]] == [("niah_single_1", 0), ("vt", 0)]


# ---- the real engine ---------------------------------------------------------------------------


def _engine_available() -> bool:
    try:
        import longctx.checkpoint.init_random  # noqa: F401
        import longctx.engine.engine  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.skipif(not _engine_available(), reason="longctx.engine.engine or init-model not built yet")
def test_ruler_through_the_real_engine(tmp_path):
    model = tmp_path / "model"
    assert main(["init-model", "--config", "tiny", "--out", str(model)]) == 0
    out = tmp_path / "out"
    argv = ["ruler", "--model", str(model), "--tasks", "niah_single_1", "--lengths", "1k", "--samples", "2"]
    argv += ["--out", str(out), "--device", "cpu", "--max-new-tokens-scale", "0.125", "--concurrency", "2"]
    assert main(argv) == 0
    rows = read_rows(out / "results.jsonl")
    assert len(rows) == 2
    assert all(0.98 * 1024 <= r["prompt_tokens"] + 16 <= 1024 for r in rows)
    assert all(r["completion_tokens"] is not None and r["completion_tokens"] <= 16 for r in rows)
    summary = json.loads((out / "results.json").read_text())
    assert summary["samples"]["niah_single_1"]["1024"] == 2
    assert Path(out / "ruler.png").exists()


def test_plan_takes_tasks_in_turns_a_batch_at_a_time() -> None:
    keys = plan_keys(RunPlan(("niah_single_1", "vt"), (2048, 4096), 5, concurrency=2))
    assert len(keys) == len(set(keys)) == 2 * 2 * 5
    assert keys[:6] == [
        ("niah_single_1", 2048, 0), ("niah_single_1", 2048, 1), ("vt", 2048, 0), ("vt", 2048, 1),
        ("niah_single_1", 2048, 2), ("niah_single_1", 2048, 3),
    ]  # fmt: skip
    assert [k[1] for k in keys] == sorted(k[1] for k in keys)  # shortest lengths first


def _documents_transport(answers: dict[tuple[str, str], str], seen: list) -> httpx.MockTransport:
    """A server with the long-document endpoints: upload, ask (answers keyed by (document, question)),
    delete; `seen` records each call's method and path."""
    docs: dict[str, str] = {}

    def handler(request: httpx.Request) -> httpx.Response:
        path = request.url.path
        seen.append((request.method, path))
        if path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "oracle-model"}]})
        if request.method == "DELETE":
            docs.pop(path.rsplit("/", 1)[1])
            return httpx.Response(200, json={"deleted": True})
        body = json.loads(request.content)
        if path == "/v1/documents":
            doc_id = f"doc-{len(seen)}"
            docs[doc_id] = body["text"]
            return httpx.Response(200, json={"id": doc_id, "tokens": len(body["text"])})
        doc_id = path.split("/")[3]
        assert body["temperature"] == 0.0  # greedy, as every workload request
        text = answers[(docs[doc_id], body["question"])]
        choice = {"message": {"role": "assistant", "content": text}, "finish_reason": "stop"}
        return httpx.Response(
            200, json={"choices": [choice], "usage": {"prompt_tokens": 9, "completion_tokens": 2}}
        )

    return httpx.MockTransport(handler)


def test_documents_form_asks_the_servers_document_endpoints(tmp_path, monkeypatch):
    """`longctx ruler --documents`: each niah sample's haystack is uploaded (POST /v1/documents), its
    question asked on it (/ask) and the document unpinned (DELETE); no RULER instruction line is sent."""
    from longctx.workloads.ruler_tasks import split_niah

    tasks = ("niah_single_1", "niah_multivalue")
    keys = plan_keys(RunPlan(tasks, (2048,), 2))
    gen = RulerGenerator(ByteCounter(), seed=3, render=lambda t, p: "\n\n".join(split_niah(t)))
    answers = {split_niah(s.input): " ".join(s.outputs) for s in (gen.sample(*k) for k in keys)}
    assert all("memorize" not in d and q.startswith("What ") for d, q in answers)
    seen: list = []
    monkeypatch.setattr(
        clients, "HTTPClient", partial(clients.HTTPClient, transport=_documents_transport(answers, seen))
    )
    out = tmp_path / "out"
    argv = ["ruler", "--base-url", "http://server:1", "--tasks", ",".join(tasks), "--lengths", "2k",
            "--samples", "2", "--seed", "3", "--documents", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    summary = json.loads((out / "results.json").read_text())
    assert (
        all(v == 100.0 for t in tasks for v in summary["scores"][t].values())
        and summary["form"] == "documents"
    )
    methods = [m for m, p in seen if p != "/v1/models"]
    assert methods.count("POST") == 2 * len(keys) and methods.count("DELETE") == len(keys)
    # non-niah tasks have no document form; --documents and --chat exclude each other (exit 2, one line)
    assert main(["ruler", "--base-url", "http://x", "--tasks", "vt", "--lengths", "2k", "--documents",
                 "--out", str(tmp_path / "v")]) == 2  # fmt: skip
    with pytest.raises(SystemExit):
        main(["ruler", "--base-url", "http://x", "--chat", "--documents", "--out", str(tmp_path / "v")])


def test_documents_form_embedded_prompt_is_the_servers(tmp_path):
    """With --model the documents form renders exactly the tokens /v1/documents + /ask build."""
    from longctx.checkpoint.chat_template import DOCUMENT_QUESTION_SEPARATOR
    from longctx.server.text import TextCodec
    from longctx.workloads.ruler_cli import _documents_renderer
    from longctx.workloads.ruler_tasks import split_niah

    wip = Path(__file__).resolve().parents[1] / "models-shipped" / "retrieval-wip"
    codec = TextCodec(str(wip))
    head, tail = codec.document_frame()
    render = _documents_renderer(["niah_single_2"], str(wip))
    sample = RulerGenerator(ByteCounter(), seed=1, render=render).sample("niah_single_2", 1500, 0)
    document, question = split_niah(sample.input)
    served = codec.encode(head + document) + codec.encode(DOCUMENT_QUESTION_SEPARATOR + question + tail)
    assert codec.encode(render(sample.input, sample.answer_prefix)) == served


def test_cli_kv_dtype_is_checked_before_the_model_loads(capsys, tmp_path):
    """`longctx ruler --model DIR --kv-dtype X`: an unknown X is one error line (exit 2), nothing written."""
    wip = Path(__file__).resolve().parents[1] / "models-shipped" / "retrieval-wip"
    assert main(["ruler", "--model", str(wip), "--kv-dtype", "fp4", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert (
        err
        == "longctx ruler: error: --kv-dtype 'fp4': must be one of auto, model, bf16, fp8_e4m3 (or fp8, bfloat16)"
    )
    assert not (tmp_path / "o").exists()


def test_cli_lengths_beyond_the_model_are_one_line(capsys, tmp_path):
    """A length over what the model takes (its max_position_embeddings here) is refused before the model
    loads (a sample past the model's positions ran, and scored)."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(tiny_config(max_position_embeddings=4096).to_hf_dict()))
    assert main(["ruler", "--model", str(model), "--lengths", "2k,8k", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"longctx ruler: error: --lengths 8192: is more than the 4096 tokens {model} takes"
    assert not (tmp_path / "o").exists()
