"""Long-document QA: upload a document once (prefilled and pinned in the prefix cache), ask many times.

A document's prompt is the chat template around one user turn that starts with the document:
`head + document` is tokenised on its own and pinned, and a question appends
`"\\n\\n" + question + tail`, so every full page of the document is a cache hit.
"""

from __future__ import annotations

import re
import urllib.parse
import uuid

from fastapi import APIRouter, Request
from fastapi.responses import Response
from starlette.datastructures import FormData
from starlette.formparsers import MultiPartParser

from longctx.checkpoint.chat_template import DOCUMENT_QUESTION_SEPARATOR
from longctx.server import messages as m
from longctx.server.engine_client import RpcError
from longctx.server.generation import new_rid
from longctx.server.protocol import ApiError, AskRequest, DocumentCreate, engine_error
from longctx.server.routes_generate import (
    Shape,
    generations,
    sampling,
    serve,
    unless_disconnected,
    with_reasoning,
)
from longctx.server.state import Document, ServerState, body_stream, get_state, read_json

router = APIRouter()
# room for a multipart body's boundaries and part headers around a document of max_body_bytes
MULTIPART_OVERHEAD_BYTES = 64 * 1024
# filename*=charset'language'percent-encoded-bytes (RFC 5987), quoted or not
_FILENAME_STAR = re.compile(rb"""(?i);\s*filename\*\s*=\s*"?([!#$%&+^`{}~\w.-]+)'[^']*'([^";\s]*)""")


def _filename_star(disposition: bytes) -> str | None:
    """The name in a Content-Disposition's `filename*`; None without one, or one that does not decode."""
    match = _FILENAME_STAR.search(disposition)
    if match is None:
        return None
    try:
        return urllib.parse.unquote_to_bytes(match.group(2)).decode(match.group(1).decode())
    except (LookupError, ValueError):
        return None


class _StrictMultiPart(MultiPartParser):
    """starlette's multipart parser, except that a text field not valid in the body's charset (UTF-8
    unless declared) is a 400: starlette would decode it as latin-1 and hand on mojibake; and that a
    file's RFC 5987 `filename*` names it (python-multipart ignores it, as RFC 7578 bars senders from it,
    yet clients such as .NET's send it, their `filename` then an RFC 2047 `=?utf-8?B?...?=`)."""

    def on_headers_finished(self) -> None:
        disposition = self._current_part.content_disposition or b""
        name = _filename_star(disposition)
        if name is not None:  # (a file part, even without a plain filename)
            self._current_part.content_disposition = disposition + b'; filename=""'
        super().on_headers_finished()
        if name is not None and self._current_part.file is not None:
            self._current_part.file.filename = name

    def on_part_end(self) -> None:
        part = self._current_part
        if part.file is None:
            try:
                bytes(part.data).decode(self._charset)
            except UnicodeDecodeError as e:
                raise ApiError(
                    400,
                    f"multipart field {part.field_name!r} is not valid {self._charset} (byte {e.start})",
                    param=part.field_name,
                    code="invalid_utf8",
                ) from None
        super().on_part_end()


async def _parse_multipart(request: Request, st: ServerState) -> FormData:
    """The form of a multipart upload, its body capped like a JSON body's (413 past it) and its text
    fields as large as a document may be (starlette's default caps a field at 1 MB)."""
    limit = st.settings.max_body_bytes
    parser = _StrictMultiPart(
        request.headers,
        body_stream(request, limit + MULTIPART_OVERHEAD_BYTES),
        max_files=1,
        max_fields=8,
        max_part_size=limit,
    )
    try:
        return await parser.parse()
    except ApiError:
        raise
    except Exception as e:  # starlette raises several types for broken multipart bodies
        raise ApiError(400, f"bad multipart body: {str(e)[:200]}", code="invalid_multipart") from None


async def _document_text(request: Request, st: ServerState) -> tuple[str, str | None]:
    ctype = request.headers.get("content-type", "")
    if not ctype.startswith("multipart/form-data"):
        body = await read_json(request, DocumentCreate)
        return body.text, body.name
    form = await _parse_multipart(request, st)
    try:
        item = form.get("file")
        if item is None:
            text = form.get("text")
            if not isinstance(text, str) or not text:
                raise ApiError(400, "multipart upload needs a `file` (or `text`) field", param="file")
            return text, None
        if isinstance(item, str):
            return item, None
        data = await item.read(st.settings.max_body_bytes + 1)
        if len(data) > st.settings.max_body_bytes:
            raise ApiError(413, "document too large", code="body_too_large")
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ApiError(
                400, f"document is not valid UTF-8 (byte {e.start})", param="file", code="invalid_utf8"
            ) from None
        if not text:
            raise ApiError(400, "document is empty", param="file")
        return text, item.filename
    finally:
        await form.close()


