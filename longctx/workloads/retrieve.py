"""Repository-scale code retrieval: one packed repository, many questions, one prefill.

The packed repository is the shared prefix of every prompt and the question comes after it,
so the context is prefilled once and reused:
- embedded engine: the prefix's token ids are computed once and every request starts with
  exactly those ids, which the engine's prefix cache matches; the first question runs alone so
  later ones find the prefix already cached;
- server: the repository is uploaded once with POST /v1/documents and each question goes to
  POST /v1/documents/{id}/ask; a server without those endpoints gets chat completions that all
  begin with the same text (what prefix-caching servers reuse).
"""

from __future__ import annotations

import contextlib
import json
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from longctx.errors import LongctxError
from longctx.workloads.clients import Client, GenRequest, GenResult, HTTPClient, run_parallel
from longctx.workloads.jsonl import (
    Effective,
    claim_settings,
    open_append,
    read_rows,
    settings_record,
    sole_writer,
    temp_file,
    write_whole,
)
from longctx.workloads.repo_pack import Pack
from longctx.workloads.tokens import TokenCounter

QUESTION = "\n\nQuestion about the repository above: {query}\nAnswer (cite the paths of the files you use):"
ASK = "{query}\nCite the paths of the files you use."


class QueryFileError(LongctxError):
    """A queries file that cannot be read."""


def read_queries(path: str | Path) -> list[dict]:
    """Rows of a JSONL file, each with a "query" (or "question") string; other keys are kept."""
    p = Path(path)
    if not p.is_file():
        raise QueryFileError(f"no queries file {path}")
    try:
        text = p.read_text(encoding="utf-8-sig")  # (a byte order mark, as some editors write, is no row)
    except UnicodeDecodeError as e:
        raise QueryFileError(f"{path} is not valid UTF-8 (byte {e.start})") from None
    rows = []
    for i, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise QueryFileError(f"{path}:{i}: not JSON ({e.msg})") from None
        if isinstance(row, str):
            row = {"query": row}
        if not isinstance(row, dict):
            raise QueryFileError(f'{path}:{i}: expected an object with a "query"')
        taken = [k for k in RESULT_KEYS if k in row]
        if taken:  # (the answer row would overwrite it, and resuming could not tell such rows apart)
            raise QueryFileError(
                f'{path}:{i}: "{taken[0]}" is a field the answers file writes ({", ".join(RESULT_KEYS)}); '
                'rename it (e.g. "expected")'
            )
        q = row.get("query", row.get("question"))
        if not isinstance(q, str) or not q.strip():
            raise QueryFileError(f'{path}:{i}: no "query" string')
        try:  # (JSON may escape half a surrogate pair, "\\ud800": no text a tokenizer takes)
            q.encode("utf-8")
        except UnicodeEncodeError as e:
            raise QueryFileError(
                f"{path}:{i}: the query is not valid Unicode ({e.reason} at {e.start})"
            ) from None
        row = {k: v for k, v in row.items() if k != "question"}
        row["query"] = q
        rows.append(row)
    if not rows:
        raise QueryFileError(f"{path} has no queries")
    return rows


def cited_files(answer: str, paths: list[str]) -> list[str]:
    """Packed paths the answer mentions, in order of first mention.

    A path counts when it appears whole (not inside a longer path or name), or when the answer
    names just its file name and no other packed file has that name.
    """
    names: dict[str, list[str]] = {}
    for p in paths:
        names.setdefault(p.rsplit("/", 1)[-1], []).append(p)
    found: dict[str, int] = {}
    for p in paths:
        m = re.search(r"(?<![\w./-])" + re.escape(p) + r"(?![\w/-]|\.\w)", answer)
        if m is None and "/" in p and len(names[p.rsplit("/", 1)[-1]]) == 1:
            m = re.search(r"(?<![\w./-])" + re.escape(p.rsplit("/", 1)[-1]) + r"(?![\w/-]|\.\w)", answer)
        if m is not None:
            found[p] = m.start()
    return sorted(found, key=lambda p: found[p])


