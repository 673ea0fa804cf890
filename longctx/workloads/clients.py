"""Model clients for the workloads: the embedded engine, or any OpenAI-compatible server.

Both take a list of `GenRequest`s and return `GenResult`s in order. The embedded engine gets
whole batches (one `Engine.generate` call; its scheduler batches and shares prefixes); an HTTP
client is `parallel`: the caller sends one request per thread from a pool (`run_parallel`), and it
retries what a busy or restarting server could not take just then (`Retry`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import email.utils
import itertools
import logging
import random
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from longctx.errors import LongctxError

log = logging.getLogger(__name__)
J = TypeVar("J")
R = TypeVar("R")


class ClientError(LongctxError):
    """The model could not be reached or answered with an error."""


@dataclass(frozen=True)
class Retry:
    """When `HTTPClient` sends a request again: after a dropped connection or a connect timeout (not
    after waiting out its timeout for an answer: the server has the request), or an HTTP
    status in `statuses` (429: the server's queue is full; 503: it is draining, restarting or has no
    engine; 502 / 504: a proxy in front of it lost it). Other statuses are the request's fault and
    never retried. Up to `attempts` retries, retry n (from 0) after base_s * 2**n seconds (a random
    half to all of it, so parallel requests spread out) up to cap_s, or the server's Retry-After where
    that is longer, up to cap_s (a least wait: longctx's server says 1 s, which must not cut a wait
    for a long prefill or a restart to 10 s in all).
    A 429 after the server has answered other requests of the client since the last try starts the
    count again: the server is busy, not stuck, and a request that keeps losing the freed queue slots
    to newer ones must not fail for it (it waits at most until the others are done).
    A connection refused before the server has answered this client at all is retried
    `first_contact_attempts` times only (a few seconds): nothing listens at that address.
    A retry is told (`HTTPClient`'s `tell`) once a request's waits since the count last started add up to
    `quiet_s`: a server down for minutes must not look like a hang, while a blip or a busy server's quick
    429s go untold."""

    attempts: int = 10  # at most about 5 minutes of waiting in all
    # a connection refused before the server ever answered this client: nothing listens at that address (a
    # typo, a server not started; longctx's server answers 503 while it loads), so a few seconds, not minutes
    first_contact_attempts: int = 5  # (15-31 s: a server started beside the client has bound its port)
    base_s: float = 1.0
    cap_s: float = 60.0
    quiet_s: float = 5.0
    statuses: frozenset[int] = frozenset({429, 502, 503, 504})

    def delay(self, attempt: int, retry_after: str | None = None) -> float:
        """Seconds to wait before retry number `attempt` (0-based)."""
        d = min(self.cap_s, self.base_s * 2**attempt)
        wait = random.uniform(d / 2, d)
        told = _seconds(retry_after)
        return wait if told is None else min(self.cap_s, max(wait, told))


def _seconds(retry_after: str | None) -> float | None:
    """A Retry-After header's wait (delta-seconds or an HTTP date); None when absent or unreadable."""
    if not retry_after:
        return None
    try:
        return max(0.0, float(retry_after))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(retry_after)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


@dataclass(frozen=True)
class GenRequest:
    """One greedy generation. `prompt` is the raw text; `chat_user`, when set, is sent as the
    user message of a chat request instead; `document`, when set, as (document, question) to a
    server's long-document endpoints (upload, ask, delete); `prompt_ids` are its token ids when known."""

    prompt: str
    max_new_tokens: int
    chat_user: str | None = None
    prompt_ids: tuple[int, ...] | None = None
    document: tuple[str, str] | None = None


@dataclass(frozen=True)
class GenResult:
    text: str
    latency_s: float
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    finish_reason: str | None = None


def run_parallel(
    jobs: Iterable[J],
    call: Callable[[J], R],
    done: Callable[[J, R], None],
    workers: int,
    stop: Callable[[], None] = lambda: None,
) -> None:
    """`call(job)` for every job on `workers` threads (a parallel client's requests), `done(job,
    result)` on this thread as each finishes. Jobs are drawn a few ahead of the workers, never all at
    once (a million-token RULER sample is megabytes of text). When a call fails (or Ctrl-C), the jobs
    not started are dropped, `stop()` is called (`Client.stop`: calls waiting to retry give up), the
    running ones finish and are done (so their answers are kept), and the error is raised."""
    pending = iter(jobs)
    inflight: dict[Future, J] = {}
    with ThreadPoolExecutor(max_workers=workers) as pool:
        try:
            while True:
                for job in itertools.islice(pending, workers + 1 - len(inflight)):
                    inflight[pool.submit(call, job)] = job
                if not inflight:
                    break
                finished, _ = wait(inflight, return_when=FIRST_COMPLETED)
                for fut in finished:
                    done(inflight.pop(fut), fut.result())
        except BaseException:
            for fut in inflight:
                fut.cancel()
            stop()
            for fut in wait(inflight).done:  # (the pool would wait for them anyway)
                if not fut.cancelled() and fut.exception() is None:
                    done(inflight[fut], fut.result())
            raise


class Client:
    """Base class: `generate` a batch; `parallel` clients take concurrent single requests."""

    parallel = False
    label = "model"

    def generate(self, reqs: list[GenRequest]) -> list[GenResult]:
        raise NotImplementedError

    def stop(self) -> None:
        """The run is stopping: requests waiting to be sent again give up, now and for the rest of the
        client's life (those being answered finish)."""

    def close(self) -> None:
        pass


class EngineClient(Client):
    """The embedded `longctx.Engine` (built lazily so argument errors surface before loading)."""

    parallel = False

    def __init__(
        self, model_dir: str | Path, hisparse_device_tokens: int | None = None, **engine_kw: Any
    ) -> None:
        from longctx import Engine

        kw = dict(engine_kw)
        if hisparse_device_tokens is not None:
            kw["hisparse_device_tokens"] = hisparse_device_tokens
        self.label = str(model_dir)
        self.engine = Engine(str(model_dir), **kw)

    def generate(self, reqs: list[GenRequest]) -> list[GenResult]:
        if not reqs:
            return []
        prompts: list[Any] = [list(r.prompt_ids) if r.prompt_ids is not None else r.prompt for r in reqs]
        t0 = time.perf_counter()
        comps = self.engine.generate(
            prompts, max_new_tokens=max(r.max_new_tokens for r in reqs), temperature=0.0, top_p=1.0, top_k=0
        )
        dt = time.perf_counter() - t0
        out = []
        for r, c in zip(reqs, comps):
            out.append(
                GenResult(
                    text=c.text,
                    latency_s=dt,  # a batch finishes together as far as the caller can tell
                    prompt_tokens=len(r.prompt_ids) if r.prompt_ids is not None else None,
                    completion_tokens=len(c.token_ids),
                    finish_reason=getattr(c, "finish_reason", None),
                )
            )
        return out

    def close(self) -> None:
        self.engine.close()


def _one_line(text: str, limit: int = 200) -> str:
    line = " ".join(str(text).split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _error_text(r: Any) -> str:
    """An error response's message: OpenAI's {"error": {"message"}}, vLLM's and SGLang's {"message"},
    FastAPI's {"detail"}, else the body (or the status's reason)."""
    try:
        body = r.json()
    except ValueError:
        body = None
    if isinstance(body, dict):
        err = body.get("error")
        msg = err.get("message") if isinstance(err, dict) else err
        msg = msg or body.get("message") or body.get("detail")
        if msg:
            return _one_line(str(msg))
    return _one_line(r.text) or r.reason_phrase


class HTTPClient(Client):
    """An OpenAI-compatible server: /v1/completions or /v1/chat/completions, plus longctx's
    long-document endpoints (POST /v1/documents, POST /v1/documents/{id}/ask) when it has them."""

    parallel = True

    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        model_name: str | None = None,
        chat: bool = False,
        timeout_s: float = 3600.0,
        transport: Any = None,  # an httpx transport (tests use httpx.MockTransport)
        retry: Retry = Retry(),
        sleep: Callable[[float], object] | None = None,  # (default: a wait that `stop` ends)
        tell: Callable[[str], object] = log.warning,  # a retry's line (`Retry.quiet_s`), e.g. onto stderr
    ) -> None:
        import httpx

        base = base_url.rstrip("/")
        if base.endswith("/v1"):
            base = base[:-3]
        if api_key and not api_key.isascii():  # (an HTTP header carries ASCII: httpx raised on it)
            raise ClientError("--api-key must be ASCII")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._httpx = httpx
        self.timeout_s = timeout_s
        self.http = httpx.Client(base_url=base, headers=headers, timeout=timeout_s, transport=transport)
        self.chat = chat
        self.label = base
        self._stopping = threading.Event()
        self.retry, self._sleep, self._tell = retry, sleep or self._stopping.wait, tell
        self._answered = 0  # requests the server has answered (a 429 meanwhile is a busy server)
        self._reached = False  # whether anything ever answered at base_url (any status)
        try:
            self.model = model_name or self._default_model()
        except BaseException:  # (no client to close it: the caller never gets one)
            self.http.close()
            raise

    def _default_model(self) -> str:
        """The first model the server lists, asked as every request is (`self.retry`): a server that
        cannot be reached is a ClientError, not a guess (the name is what a run records and resumes
        by). "default" for a server that answers but lists none (no /v1/models)."""
        r = self._send("GET", "/v1/models")
        try:
            data = r.json()["data"] if r.status_code == 200 else None
        except (ValueError, KeyError, TypeError):
            data = None
        if isinstance(data, list) and data and isinstance(data[0], dict) and data[0].get("id"):
            return str(data[0]["id"])
        return "default"

    def _send(self, method: str, path: str, body: dict | None = None, retries: int | None = None) -> Any:
        """The server's response, sent again as `self.retry` says while the server cannot take it
        (`retries` times at most, default `retry.attempts`); a ClientError once the retries are spent,
        or at once for a failure no retry mends (a bad URL)."""
        httpx = self._httpx
        retries = self.retry.attempts if retries is None else retries
        attempt, answered, waited = 0, self._answered, 0.0
        while True:
            spent = ""  # what the error adds once the retries are spent
            try:
                r = self.http.request(method, path, json=body)
            except httpx.ReadTimeout:  # (the server took the request: sent again, it would take as long)
                raise ClientError(
                    f"{method} {self.label}{path}: no answer in {self.timeout_s:g} s (a timeout is not retried)"
                ) from None
            except (httpx.TimeoutException, httpx.NetworkError, httpx.RemoteProtocolError) as e:
                why, retry_after = f"failed: {_one_line(str(e) or type(e).__name__)}", None
                if isinstance(e, httpx.ConnectError) and not self._reached:
                    retries = min(retries, self.retry.first_contact_attempts)
                    spent = f": nothing answers at {self.label}; is the server running?"
            except httpx.HTTPError as e:
                raise ClientError(f"{method} {self.label}{path} failed: {_one_line(str(e))}") from None
            else:
                self._reached = True
                if r.status_code not in self.retry.statuses:
                    self._answered += r.status_code < 400  # (a racing update lost costs one attempt)
                    return r
                why, retry_after = f"-> HTTP {r.status_code}: {_error_text(r)}", r.headers.get("retry-after")
                if r.status_code == 429 and self._answered != answered:
                    attempt, answered, waited = 0, self._answered, 0.0
            if attempt >= retries:
                raise ClientError(f"{method} {self.label}{path} {why} (retried {attempt} times){spent}")
            wait = self.retry.delay(attempt, retry_after)
            attempt, waited = attempt + 1, waited + wait
            say = self._tell if waited >= self.retry.quiet_s else log.debug
            say(f"{method} {self.label}{path} {why}; retry {attempt} of {retries} in {wait:.1f} s")
            self._sleep(wait)
            if self._stopping.is_set():
                raise ClientError(f"{method} {self.label}{path} {why} (not retried: the run is stopping)")

    def _post(self, path: str, body: dict, ok_missing: bool = False) -> dict | None:
        r = self._send("POST", path, body)
        if ok_missing and r.status_code in (404, 405, 501):
            return None
        if r.status_code >= 400:
            raise ClientError(f"POST {path} -> HTTP {r.status_code}: {_error_text(r)}")
        try:
            return r.json()
        except ValueError:
            raise ClientError(f"POST {path} returned non-JSON: {_one_line(r.text)}") from None

    @staticmethod
    def _result(body: dict, dt: float, chat: bool) -> GenResult:
        try:
            choice = body["choices"][0]
            text = choice["message"]["content"] if chat else choice["text"]
        except (KeyError, IndexError, TypeError):
            raise ClientError(f"unexpected response: {_one_line(str(body))}") from None
        usage = body.get("usage") or {}
        return GenResult(
            text=text or "",
            latency_s=dt,
            prompt_tokens=usage.get("prompt_tokens"),
            completion_tokens=usage.get("completion_tokens"),
            finish_reason=choice.get("finish_reason"),
        )

    def _one(self, r: GenRequest) -> GenResult:
        if r.document is not None:
            return self._ask(*r.document, r.max_new_tokens)
        t0 = time.perf_counter()
        common = {"model": self.model, "max_tokens": r.max_new_tokens, "temperature": 0.0, "top_p": 1.0}
        if self.chat:
            user = r.chat_user if r.chat_user is not None else r.prompt
            body = self._post(
                "/v1/chat/completions", {**common, "messages": [{"role": "user", "content": user}]}
            )
        else:
            body = self._post("/v1/completions", {**common, "prompt": r.prompt})
        assert body is not None
        return self._result(body, time.perf_counter() - t0, self.chat)

    def generate(self, reqs: list[GenRequest]) -> list[GenResult]:
        return [self._one(r) for r in reqs]

    def chat_messages(self, messages: list[dict], max_tokens: int) -> GenResult:
        """One chat completion for explicit messages."""
        t0 = time.perf_counter()
        body = self._post(
            "/v1/chat/completions",
            {"model": self.model, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0},
        )
        assert body is not None
        return self._result(body, time.perf_counter() - t0, True)

    def create_document(self, text: str) -> tuple[str, int | None] | None:
        """Upload a long document once; (id, tokens), or None when the server has no such endpoint."""
        body = self._post("/v1/documents", {"text": text}, ok_missing=True)
        if body is None:
            return None
        if "id" not in body:
            raise ClientError(f"POST /v1/documents returned no id: {_one_line(str(body))}")
        return str(body["id"]), body.get("tokens")

    def ask_document(self, doc_id: str, question: str, max_tokens: int) -> GenResult:
        """Ask a question about an uploaded document (the server reuses its prefilled KV); greedy, as
        every workload request is."""
        t0 = time.perf_counter()
        body = self._post(
            f"/v1/documents/{doc_id}/ask",
            {"question": question, "max_tokens": max_tokens, "temperature": 0.0, "top_p": 1.0},
        )
        assert body is not None
        return self._result(body, time.perf_counter() - t0, True)

    def delete_document(self, doc_id: str, retries: int | None = None) -> None:
        """Unpin an uploaded document (a missing one is not an error)."""
        r = self._send("DELETE", f"/v1/documents/{doc_id}", retries=retries)
        if r.status_code >= 400 and r.status_code != 404:
            raise ClientError(f"DELETE /v1/documents/{doc_id} -> HTTP {r.status_code}: {_error_text(r)}")

    @contextlib.contextmanager
    def document(self, text: str) -> Iterator[str | None]:
        """Upload a long document for the questions of a `with` block: its id (None when the server has
        no such endpoint), unpinned after the block. After a block that failed the unpin is tried once,
        and its own failure is left out: the block's error is the one to report, and a server that
        could not answer is unlikely to unpin (retrying would only delay that error)."""
        made = self.create_document(text)
        if made is None:
            yield None
            return
        try:
            yield made[0]
        except BaseException:
            with contextlib.suppress(ClientError):
                self.delete_document(made[0], retries=0)
            raise
        self.delete_document(made[0])

    def _ask(self, document: str, question: str, max_tokens: int) -> GenResult:
        """One question on its own document: upload, ask, unpin; the latency covers all three."""
        t0 = time.perf_counter()
        with self.document(document) as doc_id:
            if doc_id is None:
                raise ClientError(f"{self.label} has no /v1/documents endpoint")
            res = self.ask_document(doc_id, question, max_tokens)
        return dataclasses.replace(res, latency_s=time.perf_counter() - t0)

    def stop(self) -> None:
        self._stopping.set()

    def close(self) -> None:
        self.http.close()