def _doc(st: ServerState, doc_id: str) -> Document:
    doc = st.documents.get(doc_id)
    if doc is None:
        raise ApiError(
            404, f"no document {doc_id!r}", "not_found_error", param="id", code="document_not_found"
        )
    return doc


@router.post("/v1/documents", response_model=None)
async def create_document(request: Request) -> dict | Response:
    st = get_state(request)
    text, name = await _document_text(request, st)
    try:
        head, _ = st.codec.document_frame()
    except ValueError as e:
        raise ApiError(500, str(e), "server_error") from None
    prefix_text = head + text
    ids = await st.encode(prefix_text, param="text")
    if len(ids) >= st.max_context:
        raise ApiError(
            400,
            f"the document has {len(ids)} tokens; the maximum context is {st.max_context}",
            param="text",
            code="context_length_exceeded",
        )
    st.check_admission()
    try:  # (its outcome counted like a generation's, longctx_requests_total{endpoint="documents"})
        engine_id = await _pin(request, st, tuple(ids))
    except ApiError as e:
        st.metrics.requests.labels("documents", str(e.status)).inc()
        raise
    st.metrics.requests.labels("documents", "200" if engine_id is not None else "499").inc()
    if engine_id is None:
        return Response(status_code=499)
    doc = Document(f"doc-{uuid.uuid4().hex[:16]}", engine_id, name, ids, prefix_text, len(text))
    st.documents[doc.id] = doc
    return doc.public()


async def _pin(request: Request, st: ServerState, ids: tuple[int, ...]) -> str | None:
    """Prefill and pin a document's tokens; its engine id, or None if the client hung up first."""
    try:
        # a client that hangs up cancels the upload: the engine aborts the document's prefill (or
        # unpins it, if it had just finished), so no pages stay pinned for a document nobody knows
        pin = st.client.call(
            lambda cid: m.PinDocument(cid, ids), cancel=lambda cid: m.AbortRequest(m.pin_rid(cid))
        )
        finished, result = await unless_disconnected(request, pin)
    except RpcError as e:
        raise engine_error(str(e), e.code, "text") from None
    except Exception as e:
        raise ApiError(503, f"engine unavailable: {e}", "server_error", code="engine_dead") from None
    return str(result[0]) if finished else None


@router.get("/v1/documents")
async def list_documents(request: Request) -> dict:
    st = get_state(request)
    return {"object": "list", "data": [d.public() for d in st.documents.values()]}


@router.get("/v1/documents/{doc_id}")
async def get_document(doc_id: str, request: Request) -> dict:
    return _doc(get_state(request), doc_id).public()


@router.delete("/v1/documents/{doc_id}")
async def delete_document(doc_id: str, request: Request) -> dict:
    st = get_state(request)
    doc = _doc(st, doc_id)
    del st.documents[doc_id]  # first, so no new question starts on it
    try:
        await st.client.call(lambda cid: m.UnpinDocument(cid, doc.engine_id))
    except RpcError as e:
        raise ApiError(500, f"unpin failed: {e}", "server_error") from None
    except Exception as e:
        raise ApiError(503, f"engine unavailable: {e}", "server_error", code="engine_dead") from None
    return {"id": doc_id, "object": "document", "deleted": True}


@router.post("/v1/documents/{doc_id}/ask")
async def ask_document(doc_id: str, request: Request) -> Response:
    st = get_state(request)
    req = await read_json(request, AskRequest)
    st.check_model(req.model)
    doc = _doc(st, doc_id)
    _, tail = st.codec.document_frame()
    fits = req.truncate_prompt_tokens is None
    ids = doc.ids + await st.encode(
        DOCUMENT_QUESTION_SEPARATOR + req.question + tail, param="question", fits=fits
    )
    ids = req.truncated(ids, st.max_context)
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    params = sampling(st, req, len(ids), req.max_tokens, logprobs)
    rid = new_rid("chatcmpl")
    gens = generations(st, rid, [(ids, params)], req.stop_list(), req.n)
    shape = with_reasoning(st, Shape.of(req, True, logprobs), params, tail)  # (a thinking model's answer)
    return await serve(request, st, rid, gens, shape, req.stream)
