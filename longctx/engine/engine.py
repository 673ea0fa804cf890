"""`Engine`: the public, in-process API (score, generate, documents, stats, reset_prefix_cache, close) and
the step-level serving API.

Every call goes through the real path: the scheduler plans batches over paged KV, stage workers
run the layers (sparse attention over the indexer's top-k), the last stage samples. With pp=1 and
tp=1 the single stage runs in this process; otherwise `longctx.stages` runs stage processes.

The stepping (set-up, the step-level API and its driver's contract, overlapped decode, stats, the
prefix-cache reset and lifecycle) is `EngineCore`'s (core.py); this module adds the blocking calls over
it, which any number of threads make at once: each call's requests go into the engine, and whichever
thread runs a step posts their outputs to the call's mailbox.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import sys
from dataclasses import dataclass, field
from typing import Any

import torch
from tqdm import tqdm

from longctx.config import is_int
from longctx.engine.core import EngineCore
from longctx.engine.guided import guide_of
from longctx.engine.request import (
    FinishReason,
    Request,
    SamplingParams,
    TokenLogprob,
    as_token_ids,
    check_priority,
)
from longctx.engine.stop_strings import stop_in
from longctx.errors import EngineDeadError, RequestError

log = logging.getLogger("longctx.engine")
_SURROGATE = re.compile("[\ud800-\udfff]")


@dataclass
class Completion:
    token_ids: list[int]
    text: str | None
    finish_reason: str
    prompt_tokens: int = 0
    cached_tokens: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per token_ids entry (logprobs=N)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # prompt tokens 1.. (prompt_logprobs=N)


class Engine(EngineCore):
    """Load a checkpoint and serve it. See DESIGN.md "Public surface".

    Safe to share between threads: one caller at a time drives the scheduler and the stages (a lock
    held for a step, not for a whole call), and blocking calls (`generate`, `score`) made from
    several threads at once run batched together, each step delivering every call's outputs to it
    whichever thread ran the step. `pin_document` holds the engine for its whole prefill.

    A thread that drives `step()` for callers of its own (AsyncEngine) uses the public API and the
    driver's contract (`EngineCore`'s `closed`, `turn`, `give_way`, `admit`, `has_held_outputs`, `lost`,
    `fail_others`, `watch` / `unwatch`, and `completion` here), nothing else of the engine's.
    """

    # ---- documents (long-document QA) ----------------------------------------------------------
    def pin_document(self, token_ids: list[int]) -> tuple[str, int]:
        """Prefill a document once and pin its pages in the prefix cache."""
        ids = as_token_ids(token_ids, "token_ids")
        # the lock held throughout: another thread's step between the last one and the pin could evict
        with self._lock:
            rid = self._new_rid("doc")
            req = Request(rid, ids, SamplingParams(max_new_tokens=0))
            self._run_to_completion([req], desc="document")
            # released into the prefix cache by the last step; nothing ran since, so nothing was evicted
            self._documents[rid] = self.prefix_cache.pin_prefix(ids)
            return rid, len(ids)

    def unpin_document(self, doc_id: str) -> None:
        with self._lock:
            keys = self._documents.pop(doc_id, None)
            if keys is None:
                raise RequestError(f"no document {doc_id!r}")
            self.prefix_cache.unpin_keys(keys)
            self._notify_watchers()  # (its pages can be evicted for a waiting request now)

    # ---- public API ------------------------------------------------------------------------------
    def score(self, token_ids: list[int]) -> torch.Tensor:
        """fp32 logits [n, vocab] at every position of `token_ids`, through the paged sparse path."""
        ids = as_token_ids(token_ids, "token_ids")
        req = Request(self._new_rid("score"), ids, SamplingParams(max_new_tokens=0), return_logits=True)
        self._run_to_completion([req], desc="score")
        return torch.cat([t.float() for t in req.logits], dim=0)

    def generate(
        self,
        prompts: list[list[int]] | list[str] | list[int] | str,
        max_new_tokens: int = 16,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        stop: list[str] | list[int] | None = None,
        seed: int | None = None,
        ignore_eos: bool = False,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        repetition_penalty: float = 1.0,
        min_tokens: int = 0,
        min_p: float = 0.0,
        logit_bias: dict[int, float] | None = None,
        logprobs: int | None = None,
        prompt_logprobs: int | None = None,
        include_stop_str_in_output: bool = False,
        allowed_token_ids: list[int] | None = None,
        bad_words: list[str] | None = None,
        guided_regex: str | None = None,
        guided_choice: list[str] | None = None,
        guided_json: dict | str | None = None,
        guided_json_object: bool = False,
        priority: int | list[int] = 0,
    ) -> list[Completion]:
        """Generate for a batch of prompts (token-id lists or strings), or for one prompt (a string or a
        token-id list, as SGLang's Engine and vLLM's LLM take it); one Completion each, a list either way.
        The penalties, min_tokens, min_p, logit_bias (token id -> bias), logprobs and prompt_logprobs (the
        top-N alternatives of each generated / prompt token), include_stop_str_in_output (the text keeps
        the stop string that ended it), allowed_token_ids (the only tokens drawn) and bad_words (words never
        generated) are `SamplingParams`'. At most one guide holds the output to a regex, one of a list of
        choices, a JSON schema's instances or any JSON object (vLLM's guided decoding, `engine.guided`).
        `priority` (one for every prompt, or a list with one per prompt, as vLLM's LLM takes it) orders the
        requests under `scheduling_policy="priority"`, lower first."""
        if isinstance(prompts, str) or (
            isinstance(prompts, list | tuple) and prompts and all(is_int(t) for t in prompts)
        ):
            prompts = [prompts]  # type: ignore[assignment]
        if not isinstance(prompts, list | tuple):
            raise RequestError("prompts must be a list of prompts (token-id lists or strings)", "prompt")
        # a bare string is one stop string, as in vLLM and OpenAI's API (it was one per character)
        stops: Any = [stop] if isinstance(stop, str | int) else stop or []
        if not isinstance(stops, list | tuple):
            raise RequestError(f"stop must be a list of stop strings and token ids, got {stop!r}", "stop")
        if not isinstance(logit_bias or {}, dict):
            raise RequestError("logit_bias must be a dict of token id -> bias", "logit_bias")
        params = SamplingParams(
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            seed=seed,
            stop_token_ids=tuple(s for s in stops if is_int(s)),
            stop=tuple(s for s in stops if not is_int(s)),  # (validate refuses what is not a string)
            ignore_eos=ignore_eos,
            presence_penalty=presence_penalty,
            frequency_penalty=frequency_penalty,
            repetition_penalty=repetition_penalty,
            min_tokens=min_tokens,
            min_p=min_p,
            logit_bias=tuple((logit_bias or {}).items()),
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            include_stop_str_in_output=include_stop_str_in_output,
            allowed_token_ids=_as_tuple(allowed_token_ids),
            bad_words=_as_tuple(bad_words),
            guided=guide_of(guided_regex, guided_choice, guided_json, guided_json_object),
        )
        params.validate()  # before any prompt is read, once for every prompt (seed + i stays valid)
        priorities = priority if isinstance(priority, list | tuple) else [priority] * len(prompts)
        if len(priorities) != len(prompts):
            raise RequestError(
                f"priority has {len(priorities)} values for {len(prompts)} prompts (give one, or one per prompt)",
                "priority",
            )
        for value in priorities:
            check_priority(value)
        reqs = []
        for i, p in enumerate(prompts):
            ids = self.encode(p) if isinstance(p, str) else as_token_ids(p, f"prompts[{i}]")
            one = dataclasses.replace(params, priority=priorities[i])
            if seed is not None:
                one = dataclasses.replace(one, seed=seed + i)
            reqs.append(Request(self._new_rid("gen"), ids, one))
        lps = self._run_to_completion(reqs, desc="generate")
        return [self.completion(r, *lps[r.rid]) for r in reqs]

    def encode(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise RequestError(f"a text prompt must be a string, got {type(text).__name__}", "prompt")
        if self.tokenizer is None:
            raise RequestError("string prompts need the model's tokenizer (tokenizer.json)")
        # (the tokenizer refuses a lone surrogate with a TypeError; a command line's byte that is not UTF-8
        # reads as one, U+DC80..U+DCFF)
        bad = _SURROGATE.search(text)
        if bad is not None:
            c = ord(bad.group())
            byte = f" (byte 0x{c - 0xDC00:02X}, not UTF-8)" if 0xDC80 <= c <= 0xDCFF else ""
            raise RequestError(
                f"the prompt is not valid Unicode: an unpaired surrogate U+{c:04X}{byte} at character "
                f"{bad.start()}",
                "prompt",
            )
        return self.tokenizer.encode(text).ids

    def completion(
        self, req: Request, logprobs: list[TokenLogprob], prompt_logprobs: list[TokenLogprob]
    ) -> Completion:
        """The Completion of a finished request, as `generate` returns it (its text cut at its first stop
        string), with the logprobs its outputs carried."""
        text = None
        if self.tokenizer is not None:
            text, cut = stop_in(self.tokenizer, req, 0)
            if cut is not None:
                text = text[:cut]
        reason = req.finish_reason.value if req.finish_reason else FinishReason.LENGTH.value
        return Completion(
            list(req.output_ids), text, reason, len(req.prompt_ids), req.num_cached, logprobs, prompt_logprobs
        )

    def _run_to_completion(
        self, reqs: list[Request], desc: str
    ) -> dict[str, tuple[list[TokenLogprob], list[TokenLogprob]]]:
        """Step until `reqs` (the engine's own, their params already valid) finish; each one's (logprobs,
        prompt logprobs) as the steps reported them. If it raises (a rejected request, a failed step, an
        interrupt), the requests of `reqs` still in the engine are aborted first, so nothing of this call
        stays queued or holds pages."""
        pending: set[str] = set()
        try:
            with self._lock:
                self._check_open()
                for r in reqs:
                    self._add(r)
                    pending.add(r.rid)
                    self._mail[r.rid] = []
            return self._step_until_done(reqs, pending, desc)
        except BaseException:
            with self._lock:
                for rid in pending:
                    try:
                        self.abort(rid)
                    except EngineDeadError:
                        pass  # its stages are gone, and what they held for the request with them
                    except Exception as e:  # (a closed engine): the error raised is the one that matters
                        log.warning("could not abort %s after a failed %s: %s", rid, desc, e)
            raise
        finally:
            with self._lock:
                for r in reqs:
                    self._mail.pop(r.rid, None)

    def _step_until_done(
        self, reqs: list[Request], pending: set[str], desc: str
    ) -> dict[str, tuple[list[TokenLogprob], list[TokenLogprob]]]:
        lps: dict[str, tuple[list[TokenLogprob], list[TokenLogprob]]] = {r.rid: ([], []) for r in reqs}
        total = sum(len(r.prompt_ids) for r in reqs)
        show = sys.stderr.isatty() and total >= 8 * self.chunk_size
        done: dict[str, int] = {}
        with tqdm(total=total, desc=f"{desc} prefill", unit="tok", disable=not show, leave=False) as bar:
            while pending:
                with self._lock:  # (released between steps: other threads' calls step, and batch with these)
                    self._check_open()
                    outs = [o for rid in sorted(pending) for o in self._mail[rid]]  # what their steps made
                    for rid in pending:
                        self._mail[rid].clear()
                    if not outs:
                        try:
                            stepped = self._step()
                        except Exception as e:
                            self.fail_others(e, pending)
                            raise
                        if not stepped and not self.has_work():
                            break
                        for o in stepped:
                            if o.rid in pending:
                                outs.append(o)
                            else:
                                self._deliver(o)
                self._lock.give_way()  # other threads wait for the lock (their calls, a stream's driver)
                for o in outs:
                    bar.update(o.prompt_done - done.get(o.rid, 0))
                    done[o.rid] = o.prompt_done
                    lps[o.rid][0].extend(o.logprobs)
                    lps[o.rid][1].extend(o.prompt_logprobs)
                    if o.finished:
                        pending.discard(o.rid)
                        if o.error:
                            raise RequestError(o.error)
        return lps


def _as_tuple(v: Any) -> Any:
    """A list argument as a tuple, None as (); anything else as it is, for `SamplingParams.validate` to
    refuse naming it."""
    return tuple(v) if isinstance(v, list) else () if v is None else v
