"""Repository retrieval: ignore rules, packing, truncation, citations, engine and server paths, CLI."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import threading
import time
from collections import Counter
from functools import partial
from pathlib import Path

import httpx
import pytest

from longctx.cli import main
from longctx.errors import LongctxError
from longctx.workloads import clients
from longctx.workloads.clients import Client, GenRequest, GenResult, HTTPClient
from longctx.workloads.gitignore import is_ignored, list_files, parse_gitignore, walk_files
from longctx.workloads.jsonl import read_rows
from longctx.workloads.repo_pack import format_file, pack_repo
from longctx.workloads.retrieve import cited_files, read_queries, run_retrieve
from longctx.workloads.tokens import ByteCounter
from tests.conftest import byte_level_counter

FIXTURE = Path(__file__).parent / "fixtures" / "sample_repo"
KEPT = [
    ".gitignore",
    "README.md",
    "data/logo.png",
    "docs/latin1.txt",
    "keep.log",
    "src/app.py",
    "src/util/.gitignore",
    "src/util/generated_keep.py",
    "src/util/helpers.py",
]
PACKABLE = [p for p in KEPT if p not in ("data/logo.png", "docs/latin1.txt")]


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    # A copy outside the project's own git work tree, where the fixture's ignored files are tracked.
    dst = tmp_path / "sample_repo"
    shutil.copytree(FIXTURE, dst)
    return dst


# ---- ignore rules --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "pattern, path, is_dir, ignored",
    [
        ("*.log", "deep/dir/a.log", False, True),
        ("/*.log", "deep/a.log", False, False),
        ("build/", "build", True, True),
        ("build/", "build", False, False),  # a file named build is not a directory
        ("doc/*.txt", "doc/x/a.txt", False, False),  # an inner slash anchors the pattern
        ("a/**/b", "a/b", False, True),
        ("a/**/b", "a/x/y/b", False, True),
        ("abc/**", "abc/x/y", False, True),
        ("*.log\n!keep.log", "keep.log", False, False),
        ("\\#hash", "#hash", False, True),
        ("[!abc].txt", "d.txt", False, True),
        ("[!abc].txt", "a.txt", False, False),
        ("a?c", "a/c", False, False),
    ],
)
def test_gitignore_patterns(pattern, path, is_dir, ignored):
    assert is_ignored(path, is_dir, parse_gitignore(pattern)) is ignored


@pytest.mark.parametrize(
    "pattern, path, ignored",
    [
        # bracket expressions as git's wildmatch reads them (checked against `git ls-files --exclude-standard`);
        # a range running backwards was a re.error traceback, a POSIX class a set that matched other names
        ("[z-a]", "z", True),  # (its first character only)
        ("[z-a]", "a", False),
        ("[a-\\]]", "a", True),  # (a range to an escaped "]": backwards, so "a" alone)
        ("[[:alpha:]].c", "x.c", True),
        ("[[:alpha:]].c", "1.c", False),
        ("[[:digit:]x]-1", "7-1", True),
        ("[[:bogus:]]", "b", False),  # an unknown class: the pattern matches nothing
        ("[[:bogus:]]", ":", False),
        ("[[:alpha]b:]", "pb:]", True),  # no ':]' before the ']': the '[' is a member
        ("[a-c-e]", "-", True),
        ("[!]]b", "]b", False),
        ("[\\]]b", "]b", True),
        ("x[a-]1", "x-1", True),
        ("a[b", "a[b", True),  # never closed: a literal '[', as fnmatch(3) has it (git's own matches nothing)
    ],
)
def test_gitignore_brackets(pattern, path, ignored):
    assert is_ignored(path, False, parse_gitignore(pattern)) is ignored


def test_nested_gitignore_applies_below_its_directory():
    rules = parse_gitignore("*.py", "sub")
    assert is_ignored("sub/a.py", False, rules) and is_ignored("sub/x/a.py", False, rules)
    assert not is_ignored("a.py", False, rules) and not is_ignored("other/a.py", False, rules)


def test_walk_respects_gitignore_nested_and_negations(repo):
    files, ignored = walk_files(repo)
    assert files == KEPT
    # debug.log, secrets.env, build/ (one directory), src/util/generated_code.py
    assert ignored == 4


def test_no_git_entry_is_listed(repo):
    """Neither a .git directory nor a .git file (a worktree's or submodule's "gitdir: ..." link, which
    was packed) is listed, at any depth."""
    (repo / ".git").write_text("gitdir: /elsewhere/.git/worktrees/x\n")
    (repo / "src" / ".git").write_text("gitdir: ../.git/modules/src\n")
    (repo / "data" / ".git").mkdir()
    (repo / "data" / ".git" / "config").write_text("[core]\n")
    assert walk_files(repo) == (KEPT, 4)


@pytest.mark.skipif(shutil.which("git") is None, reason="git not installed")
def test_git_listing_agrees_with_the_rules(repo):
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    files, ignored, method = list_files(repo)
    assert method == "git" and files == KEPT and ignored is None
    assert list_files(repo, use_git=False)[2] == "gitignore"


def test_not_a_git_tree_falls_back(repo):
    files, _, method = list_files(repo)
    assert method == "gitignore" and files == KEPT
    with pytest.raises(LongctxError):
        list_files(repo, use_git=True)


# ---- packing -----------------------------------------------------------------------------------


def test_pack_headers_line_numbers_and_skips(repo):
    pack = pack_repo(repo, ByteCounter(), budget=100_000, use_git=False)
    assert pack.paths == PACKABLE
    assert {s.path: s.reason for s in pack.skipped} == {
        "data/logo.png": "binary",
        "docs/latin1.txt": "not utf-8",
    }
    assert pack.ignored == 4 and pack.method == "gitignore"
    text = pack.text
    assert (
        '=== src/app.py (lines 1-11) ===\n1| """Entry point of the sample application."""\n2| \n3| from util'
        in text
    )
    assert '=== src/util/helpers.py (lines 1-10) ===\n1| """Helpers."""\n' in text
    assert "4| def greet(name: str) -> str:" in text
    assert "API_KEY" not in text and "generated, ignored" not in text and "build artefact" not in text
    assert pack.tokens == len(text.encode()) <= pack.budget
    assert format_file("e.txt", "") == "=== e.txt (empty) ===\n\n"


def test_huge_files_are_skipped(repo):
    pack = pack_repo(repo, ByteCounter(), budget=100_000, max_file_bytes=120, use_git=False)
    reasons = {s.path: s.reason for s in pack.skipped}
    assert reasons["README.md"] == "too large" and reasons["src/app.py"] == "too large"
    assert "src/util/generated_keep.py" in pack.paths


def test_fifos_and_sockets_are_skipped_not_read(repo):
    """A FIFO in the tree blocked the run forever in open() (and a device such as /dev/zero never ended):
    only regular files are read, the others are left out as "not a regular file" (git lists none)."""
    import socket

    os.mkfifo(repo / "src" / "pipe")
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(repo / "sock"))
        done: list = []
        worker = threading.Thread(
            target=lambda: done.append(pack_repo(repo, ByteCounter(), 100_000, use_git=False)), daemon=True
        )
        worker.start()
        worker.join(10)
    assert done, "packing blocked on the FIFO"
    reasons = {s.path: s.reason for s in done[0].skipped}
    assert reasons["src/pipe"] == reasons["sock"] == "not a regular file"
    assert done[0].paths == PACKABLE


@pytest.mark.parametrize("use_git", [False, True])
def test_odd_file_names_are_quoted_as_git_quotes_them(repo, use_git):
    """A file name that is not UTF-8 was a UnicodeEncodeError traceback when its header was counted, and
    a newline in a name broke its header line in two: such names show quoted, as git quotes them."""
    if use_git and shutil.which("git") is None:
        pytest.skip("git not installed")
    names = {b"caf\xe9.py": '"caf\\351.py"', b"new\nline.py": '"new\\nline.py"', b"tab\t.py": '"tab\\t.py"'}
    try:
        for raw in names:
            (repo / os.fsdecode(raw)).write_text("x = 1\n")
    except OSError:
        pytest.skip("the file system takes no such names")
    odd = repo.parent / os.fsdecode(b"r\xe9po\n")
    repo.rename(odd)
    if use_git:
        subprocess.run(["git", "init", "-q", str(odd)], check=True)
    pack = pack_repo(odd, ByteCounter(), budget=100_000, use_git=use_git)
    assert set(names.values()) <= set(pack.paths)
    assert '=== "new\\nline.py" (lines 1-1) ===\n1| x = 1\n' in pack.text
    assert pack.text.startswith('Repository "r\\351po\\n". ')
    pack.text.encode("utf-8")
    json.dumps(pack.to_json(), ensure_ascii=False).encode("utf-8")


def test_unreadable_directories_and_files_are_reported(repo, monkeypatch):
    """A directory without read permission was dropped in silence with every file under it (os.walk
    swallows the error): it is left out as "unreadable", as git warns of it and goes on; so is a file
    that cannot be opened. (Simulated: root reads through chmod 000.)"""
    real_scandir, real_open = os.scandir, Path.open

    def scandir(path):
        if Path(path) == repo / "src" / "util":
            raise PermissionError(13, "Permission denied", str(path))
        return real_scandir(path)

    def open_(self, *args, **kw):
        if self == repo / "README.md":
            raise PermissionError(13, "Permission denied", str(self))
        return real_open(self, *args, **kw)

    monkeypatch.setattr(os, "scandir", scandir)
    monkeypatch.setattr(Path, "open", open_)
    pack = pack_repo(repo, ByteCounter(), budget=100_000, use_git=False)
    reasons = {s.path: s.reason for s in pack.skipped}
    assert reasons["src/util/"] == reasons["README.md"] == "unreadable"
    assert pack.paths == [".gitignore", "keep.log", "src/app.py"]
    assert "src/util/: unreadable" in pack.report()


def test_an_untracked_directory_git_cannot_list_is_reported(repo, monkeypatch):
    """In a git work tree, `git ls-files --others` leaves out an untracked directory it cannot open and
    only warns on stderr ("warning: could not open directory 'src/util/': Permission denied"): the pack
    reported nothing of it. It is now left out as "unreadable" as on the rules' walk. As root, whom
    chmod 000 does not stop, git's output is made what it is for another user (checked by hand with
    `su nobody`): the directory's files gone, the warning on stderr."""
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    util = repo / "src" / "util"
    if os.geteuid() != 0:
        util.chmod(0)
    else:
        real_run = subprocess.run

        def run(cmd, *a, **kw):
            res = real_run(cmd, *a, **kw)
            if "ls-files" in cmd:
                kept = [p for p in res.stdout.split(b"\0") if p and not p.startswith(b"src/util/")]
                warn = b"warning: could not open directory 'src/util/': Permission denied\n"
                res = subprocess.CompletedProcess(res.args, res.returncode, b"\0".join(kept) + b"\0", warn)
            return res

        monkeypatch.setattr(subprocess, "run", run)
    try:
        pack = pack_repo(repo, ByteCounter(), budget=100_000, use_git=True)
    finally:
        util.chmod(0o755)
    assert {s.path: s.reason for s in pack.skipped}["src/util/"] == "unreadable"
    assert not any(p.startswith("src/util/") for p in pack.paths) and "src/app.py" in pack.paths
    assert "src/util/: unreadable" in pack.report()


