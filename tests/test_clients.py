"""The HTTP client against a busy or flaky server: what it retries, how long it waits, what it reports."""

from __future__ import annotations

import email.utils
import itertools
import time

import httpx
import pytest

from longctx.workloads.clients import ClientError, GenRequest, HTTPClient, Retry

OK = {"choices": [{"text": " 42", "finish_reason": "stop"}], "usage": {"completion_tokens": 1}}
MODELS = {"object": "list", "data": [{"id": "served", "object": "model"}]}


def client_on(
    replies: list,
    waits: list[float],
    retry: Retry | None = None,
    model_name: str | None = "m",
    told: list[str] | None = None,
) -> tuple[HTTPClient, list]:
    """An HTTPClient whose server answers each request with the next of `replies` (a Response, or an
    exception to raise, as a dropped connection does); its waits go to `waits` instead of sleeping, the
    retries it tells to `told`."""
    seen: list = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append((request.method, request.url.path))
        reply = replies.pop(0)
        if isinstance(reply, Exception):
            raise reply
        return reply

    client = HTTPClient(
        "http://srv",
        model_name=model_name,
        transport=httpx.MockTransport(handler),
        retry=retry or Retry(),
        sleep=waits.append,
        tell=(told if told is not None else []).append,
    )
    return client, seen


def error(status: int, message: str, code: str | None = None, **headers: str) -> httpx.Response:
    body = {"error": {"message": message, "type": "x", "param": None, "code": code}}
    return httpx.Response(status, json=body, headers=headers)


def test_busy_server_is_retried_with_backoff_and_retry_after():
    waits: list[float] = []
    replies = [
        error(429, "too many queued requests (limit 1); retry later", "queue_full"),
        error(503, "server is shutting down", "shutting_down"),
        error(429, "slow down", **{"Retry-After": "7"}),
        error(503, "busy", **{"Retry-After": "86400"}),  # capped
        httpx.Response(502, text="<html>bad gateway</html>"),
        httpx.Response(504),
        httpx.Response(200, json=OK),
    ]
    client, seen = client_on(replies, waits)
    assert client.generate([GenRequest("q", 8)])[0].text == " 42"
    assert len(seen) == 7
    assert 0.5 <= waits[0] <= 1 and 1 <= waits[1] <= 2  # base 1 s, doubling, a random half to all of it
    assert waits[2:4] == [7.0, 60.0]  # the server's Retry-After, at most cap_s
    assert 8 <= waits[4] <= 16 and 16 <= waits[5] <= 32


def test_retry_after_as_an_http_date():
    when = email.utils.formatdate(time.time() + 30, usegmt=True)
    assert 25 <= Retry().delay(0, when) <= 30
    assert 0.5 <= Retry().delay(0, "soon") <= 1  # unreadable: the backoff


def test_a_short_retry_after_does_not_shorten_the_backoff():
    """longctx's server sends Retry-After: 1 on every 429 / 503: the least wait, so ten retries still
    wait out a long prefill or a restart (minutes), not ten seconds."""
    assert Retry().delay(0, "1") == 1.0
    assert 8 <= Retry().delay(4, "1") <= 16
    assert 30 <= Retry().delay(9, "1") <= 60  # (the backoff's cap)


@pytest.mark.parametrize(
    "status, body, shown",
    [
        (400, {"error": {"message": "the prompt is too long", "code": "context_length_exceeded"}}, None),
        (401, {"error": "invalid api key"}, "invalid api key"),
        (404, {"object": "error", "message": "model `x` does not exist"}, None),  # vLLM / SGLang
        (422, {"detail": "field required"}, "field required"),  # FastAPI
        (413, None, "Request Entity Too Large"),  # an empty body: the status's reason
        (500, {"error": {"message": "engine failed"}}, None),  # the engine's own error: not a busy server
    ],
)
def test_other_errors_are_not_retried_and_are_one_line(status, body, shown):
    waits: list[float] = []
    reply = httpx.Response(status, json=body) if body is not None else httpx.Response(status)
    client, seen = client_on([reply], waits)
    with pytest.raises(ClientError) as e:
        client.generate([GenRequest("q", 8)])
    assert len(seen) == 1 and waits == []
    shown = shown or (body.get("error") or body)["message"]
    assert str(e.value) == f"POST /v1/completions -> HTTP {status}: {shown}"


