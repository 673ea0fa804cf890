from __future__ import annotations

import multiprocessing as mp
import os
import signal
import stat

import pytest
import torch

from longctx.kvstore import host_pool as hp
from longctx.kvstore.host_pool import HostKVLayout, HostKVSpec, HostPool, HostPoolError, cleanup_stale

NBYTES = 1 << 16


def _reader(name: str, attached, unlinked, q) -> None:  # runs in a spawned process
    try:
        pool = HostPool.attach(name, NBYTES)
        attached.set()
        assert unlinked.wait(60)
        vals = pool.as_tensor(torch.int32, (16,), offset=4096).tolist()
        pool.tensor[0] = 77  # rank 0 must see writes through the same memory
        q.put(("ok", vals, os.path.exists(pool.path)))
        pool.close()
    except BaseException as e:  # report instead of dying silently
        q.put(("err", repr(e), None))


def _creator_then_hang(q) -> None:  # runs in a spawned process, killed with SIGKILL
    pool, name = HostPool.create(4096, "stale")
    q.put((pool.path, os.getpid()))
    signal.pause()


def test_create_attach_other_process_then_unlink():
    ctx = mp.get_context("spawn")
    pool, name = HostPool.create(NBYTES, "test")
    assert name == os.path.basename(pool.path) and name.startswith(f"longctx-test-{os.getpid()}-")
    pool.as_tensor(torch.int32, (16,), offset=4096).copy_(torch.arange(16, dtype=torch.int32) * 3)
    attached, unlinked, q = ctx.Event(), ctx.Event(), ctx.Queue()
    p = ctx.Process(target=_reader, args=(name, attached, unlinked, q))
    p.start()
    try:
        assert attached.wait(120), "reader never attached"
        pool.unlink()  # after the "barrier": the name goes, both mappings stay valid
        assert not os.path.exists(pool.path)
        unlinked.set()
        status, vals, still_there = q.get(timeout=60)
        assert status == "ok", vals
        assert vals == [3 * i for i in range(16)] and still_there is False
        assert int(pool.tensor[0]) == 77
        assert pool.as_tensor(torch.int32, (16,), offset=4096)[5].item() == 15
    finally:
        p.join(60)
        pool.close()
    assert p.exitcode == 0


def test_exclusive_create_and_mode(monkeypatch):
    pool, _ = HostPool.create(4096, "mode")
    with pool:
        st = os.stat(pool.path)
        assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.getuid() and st.st_size == 4096
        # a name that already exists is never reused: O_EXCL refuses it
        token = pool.name.rsplit("-", 1)[1]
        monkeypatch.setattr(hp.secrets, "token_hex", lambda n: token)
        with pytest.raises(FileExistsError):
            HostPool.create(4096, "mode")
        assert os.path.exists(pool.path)  # the failed create did not remove the other's file
    assert pool.closed and not os.path.exists(pool.path)  # close() unlinks for the creator
    pool.close()  # idempotent


def test_killed_creator_leaves_stale_file_that_cleanup_removes():
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_creator_then_hang, args=(q,))
    p.start()
    try:
        path, pid = q.get(timeout=120)
    finally:
        os.kill(p.pid, signal.SIGKILL)
        p.join(60)
    assert p.exitcode == -signal.SIGKILL
    assert os.path.exists(path)  # no atexit ran: the file is stale
    mine, _ = HostPool.create(4096, "live")
    with mine:
        assert cleanup_stale("longctx-", pids={pid + 1}) == []  # only the files of the pids asked for
        assert os.path.exists(path)
        removed = cleanup_stale("longctx-")
        assert path in removed and not os.path.exists(path)
        assert os.path.exists(mine.path)  # a live creator's file is kept
        assert mine.path not in removed


def test_views_layout_and_close():
    spec = HostKVSpec(layer_start=3, layer_end=6, num_slots=10, row_bytes=656)
    assert spec.layer_stride == 8192 and spec.nbytes == 3 * 8192
    pool, _ = HostPool.create(spec.nbytes, "layout")
    kv = HostKVLayout(pool, spec)
    for layer in range(3, 6):
        v = kv.layer_view(layer)
        assert v.shape == (10, 656) and v.dtype == torch.uint8
        v.fill_(layer)
    v4 = kv.layer_view(4)
    assert kv.view().shape == (3, 10, 656)
    assert torch.equal(kv.view()[1], v4) and int(kv.view()[2].min()) == 5
    assert v4.data_ptr() - pool.data_ptr() == 8192
    with pytest.raises(HostPoolError):
        kv.layer_view(6)
    with pytest.raises(HostPoolError):
        pool.as_tensor(torch.float32, (2,), offset=2)  # misaligned
    with pytest.raises(HostPoolError):
        pool.as_tensor(torch.uint8, (spec.nbytes + 1,))
    with pytest.raises(HostPoolError):
        HostKVLayout(pool, HostKVSpec(0, 4, 10, 656))
    assert pool.register_cuda() is torch.cuda.is_available()
    pool.close()
    assert int(v4[0, 0]) == 4  # a live view keeps the mapping; no use-after-unmap
    with pytest.raises(HostPoolError):
        _ = pool.tensor


def test_attach_errors_and_bad_args():
    with pytest.raises(HostPoolError):
        HostPool.attach("longctx-nope-1-00", 16)
    with pytest.raises(HostPoolError):
        HostPool.create(0, "x")
    with pytest.raises(HostPoolError):
        HostPool.create(16, "../etc")
    pool, name = HostPool.create(4096, "size")
    with pool, pytest.raises(HostPoolError):
        HostPool.attach(name, 8192)


def test_tempdir_fallback(monkeypatch, tmp_path):
    real_access = os.access
    monkeypatch.setattr(hp.os, "access", lambda p, m: False if p == "/dev/shm" else real_access(p, m))
    monkeypatch.setattr(hp.tempfile, "gettempdir", lambda: str(tmp_path))
    pool, name = HostPool.create(4096, "fallback")
    with pool:
        assert os.path.dirname(pool.path) == str(tmp_path)
        other = HostPool.attach(name, 4096)
        pool.tensor[1] = 9
        assert int(other.tensor[1]) == 9
        other.close()