def test_truncation_when_the_context_is_small(repo):
    full = pack_repo(repo, ByteCounter(), budget=100_000, use_git=False)
    budget = full.tokens // 2
    pack = pack_repo(repo, ByteCounter(), budget=budget, use_git=False)
    assert pack.tokens <= budget
    assert 0 < len(pack.files) < len(full.files)
    cut = [s.path for s in pack.skipped if s.reason == "context full"]
    assert cut and set(cut) | set(pack.paths) == set(full.paths)
    assert all(p > pack.paths[-1] for p in cut)  # it stops: nothing after the first file that did not fit
    report = pack.report()
    assert "context full" in report and cut[0] in report
    assert pack.to_json()["skipped"][0]["reason"] in ("binary", "context full", "not utf-8")


# ---- citations and queries -------------------------------------------------------------------------


def test_cited_files():
    paths = ["README.md", "src/app.py", "src/util/helpers.py", "a/util.py", "b/util.py"]
    assert cited_files("See src/util/helpers.py, then src/app.py.", paths) == [
        "src/util/helpers.py",
        "src/app.py",
    ]
    assert cited_files("app.py calls helpers.py; README.md explains", paths) == [
        "src/app.py",
        "src/util/helpers.py",
        "README.md",
    ]
    assert cited_files("src/app.pyc and mysrc/app.py and x/app.py", paths) == []
    assert cited_files("util.py is ambiguous but b/util.py is not", paths) == ["b/util.py"]
    assert cited_files("`src/app.py`", paths) == ["src/app.py"]