def test_dropped_connections_and_timeouts_are_retried_then_reported():
    waits: list[float] = []
    retry = Retry(attempts=3)
    replies = [
        httpx.ConnectError("connection refused"),
        httpx.ConnectTimeout("timed out"),
        error(503, "busy"),
    ]
    replies.append(httpx.RemoteProtocolError("server disconnected without sending a response"))
    client, seen = client_on(replies, waits, retry)
    with pytest.raises(ClientError) as e:
        client.generate([GenRequest("q", 8)])
    assert len(seen) == 4 and len(waits) == 3
    assert str(e.value) == (
        "POST http://srv/v1/completions failed: server disconnected without sending a response "
        "(retried 3 times)"
    )
    # a server that stays busy: the same, with its last answer
    client, seen = client_on([error(503, "engine unavailable: stage 0 died", "engine_dead")] * 4, [], retry)
    with pytest.raises(
        ClientError, match=r"-> HTTP 503: engine unavailable: stage 0 died \(retried 3 times\)$"
    ):
        client.generate([GenRequest("q", 8)])
    assert len(seen) == 4


def test_a_request_unanswered_in_its_timeout_is_not_sent_again():
    """The server took it and worked on it for the whole timeout: sending it again would cost as long."""
    waits: list[float] = []
    client, seen = client_on([httpx.ReadTimeout("timed out"), error(503, "busy")], waits)
    with pytest.raises(ClientError) as e:
        client.generate([GenRequest("q", 8)])
    assert len(seen) == 1 and waits == []
    assert str(e.value).endswith("/v1/completions: no answer in 3600 s (a timeout is not retried)")


def test_a_full_queue_alone_is_retried_a_bounded_number_of_times():
    """(While the server answers nothing else: with answers in between it is busy, and waited for.)"""
    client, seen = client_on(
        [error(429, "too many queued requests", "queue_full")] * 4, [], Retry(attempts=3)
    )
    with pytest.raises(ClientError, match=r"HTTP 429: too many queued requests \(retried 3 times\)$"):
        client.generate([GenRequest("q", 8)])
    assert len(seen) == 4


def test_a_bad_url_is_not_retried():
    waits: list[float] = []
    client = HTTPClient("srv:8000", model_name="m", sleep=waits.append)  # (no scheme)
    with pytest.raises(ClientError, match="failed: Request URL has an unsupported protocol"):
        client.generate([GenRequest("q", 8)])
    assert waits == []


def test_the_served_model_is_asked_for_as_every_request_is():
    """Without a model name the client asks the server's /v1/models, retried as any request (a server
    starting up is waited for); one that cannot be reached is a ClientError, not the name "default" (which
    a run records: a resumed run then refused its own rows as another model's)."""
    waits: list[float] = []
    replies = [httpx.ConnectError("refused"), error(503, "loading"), httpx.Response(200, json=MODELS)]
    client, seen = client_on(replies, waits, model_name=None)
    assert client.model == "served" and seen == [("GET", "/v1/models")] * 3 and len(waits) == 2
    with pytest.raises(
        ClientError, match=r"^GET http://srv/v1/models failed: refused \(retried 2 times\): nothing"
    ):
        client_on([httpx.ConnectError("refused")] * 3, [], Retry(attempts=2), model_name=None)
    for listing in (httpx.Response(404), httpx.Response(200, json={"data": []}), httpx.Response(200)):
        assert client_on([listing], [], model_name=None)[0].model == "default"  # (answers, names none)


def test_document_calls_are_retried_too():
    waits: list[float] = []
    ask = {"choices": [{"message": {"content": "yes"}, "finish_reason": "stop"}]}
    replies = [
        error(429, "queue full"),
        httpx.Response(200, json={"id": "doc-1", "tokens": 5}),
        error(503, "busy"),
        httpx.Response(200, json=ask),
        httpx.ConnectError("reset"),
        httpx.Response(404),  # (the first DELETE did unpin it)
    ]
    client, seen = client_on(replies, waits)
    res = client.generate([GenRequest("q", 8, document=("the document", "a question?"))])
    assert res[0].text == "yes" and len(waits) == 3
    assert [m for m, _ in seen] == ["POST", "POST", "POST", "POST", "DELETE", "DELETE"]