@dataclass(frozen=True)
class Prompting:
    """How a question becomes a prompt: `render(text)` wraps a user message (chat) or not."""

    render: Callable[[str], str] = lambda text: text

    def split(self, context: str, question: str) -> tuple[str, str]:
        """(shared prefix, per-question suffix) of the rendered prompt."""
        full = self.render(context + question)
        cut = full.find(context)
        if cut < 0:
            raise LongctxError("the chat template changes the message text; cannot share a prefix")
        return full[: cut + len(context)], full[cut + len(context) :]


def reserve_tokens(
    counter: TokenCounter, queries: list[dict], prompting: Prompting, max_new_tokens: int
) -> int:
    """Tokens to keep free after the packed repository: the longest question, the answer, a margin."""
    longest = max(counter.count(prompting.render(QUESTION.format(query=q["query"]))) for q in queries)
    return longest + max_new_tokens + 16


RESULT_KEYS = ("answer", "cited_files", "latency_s", "prompt_tokens", "completion_tokens")


def _asked(row: dict) -> str:
    """What a query row, or an answer row, asks: its query and the keys copied from the input."""
    return json.dumps({k: v for k, v in row.items() if k not in RESULT_KEYS}, sort_keys=True)


def answered_before(path: Path, queries: list[dict]) -> dict[int, dict]:
    """The rows an earlier run wrote to `path`, by the index of the query each answers (a query asked
    twice takes its rows in order); refuses a file that answers other queries."""
    unanswered: dict[str, list[int]] = {}
    for i, q in enumerate(queries):
        unanswered.setdefault(_asked(q), []).append(i)
    found = {}
    for row in read_rows(path):
        left = unanswered.get(_asked(row))
        if not left:
            raise LongctxError(
                f"{path} answers queries not in this queries file ({_asked(row)[:80]}); "
                "give another --out or remove it"
            )
        found[left.pop(0)] = row
    return found


def lock_file(out: Path) -> Path:
    """The lock a run into `out` holds while it writes there."""
    return out.with_name(f".{out.name}.lock")


def files_written(out: Path) -> list[Path]:
    """Every file a run into `out` writes: the answers, their lock and settings record, and the temporary
    files the answers and record are replaced through. Packing leaves them out where --repo holds them:
    the two halves of a resumed run would be asked over different repositories (the second's with the
    first's answers in it)."""
    record = settings_record(out)
    return [out, lock_file(out), record, temp_file(out), temp_file(record)]


def run_retrieve(
    pack: Pack,
    queries: list[dict],
    client: Client,
    counter: TokenCounter,
    out_path: str | Path,
    max_new_tokens: int = 512,
    concurrency: int = 4,
    prompting: Prompting | None = None,
    settings: dict[str, Any] | None = None,
    effective: Effective | None = None,
) -> dict:
    """Answer every query over the packed repository; write JSONL rows; return a summary.

    Rows are appended as answers finish, so a run that stops keeps them; a rerun into the same file
    answers only the queries it does not answer yet. At the end the file holds every row in the
    input order. `settings` (what the answers depend on besides the queries: the model, the repository,
    packing and engine flags) are recorded beside the file, and a rerun under other ones is refused
    before anything is asked: it would mix two models' answers in one file (compared as they take effect,
    with `effective`: `jsonl.check_settings`)."""
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    with sole_writer(lock_file(out), out):  # (a second run into it is refused)
        if settings is not None:
            claim_settings(out, settings, "longctx retrieve", effective)
        results = _answer_all(
            pack, queries, client, counter, out, max_new_tokens, concurrency, prompting or Prompting()
        )
    lat = [r["latency_s"] for r in results.values()]
    return {
        "queries": len(queries),
        "mean_latency_s": sum(lat) / len(lat),
        "files_packed": len(pack.files),
        "files_skipped": len(pack.skipped),
        "skipped_by_reason": pack.skipped_by_reason(),
        "ignored": pack.ignored,
        "context_tokens": pack.tokens,
        "prompt_tokens": sum(r["prompt_tokens"] or 0 for r in results.values()),
        "completion_tokens": sum(r["completion_tokens"] or 0 for r in results.values()),
    }