def test_read_queries(tmp_path):
    q = tmp_path / "q.jsonl"
    q.write_text('{"query": "a?", "id": 7}\n\n{"question": "b?"}\n"c?"\n')
    assert read_queries(q) == [{"query": "a?", "id": 7}, {"query": "b?"}, {"query": "c?"}]
    q.write_text('{"query": "a?"}\n{oops\n')
    with pytest.raises(LongctxError, match=":2:"):
        read_queries(q)
    q.write_text('{"id": 1}\n')
    with pytest.raises(LongctxError):
        read_queries(q)


@pytest.mark.parametrize("field", ["answer", "cited_files", "latency_s"])
def test_a_query_row_with_a_field_the_answers_write_is_refused(tmp_path, field):
    """A gold "answer" (or another field the answer row writes) in a query row was overwritten by the
    model's in the answers file, and resuming matched rows without it: refused on its line, before any
    model loads, naming the field and what to do."""
    q = tmp_path / "q.jsonl"
    q.write_text(f'{{"query": "a?"}}\n{{"query": "b?", "{field}": "x"}}\n')
    with pytest.raises(LongctxError, match=rf':2: "{field}" is a field the answers file writes .*rename it'):
        read_queries(q)


def test_read_queries_takes_a_byte_order_mark(tmp_path):
    """A queries file saved "UTF-8 with BOM" (Notepad, PowerShell's Out-File) reads as the same rows; its
    first line was refused as not JSON."""
    q = tmp_path / "q.jsonl"
    q.write_bytes(b'\xef\xbb\xbf{"query": "a?", "id": 1}\n"b?"\n')
    assert read_queries(q) == [{"query": "a?", "id": 1}, {"query": "b?"}]


def test_read_queries_refuses_half_a_surrogate_pair(tmp_path):
    """JSON can escape a lone surrogate ("\\ud800"), which no tokenizer takes: one line naming the row, not
    a TypeError from the tokenizer after the model was loaded."""
    q = tmp_path / "q.jsonl"
    q.write_text('{"query": "fine"}\n{"query": "bad \\ud800 half"}\n')
    with pytest.raises(LongctxError, match=r":2: the query is not valid Unicode"):
        read_queries(q)