def test_retries_are_told_once_their_waits_add_up():
    """A server that stays down is told, a line a retry once the waits add up to `Retry.quiet_s` (minutes of
    silence looked like a hang); a busy server's quick 429 or a blip is not, a long Retry-After is."""
    waits: list[float] = []
    told: list[str] = []
    client, _ = client_on([error(429, "queue full"), httpx.Response(200, json=OK)], waits, told=told)
    client.generate([GenRequest("q", 8)])
    assert len(waits) == 1 and told == []
    refused = [httpx.ConnectError("[Errno 111] Connection refused")] * 6
    client, _ = client_on(
        [httpx.Response(200, json=OK), *refused, httpx.Response(200, json=OK)], waits, told=told
    )
    client.generate([GenRequest("q", 8)])  # (reached once: the server went down since, and is waited for)
    waits.clear()
    client.generate([GenRequest("q", 8)])
    assert told == [
        f"POST http://srv/v1/completions failed: [Errno 111] Connection refused; retry {n} of 10 in {w:.1f} s"
        for n, (w, spent) in enumerate(zip(waits, itertools.accumulate(waits)), 1)
        if spent >= Retry.quiet_s
    ]
    assert 1 <= len(told) <= 4  # (the first two waits add up to 3 s at most, the six to 31.5 s at least)
    told.clear()
    client, _ = client_on(
        [error(429, "queue full", **{"retry-after": "30"}), httpx.Response(200, json=OK)], [], told=told
    )
    client.generate([GenRequest("q", 8)])
    assert told == ["POST http://srv/v1/completions -> HTTP 429: queue full; retry 1 of 10 in 30.0 s"]


def test_a_failed_question_unpins_its_document_once_and_reports_itself():
    """(Unpinning after a failure is tried once: against a server that is down, retrying it would
    only add minutes before the question's own error, which a failed unpin must not replace.)"""
    waits: list[float] = []
    replies = [httpx.Response(200, json={"id": "doc-1"}), error(400, "question too long"), error(503, "busy")]
    client, seen = client_on(replies, waits)
    with pytest.raises(ClientError, match=r"^POST /v1/documents/doc-1/ask -> HTTP 400: question too long$"):
        client.generate([GenRequest("q", 8, document=("the document", "a question?"))])
    assert [m for m, _ in seen] == ["POST", "POST", "DELETE"] and waits == []


def test_nothing_listening_at_the_url_fails_in_seconds_not_minutes():
    """A connection refused before anything ever answered at the URL (a typo, no server started) took the
    whole retry budget, about 5 minutes, to fail: now `Retry.first_contact_attempts` retries (15-31 s), and
    the error says nothing answers there. Once the server has answered, a refused connection (a restart) is
    waited for as long as before; a server that answers 503 while it loads is waited for from the start."""
    waits: list[float] = []
    refused = httpx.ConnectError("[Errno 111] Connection refused")
    client, seen = client_on([refused] * 11, waits)
    with pytest.raises(ClientError) as e:
        client.generate([GenRequest("q", 8)])
    assert len(seen) == 6 and len(waits) == 5 and 15.5 <= sum(waits) <= 31
    assert str(e.value) == (
        "POST http://srv/v1/completions failed: [Errno 111] Connection refused (retried 5 times): nothing "
        "answers at http://srv; is the server running?"
    )
    waits.clear()
    client, seen = client_on(
        [httpx.Response(200, json=OK), *[refused] * 8, httpx.Response(200, json=OK)], waits
    )
    client.generate([GenRequest("q", 8)])
    assert client.generate([GenRequest("q", 8)])[0].text and len(waits) == 8
    waits.clear()
    client, seen = client_on(
        [*[error(503, "loading")] * 3, *[refused] * 7, httpx.Response(200, json=OK)], waits
    )
    assert client.generate([GenRequest("q", 8)])[0].text and len(waits) == 10


def test_a_client_whose_model_lookup_fails_closes_its_connections():
    """The served-model lookup runs in the constructor: when it fails the caller gets no client to close,
    so the constructor closes its own."""
    closed: list[bool] = []

    class Transport(httpx.MockTransport):
        def close(self) -> None:
            closed.append(True)

    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused")

    with pytest.raises(ClientError, match="refused"):
        HTTPClient("http://srv", transport=Transport(refuse), retry=Retry(attempts=2), sleep=lambda s: None)
    assert closed == [True]