def _answer_all(
    pack: Pack,
    queries: list[dict],
    client: Client,
    counter: TokenCounter,
    out: Path,
    max_new_tokens: int,
    concurrency: int,
    prompting: Prompting,
) -> dict[int, dict]:
    """run_retrieve's rows by query index: those `out` holds, and the answers to the others."""
    from tqdm import tqdm

    results = answered_before(out, queries)
    todo = [i for i in range(len(queries)) if i not in results]
    if results:
        print(
            f"longctx retrieve: {len(results)} of {len(queries)} queries already answered in {out}; "
            f"asking the other {len(todo)}",
            file=sys.stderr,
        )
    if todo:
        with contextlib.ExitStack() as stack:
            if isinstance(client, HTTPClient):  # (the repository stays pinned on the server for this run)
                doc_id = stack.enter_context(client.document(pack.text))
                answer_many = _server_answerer(pack, queries, client, max_new_tokens, doc_id)
            else:
                answer_many = _engine_answerer(pack, queries, client, counter, max_new_tokens, prompting)
            f = stack.enter_context(open_append(out))
            bar = stack.enter_context(
                tqdm(total=len(todo), desc="retrieve", unit="query", disable=not sys.stderr.isatty())
            )

            def done(i: int, res: GenResult) -> None:
                q = queries[i]
                row = {
                    **{k: v for k, v in q.items() if k != "query"},
                    "query": q["query"],
                    "answer": res.text,
                    "cited_files": cited_files(res.text, pack.paths),
                    "latency_s": round(res.latency_s, 4),
                    "prompt_tokens": res.prompt_tokens,
                    "completion_tokens": res.completion_tokens,
                }
                results[i] = row
                f.write(json.dumps(row) + "\n")
                f.flush()
                bar.update(1)

            # The first query alone prefills (and caches) the repository; the rest reuse it.
            done(todo[0], answer_many([todo[0]])[0])
            rest = todo[1:]
            if getattr(client, "parallel", False):
                run_parallel(rest, lambda i: answer_many([i])[0], done, max(1, concurrency), client.stop)
            else:
                for s in range(0, len(rest), max(1, concurrency)):
                    batch = rest[s : s + max(1, concurrency)]
                    for i, res in zip(batch, answer_many(batch)):
                        done(i, res)
    # every query answered: the rows again in the input order
    write_whole(out, "".join(json.dumps(results[i]) + "\n" for i in range(len(queries))))
    return results


def _engine_answerer(
    pack: Pack,
    queries: list[dict],
    client: Client,
    counter: TokenCounter,
    max_new_tokens: int,
    prompting: Prompting,
) -> Callable[[list[int]], list[GenResult]]:
    prefix, _ = prompting.split(pack.text, QUESTION.format(query=""))
    # Token ids of the prefix once: every request starts with exactly these ids, so the engine's
    # prefix cache matches them (tokenizing each full prompt could merge across the seam).
    prefix_ids = counter.encode(prefix)

    def request(query: str) -> GenRequest:
        _, suffix = prompting.split(pack.text, QUESTION.format(query=query))
        if prefix_ids is None:
            return GenRequest(prefix + suffix, max_new_tokens)
        ids = counter.encode(suffix) or []
        return GenRequest(prefix + suffix, max_new_tokens, prompt_ids=tuple(prefix_ids + ids))

    def answer(idx: list[int]) -> list[GenResult]:
        reqs = [request(queries[i]["query"]) for i in idx]
        res = client.generate(reqs)
        return [
            r if r.prompt_tokens is not None else _with_prompt_tokens(r, counter.count(q.prompt))
            for r, q in zip(res, reqs)
        ]

    return answer


def _server_answerer(
    pack: Pack, queries: list[dict], client: HTTPClient, max_new_tokens: int, doc_id: str | None
) -> Callable[[list[int]], list[GenResult]]:
    """Questions on the uploaded repository `doc_id`, or (None: no document endpoints) chat requests
    that all begin with it."""

    def answer(idx: list[int]) -> list[GenResult]:
        out = []
        for i in idx:
            q = queries[i]["query"]
            if doc_id is not None:
                out.append(client.ask_document(doc_id, ASK.format(query=q), max_new_tokens))
            else:
                msg = [{"role": "user", "content": pack.text + QUESTION.format(query=q)}]
                out.append(client.chat_messages(msg, max_new_tokens))
        return out

    return answer


def _with_prompt_tokens(r: GenResult, n: int) -> GenResult:
    return GenResult(r.text, r.latency_s, n, r.completion_tokens, r.finish_reason)