# ---- answering -------------------------------------------------------------------------------------


class FakeEngine(Client):
    """Stands in for the embedded engine: records batches and answers with a fixed text."""

    def __init__(self, answer: str) -> None:
        self.answer = answer
        self.batches: list[list[GenRequest]] = []

    def generate(self, reqs: list[GenRequest]) -> list[GenResult]:
        self.batches.append(reqs)
        return [GenResult(self.answer, 0.5, None, 7, "stop") for _ in reqs]


QUERIES = [{"query": "Where is greet defined?", "id": "q1"}, {"query": "What runs main?"}, {"query": "Why?"}]


def test_engine_path_shares_one_prefix(repo, tmp_path):
    counter = byte_level_counter()
    pack = pack_repo(repo, counter, budget=100_000, use_git=False)
    engine = FakeEngine("greet is in src/util/helpers.py and app.py calls it.")
    out = tmp_path / "answers.jsonl"
    summary = run_retrieve(pack, QUERIES, engine, counter, out, max_new_tokens=64, concurrency=2)
    # The first query runs alone (it prefills the repository), the rest in batches.
    assert [len(b) for b in engine.batches] == [1, 2]
    reqs = [r for b in engine.batches for r in b]
    prefix = counter.encode(pack.text)
    assert all(r.prompt_ids is not None and list(r.prompt_ids[: len(prefix)]) == prefix for r in reqs)
    assert all(r.prompt.startswith(pack.text) and r.max_new_tokens == 64 for r in reqs)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["query"] for r in rows] == [q["query"] for q in QUERIES]
    assert rows[0]["id"] == "q1"
    for r in rows:
        assert set(r) >= {"query", "answer", "cited_files", "latency_s", "prompt_tokens", "completion_tokens"}
        assert r["cited_files"] == ["src/util/helpers.py", "src/app.py"]
        assert r["prompt_tokens"] > pack.tokens and r["completion_tokens"] == 7
    assert summary["queries"] == 3 and summary["files_packed"] == len(PACKABLE)
    assert summary["skipped_by_reason"] == {"binary": 1, "not utf-8": 1}


def _server(documents: bool, seen: list) -> httpx.MockTransport:
    def completion(text: str) -> dict:
        return {
            "object": "chat.completion",
            "choices": [
                {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}
            ],
            "usage": {"prompt_tokens": 1234, "completion_tokens": 9},
        }

    def handler(request: httpx.Request) -> httpx.Response:
        path = request.url.path
        seen.append((path, json.loads(request.content) if request.content else None))
        if path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "served"}]})
        if path == "/v1/documents":
            if not documents:
                return httpx.Response(404, json={"detail": "Not Found"})
            return httpx.Response(200, json={"id": "doc-1", "tokens": 999})
        if path == "/v1/documents/doc-1/ask":
            return httpx.Response(200, json=completion("See README.md"))
        if path == "/v1/documents/doc-1" and request.method == "DELETE":
            return httpx.Response(200, json={"id": "doc-1", "deleted": True})
        if path == "/v1/chat/completions":
            return httpx.Response(200, json=completion("It is src/app.py"))
        return httpx.Response(404)

    return httpx.MockTransport(handler)


def test_server_uses_the_document_endpoint(repo, tmp_path):
    seen: list = []
    client = HTTPClient("http://srv", transport=_server(True, seen), chat=True)
    pack = pack_repo(repo, ByteCounter(), budget=100_000, use_git=False)
    run_retrieve(pack, QUERIES, client, ByteCounter(), tmp_path / "a.jsonl", max_new_tokens=32, concurrency=2)
    paths = [p for p, _ in seen]
    assert paths.count("/v1/documents") == 1 and paths.count("/v1/documents/doc-1/ask") == 3
    assert (
        paths[-1] == "/v1/documents/doc-1"
    )  # unpinned at the end: the server keeps no copy of the repository
    doc_body = next(b for p, b in seen if p == "/v1/documents")
    assert doc_body == {"text": pack.text}
    asks = [b for p, b in seen if p.endswith("/ask")]
    assert all(b["max_tokens"] == 32 and "Where is greet" in asks[0]["question"] for b in asks[:1])
    rows = [json.loads(line) for line in (tmp_path / "a.jsonl").read_text().splitlines()]
    assert [r["cited_files"] for r in rows] == [["README.md"]] * 3
    assert rows[0]["prompt_tokens"] == 1234 and rows[0]["completion_tokens"] == 9


def test_server_without_documents_falls_back_to_chat(repo, tmp_path):
    seen: list = []
    client = HTTPClient("http://srv/v1", transport=_server(False, seen), chat=True)
    pack = pack_repo(repo, ByteCounter(), budget=100_000, use_git=False)
    run_retrieve(pack, QUERIES, client, ByteCounter(), tmp_path / "a.jsonl")
    chats = [b for p, b in seen if p == "/v1/chat/completions"]
    assert len(chats) == 3
    assert all(b["messages"][0]["content"].startswith(pack.text) and b["model"] == "served" for b in chats)
    rows = [json.loads(line) for line in (tmp_path / "a.jsonl").read_text().splitlines()]
    assert all(r["cited_files"] == ["src/app.py"] for r in rows)


