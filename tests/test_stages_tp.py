"""In-process pieces of the stage runtime: TP weight sharding (plain and fp8) and the host-pool backup."""

from __future__ import annotations

import dataclasses
import os
import re

import pytest
import torch
from longctx.kernels.kv_layout import write_mla_kv_ref

from longctx.checkpoint.fp8 import FP8_DTYPE, dequantize_fp8_block
from longctx.checkpoint.loader import iter_weights
from longctx.config import ModelConfig
from longctx.engine.worker import build_model
from longctx.errors import ConfigError
from longctx.kvstore.pool import PagedKVPool, host_kv_spec
from longctx.model.context import ForwardContext
from longctx.stages.host import HostBackedKV, open_stage_host_pool
from longctx.stages.tp import TPShard
from tests.conftest import make_checkpoint, tiny_config

SHARDED = re.compile(r"(q_b_proj|kv_b_proj|o_proj|gate_proj|up_proj|down_proj|embed_tokens|lm_head)\.weight$")


def _dense(weights, block) -> tuple[dict[str, torch.Tensor], int]:
    """name -> float tensor (fp8 weights dequantised with the scale that follows them), # fp8."""
    out: dict[str, torch.Tensor] = {}
    pending = None
    n_fp8 = 0
    for name, t in weights:
        if pending is not None:
            out[pending[0]] = dequantize_fp8_block(pending[1], t, block, torch.float32)
            pending = None
        elif t.dtype == FP8_DTYPE:
            pending = (name, t)
            n_fp8 += 1
        else:
            out[name] = t.float()
    return out, n_fp8


@pytest.mark.parametrize("fp8,block", [(False, None), (True, (16, 16)), (True, (32, 32))])
def test_shards_reassemble_the_checkpoint(tmp_path, fp8, block):
    cfg = dataclasses.replace(tiny_config(), quant_block=block)
    cfg = ModelConfig.from_json(make_checkpoint(tmp_path, cfg, fp8=fp8))
    d = tmp_path
    full, n_fp8 = _dense(iter_weights(d, cfg, keep_fp8=fp8), block)
    assert (n_fp8 > 0) == fp8
    tp = 2
    parts = [
        _dense(TPShard(cfg, r, tp).shard_weights(iter_weights(d, cfg, keep_fp8=fp8)), block)[0]
        for r in range(tp)
    ]
    E = cfg.n_routed_experts
    for name, w in full.items():
        m = re.match(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(.+)$", name)
        if m:  # each expert lives on exactly one rank, renumbered from 0
            e, r = int(m.group(2)), int(m.group(2)) * tp // E
            local = f"{m.group(1)}.{e - r * E // tp}.{m.group(3)}"
            assert torch.equal(parts[r][local], w)
            continue
        if "indexer" not in name and SHARDED.search(name):
            dim = 1 if (name.endswith("o_proj.weight") or name.endswith("down_proj.weight")) else 0
            torch.testing.assert_close(torch.cat([p[name] for p in parts], dim=dim), w, rtol=0, atol=0)
        else:
            assert all(torch.equal(p[name], w) for p in parts), name


def test_sharded_model_shapes(tiny_dir):
    cfg = tiny_config()
    shard = TPShard(cfg, 1, 2)
    model = build_model(
        tiny_dir,
        cfg,
        range(0, 2),
        torch.device("cpu"),
        torch.float32,
        False,
        shard.shard_weights,
        lambda m: shard.shard_model(m, lambda t: None, lambda t: t[None]),
    )
    attn = model.model.layers["1"].self_attn
    assert attn.n_heads == cfg.num_attention_heads // 2
    assert attn.w_uk.shape[0] == attn.n_heads
    assert model.model.layers["1"].mlp.experts.gate_up_proj.shape[0] == cfg.n_routed_experts // 2
    assert model.model.layers["0"].mlp.gate_proj.weight.shape[0] == cfg.intermediate_size // 2
    with pytest.raises(ConfigError):
        TPShard(cfg, 0, 3)


def test_host_backup_copies_new_rows(tmp_path):
    cfg = tiny_config()
    layers = range(2, 4)
    pool = PagedKVPool(cfg, layers, 4, "auto", torch.float32, torch.device("cpu"), 64)
    layout = open_stage_host_pool(
        host_kv_spec(cfg, layers, 4 * 64, "auto", torch.float32), 0, 0, 0, None, False
    )
    name = layout.pool.name
    assert not os.path.exists(os.path.join("/dev/shm", name))  # unlinked once attached
    kv = HostBackedKV(pool, layout, writer=True, use_triton=False)
    slots = torch.tensor([3, 64, 65, 200])
    ctx = ForwardContext(
        positions=torch.arange(4),
        q_seq=torch.zeros(4, dtype=torch.int32),
        q_start=[0, 4],
        seq_lens=torch.tensor([4], dtype=torch.int32),
        seq_lens_cpu=[4],
        page_table=torch.zeros(1, 1, dtype=torch.int32),
        slot_mapping=slots,
        kv=kv,
    )
    c, r = torch.randn(4, cfg.kv_lora_rank), torch.randn(4, cfg.qk_rope_head_dim)
    write_mla_kv_ref(kv.mla_pool(3), slots, c, r, kv.mla_kind(3))
    kv.after_write(3, ctx)
    kv.end_step()
    host = layout.layer_view(3).view(torch.float32)
    assert torch.equal(host[slots], kv.mla_pool(3)[slots])
    assert host[slots].abs().sum() > 0 and layout.layer_view(2).count_nonzero() == 0
    assert kv.stats()["host_backup_bytes"] == 4 * layout.spec.rows_of(3)
    kv.close()