def test_a_second_run_into_the_same_out_is_refused(repo, tmp_path):
    """While a run writes --out (its lock held), another into the same file stops before asking anything;
    the kernel drops the lock with the process, and the lock file is beside --out."""
    import fcntl

    seen: list = []
    client = HTTPClient("http://srv", transport=_server(True, seen), chat=True)
    pack = pack_repo(repo, ByteCounter(), budget=100_000, use_git=False)
    out = tmp_path / "a.jsonl"
    with (tmp_path / ".a.jsonl.lock").open("a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        with pytest.raises(LongctxError, match=f"another run is writing {out}; wait for it or give another"):
            run_retrieve(pack, QUERIES, client, ByteCounter(), out)
        assert [p for p, _ in seen if p != "/v1/models"] == [] and not out.exists()
    run_retrieve(pack, QUERIES, client, ByteCounter(), out)  # (released)
    assert len(read_rows(out)) == len(QUERIES)


def test_a_failed_query_stops_the_run_and_a_rerun_resumes(repo, tmp_path, monkeypatch, capsys):
    """A question the server refuses ends the run with one line (exit 2). The answers finished by then,
    one still running included, stay in --out; the same command asks only the others and leaves every
    row in the input order."""
    queries = [{"query": f"Question {i}?", "id": i} for i in range(6)] + [{"query": "Question 1?", "id": 1}]
    (tmp_path / "q.jsonl").write_text("".join(json.dumps(q) + "\n" for q in queries))
    refused = threading.Event()
    asked: list = []
    server = _server(True, asked)

    def handler(request: httpx.Request) -> httpx.Response:
        question = json.loads(request.content).get("question", "") if request.content else ""
        if question.startswith("Question 3?"):
            refused.set()
            return httpx.Response(400, json={"error": {"message": "question too long"}})
        if question.startswith("Question 2?"):  # still running when the run stops
            refused.wait(5)
            time.sleep(0.2)
        return server.handle_request(request)

    monkeypatch.setattr(clients, "HTTPClient", partial(HTTPClient, transport=httpx.MockTransport(handler)))
    out = tmp_path / "a.jsonl"
    argv = ["retrieve", "--repo", str(repo), "--queries", str(tmp_path / "q.jsonl"), "--out", str(out)]
    argv += ["--base-url", "http://srv", "--no-git", "--concurrency", "3"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == (
        "longctx retrieve: error: POST /v1/documents/doc-1/ask -> HTTP 400: question too long; "
        f"the answers done are kept in {out}, and the same command resumes"
    )
    kept = [(r["id"], r["query"]) for r in read_rows(out)]
    assert (0, "Question 0?") in kept and (2, "Question 2?") in kept and (3, "Question 3?") not in kept
    assert asked[-1] == ("/v1/documents/doc-1", None)  # unpinned when the run stopped
    asked.clear()
    monkeypatch.setattr(clients, "HTTPClient", partial(HTTPClient, transport=_server(True, asked)))
    assert main(argv) == 0
    questions = [b["question"].split("\n")[0] for p, b in asked if p.endswith("/ask")]
    left = Counter((q["id"], q["query"]) for q in queries) - Counter(kept)
    assert sorted(questions) == sorted(query for _, query in left.elements())
    rows = read_rows(out)
    assert [(r["id"], r["query"]) for r in rows] == [(q["id"], q["query"]) for q in queries]
    assert f"already answered in {out}" in capsys.readouterr().err
    # A rerun has nothing to ask (and uploads nothing); another queries file is refused.
    asked.clear()
    assert main(argv) == 0 and asked == [("/v1/models", None)]
    (tmp_path / "q.jsonl").write_text('{"query": "Something else?"}\n')
    assert main(argv) == 2
    assert "answers queries not in this queries file" in capsys.readouterr().err


def _serving(name: list[str], seen: list) -> httpx.MockTransport:
    """`_server(True, seen)` serving the model named `name[0]` (changed between runs)."""
    server = _server(True, seen)

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": name[0]}]})
        return server.handle_request(request)

    return httpx.MockTransport(handler)


def test_a_rerun_under_another_model_or_setting_is_refused(repo, tmp_path, monkeypatch, capsys):
    """--out's rows came from one model under one set of settings, recorded beside it (OUT.run.json): a
    rerun into it with another served model, or a setting that changes the answers, stops with one line
    saying what differs, before packing or asking anything; the same settings resume."""
    name, seen = ["served"], []
    monkeypatch.setattr(clients, "HTTPClient", partial(HTTPClient, transport=_serving(name, seen)))
    (tmp_path / "q.jsonl").write_text("".join(json.dumps(q) + "\n" for q in QUERIES))
    out = tmp_path / "a.jsonl"
    argv = ["retrieve", "--repo", str(repo), "--queries", str(tmp_path / "q.jsonl"), "--out", str(out)]
    argv += ["--base-url", "http://srv", "--no-git"]
    assert main(argv) == 0
    record = json.loads((tmp_path / "a.jsonl.run.json").read_text())
    assert record["model"] == "served" and record["via"] == "server" and record["max_new_tokens"] == 512
    out.write_text("".join(json.dumps(r) + "\n" for r in read_rows(out)[:2]))  # (a run that stopped)
    capsys.readouterr()
    for served, extra, differs in [
        ("other", [], 'model "served" (now "other")'),
        ("served", ["--max-new-tokens", "64"], "max_new_tokens 512 (now 64)"),
        ("served", ["--repo", str(tmp_path)], f'repo "{repo.resolve()}" (now "{tmp_path.resolve()}")'),
    ]:
        name[0] = served
        seen.clear()
        assert main([*argv, *extra]) == 2
        err = capsys.readouterr().err.strip()
        assert err == (
            f"longctx retrieve: error: {out} holds rows written with other settings: {differs}; "
            f"give another --out for this run (or remove {out} to start over)"
        )
        assert seen == [] and len(read_rows(out)) == 2  # nothing uploaded or asked
    name[0] = "served"
    assert main(argv) == 0
    asks = [b["question"] for p, b in seen if p.endswith("/ask")]
    assert len(asks) == 1 and asks[0].startswith("Why?") and len(read_rows(out)) == 3


def test_rows_without_a_record_resume_with_a_warning(repo, tmp_path, monkeypatch, capsys):
    """A file written before records were kept is resumed as this run's (said once, then recorded); a
    record beside a file with no rows (removed to start over) says nothing."""
    name, seen = ["served"], []
    monkeypatch.setattr(clients, "HTTPClient", partial(HTTPClient, transport=_serving(name, seen)))
    (tmp_path / "q.jsonl").write_text("".join(json.dumps(q) + "\n" for q in QUERIES))
    out, record = tmp_path / "a.jsonl", tmp_path / "a.jsonl.run.json"
    argv = ["retrieve", "--repo", str(repo), "--queries", str(tmp_path / "q.jsonl"), "--out", str(out)]
    argv += ["--base-url", "http://srv", "--no-git"]
    assert main(argv) == 0
    out.write_text("".join(json.dumps(r) + "\n" for r in read_rows(out)[:2]))
    record.unlink()
    name[0] = "other"
    capsys.readouterr()
    assert main(argv) == 0 and len(read_rows(out)) == 3
    assert capsys.readouterr().err.count("does not record the model and settings") == 1
    assert json.loads(record.read_text())["model"] == "other"
    assert main(argv) == 0 and "does not record" not in capsys.readouterr().err
    out.unlink()
    name[0] = "third"
    assert main(argv) == 0 and json.loads(record.read_text())["model"] == "third"


def test_a_server_down_when_its_model_is_asked_is_a_connection_error(repo, tmp_path, monkeypatch, capsys):
    """Without --model-name the served name is asked before packing, retried as every request is; a
    server still down then stops the run with the one-line connection error (exit 2), not a model named
    "default" (a rerun into a file with rows was refused as another model's); up again, the run resumes."""

    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused")

    def serve(transport: httpx.MockTransport) -> None:
        fast = partial(HTTPClient, transport=transport, retry=clients.Retry(attempts=2), sleep=lambda s: None)
        monkeypatch.setattr(clients, "HTTPClient", fast)

    (tmp_path / "q.jsonl").write_text("".join(json.dumps(q) + "\n" for q in QUERIES))
    out = tmp_path / "a.jsonl"
    argv = ["retrieve", "--repo", str(repo), "--queries", str(tmp_path / "q.jsonl"), "--out", str(out)]
    argv += ["--base-url", "http://srv", "--no-git"]
    serve(_serving(["served"], []))
    assert main(argv) == 0
    out.write_text("".join(json.dumps(r) + "\n" for r in read_rows(out)[:2]))  # (a run that stopped)
    serve(httpx.MockTransport(refuse))
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == (
        "longctx retrieve: error: GET http://srv/v1/models failed: refused (retried 2 times): nothing answers at "
        "http://srv; is the server running?"
    )
    assert len(read_rows(out)) == 2
    serve(_serving(["served"], []))
    assert main(argv) == 0 and len(read_rows(out)) == 3


def test_the_embedded_engines_flags_are_part_of_the_record(repo, tmp_path, monkeypatch, capsys):
    """With --model: the model directory and the flags that change what it selects (--index-topk ...);
    run_retrieve itself refuses other settings too (under its lock, for callers other than the CLI)."""
    model = tmp_path / "model"
    model.mkdir()
    shutil.copy(Path(__file__).resolve().parents[1] / "configs" / "tiny.json", model / "config.json")
    engines: list[dict] = []

    class FakeEngineClient(FakeEngine):
        def __init__(self, model_dir: str, **kw: object) -> None:
            super().__init__("See src/app.py")
            engines.append(kw)

    monkeypatch.setattr(clients, "EngineClient", FakeEngineClient)
    (tmp_path / "q.jsonl").write_text("".join(json.dumps(q) + "\n" for q in QUERIES))
    out = tmp_path / "a.jsonl"
    argv = ["retrieve", "--repo", str(repo), "--queries", str(tmp_path / "q.jsonl"), "--out", str(out)]
    argv += ["--model", str(model), "--no-git", "--max-new-tokens", "16"]
    assert main([*argv, "--index-topk", "8"]) == 0
    record = json.loads((tmp_path / "a.jsonl.run.json").read_text())
    assert record["model"] == str(model.resolve()) and record["via"] == "engine" and record["index_topk"] == 8
    assert record["device"] == "cpu" and record["kv_dtype"] is None
    capsys.readouterr()
    assert main([*argv, "--index-topk", "16"]) == 2
    assert "index_topk 8 (now 16); give another --out" in capsys.readouterr().err
    assert main(argv) == 2  # (left out: the model's own)
    assert "index_topk 8 (now null)" in capsys.readouterr().err
    assert len(engines) == 1  # no model was loaded for a refused run
    assert main([*argv, "--index-topk", "8", "--hisparse-device-tokens", "64"]) == 0  # (moves KV only)
    pack = pack_repo(repo, ByteCounter(), budget=100_000, use_git=False)
    with pytest.raises(LongctxError, match=re.escape(f'model "{model.resolve()}" (now "/else")')):
        run_retrieve(pack, QUERIES, FakeEngine("x"), ByteCounter(), out, settings={"model": "/else"})
    assert len(read_rows(out)) == 3


def test_a_flag_equal_to_the_models_own_value_is_the_flag_left_out(repo, tmp_path, monkeypatch, capsys):
    """`--index-topk 16` on a model whose own index_topk is 16 resumes a run that gave no flag, and the other
    way round (compared as the engine takes them, not as given: `jsonl.check_settings`); another top-k is
    still refused in the same words."""
    model = tmp_path / "model"
    model.mkdir()
    shutil.copy(Path(__file__).resolve().parents[1] / "configs" / "tiny.json", model / "config.json")
    monkeypatch.setattr(clients, "EngineClient", lambda model_dir, **kw: FakeEngine("See src/app.py"))
    (tmp_path / "q.jsonl").write_text("".join(json.dumps(q) + "\n" for q in QUERIES))
    out = tmp_path / "a.jsonl"
    argv = ["retrieve", "--repo", str(repo), "--queries", str(tmp_path / "q.jsonl"), "--out", str(out)]
    argv += ["--model", str(model), "--no-git", "--max-new-tokens", "16"]
    assert main(argv) == 0
    for flags in (["--index-topk", "16"], [], ["--index-topk", "16", "--kv-dtype", "auto"]):
        out.write_text("".join(json.dumps(r) + "\n" for r in read_rows(out)[:2]))  # (a run that stopped)
        capsys.readouterr()
        assert main([*argv, *flags]) == 0, capsys.readouterr().err
        assert len(read_rows(out)) == 3
    capsys.readouterr()
    assert main([*argv, "--index-topk", "8"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"longctx retrieve: error: {out} holds rows written with other settings: index_topk 16 (now 8); "
        f"give another --out for this run (or remove {out} to start over)"
    )  # (not kv_dtype "auto" (now null): the engine's default)


# ---- CLI ---------------------------------------------------------------------------------------------


def test_cli_end_to_end_against_a_server(repo, tmp_path, monkeypatch, capsys):
    seen: list = []
    monkeypatch.setattr(clients, "HTTPClient", partial(HTTPClient, transport=_server(True, seen)))
    q = tmp_path / "q.jsonl"
    q.write_text("\n".join(json.dumps(x) for x in QUERIES) + "\n")
    out, report = tmp_path / "out" / "a.jsonl", tmp_path / "pack.json"
    argv = [
        "retrieve",
        "--repo",
        str(repo),
        "--queries",
        str(q),
        "--out",
        str(out),
        "--base-url",
        "http://srv",
    ]
    argv += ["--max-context", "1000", "--max-new-tokens", "64", "--pack-report", str(report), "--no-git"]
    assert main(argv) == 0
    assert len(out.read_text().splitlines()) == 3
    err = capsys.readouterr().err
    assert "retrieve: 3 queries, mean latency" in err and "context full" in err
    rep = json.loads(report.read_text())
    assert rep["tokens"] <= rep["budget"] < 1000
    assert any(s["reason"] == "context full" for s in rep["skipped"])


def test_a_run_into_the_repository_packs_none_of_its_own_files(repo, tmp_path, monkeypatch):
    """`--repo . --out answers.jsonl`: the answers, their lock and record (and the files those are replaced
    through) and --pack-report are not packed, so a resumed run asks over the same text as the first."""
    seen: list = []
    monkeypatch.setattr(clients, "HTTPClient", partial(HTTPClient, transport=_server(True, seen)))
    monkeypatch.chdir(repo)
    (tmp_path / "q.jsonl").write_text("".join(json.dumps(q) + "\n" for q in QUERIES))
    argv = ["retrieve", "--repo", ".", "--queries", str(tmp_path / "q.jsonl"), "--out", "answers.jsonl"]
    argv += ["--base-url", "http://srv", "--no-git", "--pack-report", "pack.json"]
    assert main(argv) == 0
    (first,) = [b["text"] for p, b in seen if p == "/v1/documents"]
    rows = read_rows(repo / "answers.jsonl")
    (repo / "answers.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in rows[:2])
    )  # (a run that stopped)
    for left in ("answers.jsonl.tmp", "answers.jsonl.run.json.tmp"):  # (killed while replacing them)
        (repo / left).write_text("{}")
    own = {"answers.jsonl", ".answers.jsonl.lock", "answers.jsonl.run.json", "pack.json"}
    assert own <= {p.name for p in repo.iterdir()}
    seen.clear()
    assert main(argv) == 0
    assert [b["text"] for p, b in seen if p == "/v1/documents"] == [first]
    assert [f["path"] for f in json.loads((repo / "pack.json").read_text())["files"]] == PACKABLE


@pytest.mark.parametrize(
    "extra",
    [
        [],  # neither --model nor --base-url
        ["--model", "M", "--base-url", "http://x"],
        ["--base-url", "http://x", "--max-context", "ten"],
        ["--base-url", "http://x", "--max-context", "100"],  # no room after the question and answer
        ["--base-url", "http://x", "--concurrency", "0"],
        ["--base-url", "http://x", "--index-topk", "64"],  # a server selects what it was started with
    ],
)
def test_cli_bad_args_exit_2_with_one_line(extra, repo, tmp_path, capsys):
    q = tmp_path / "q.jsonl"
    q.write_text('{"query": "x"}\n')
    argv = ["retrieve", "--repo", str(repo), "--queries", str(q), "--out", str(tmp_path / "o.jsonl"), *extra]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("longctx retrieve: error:")


@pytest.mark.parametrize("out", [".", "file/a.jsonl", "file/dir/a.jsonl"])
def test_cli_out_is_checked_before_packing(out, repo, tmp_path, capsys, monkeypatch):
    """An --out that cannot be written is one line before the repository is packed (it was found when the
    answers were written, after packing and loading the model)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "file").write_text("")
    (tmp_path / "q.jsonl").write_text('{"query": "x"}\n')
    assert (
        main(["retrieve", "--repo", str(repo), "--queries", "q.jsonl", "--out", out, "--base-url", "u"]) == 2
    )
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"longctx retrieve: error: --out {out}: not a file that can be written")
    assert "\n" not in err


def test_a_repository_whose_first_file_does_not_fit_says_so(tmp_path, monkeypatch, capsys):
    """With a context too small for even the first file the run said "nothing to pack in REPO", as for an
    empty one: it names the file and the room there was, and what to change."""
    monkeypatch.setattr(clients, "HTTPClient", partial(HTTPClient, transport=_server(True, [])))
    (tmp_path / "repo").mkdir()
    (tmp_path / "repo" / "big.py").write_text("x = 1\n" * 300)
    (tmp_path / "repo" / "small.py").write_text("y = 2\n")
    (tmp_path / "q.jsonl").write_text('{"query": "x?"}\n')
    argv = ["retrieve", "--repo", str(tmp_path / "repo"), "--queries", str(tmp_path / "q.jsonl")]
    argv += ["--out", str(tmp_path / "a.jsonl"), "--base-url", "http://srv", "--max-context", "1000"]
    assert main([*argv, "--max-new-tokens", "16"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert re.fullmatch(
        rf"longctx retrieve: error: nothing of {re.escape(str(tmp_path / 'repo'))} fits: its first file, big\.py, "
        r"needs more than the [\d,]+ tokens a context of 1,000 leaves for the repository after the longest "
        r"question and --max-new-tokens; give a larger --max-context \(or --max-file-bytes to leave it out\)",
        err,
    ), err
    (tmp_path / "empty").mkdir()
    assert main([*argv[:2], str(tmp_path / "empty"), *argv[3:]]) == 2
    assert (
        capsys.readouterr().err.strip().splitlines()[-1].endswith(f"nothing to pack in {tmp_path / 'empty'}")
    )


def test_cli_missing_inputs(tmp_path, capsys):
    assert main(["retrieve", "--queries", "q", "--out", "o", "--base-url", "http://x"]) == 2
    assert (
        main(
            ["retrieve", "--repo", str(tmp_path / "nope"), "--queries", "q", "--out", "o", "--base-url", "u"]
        )
        == 2
    )
    (tmp_path / "bad.jsonl").write_text("{nope\n")
    argv = [
        "retrieve",
        "--repo",
        str(tmp_path),
        "--queries",
        str(tmp_path / "bad.jsonl"),
        "--out",
        "o",
        "--base-url",
        "u",
    ]
    assert main(argv) == 2
    errs = capsys.readouterr().err.strip().splitlines()
    assert len(errs) == 3 and all(e.startswith("longctx retrieve: error:") for e in errs)
