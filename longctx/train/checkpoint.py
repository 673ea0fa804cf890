"""Saving and resuming training: a loadable checkpoint plus a separate trainer-state file.

A training output directory is a normal longctx / transformers checkpoint (the names
`longctx.checkpoint` writes and loads: config.json, generation_config.json, tokenizer.json,
tokenizer_config.json, model.safetensors with per-expert tensor names), plus two files that are
not part of the shipped model:

- `trainer_state.pt`: step, recipe, and AdamW's moments per parameter name in bf16. By default
  only the second moments (`exp_avg_sq`) are kept: they are what makes a restart from zeros
  unsafe; the first moments rebuild in ~10 steps (beta1 = 0.9). This keeps a resumable
  directory at ~4 bytes per parameter, which is what fits the device machine's 64 MiB carry.
- `train_log.jsonl`: the loss curve, one JSON object per logged step, appended across resumes.

Weights are saved in `save_dtype` (bf16) and resumed from exactly those values, so the model a
resumed run starts from is the model that was shipped.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from longctx.checkpoint.layout import expected_weights, keeps_fp32
from longctx.checkpoint.loader import iter_weights
from longctx.checkpoint.tokenizer import save_tokenizer
from longctx.config import SELECTION_FIELDS, ModelConfig
from longctx.errors import CheckpointError, one_line, os_error_line
from longctx.paths import nearest_existing
from longctx.train.model import TrainCausalLM

TRAINER_STATE = "trainer_state.pt"
TRAIN_LOG = "train_log.jsonl"
MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "model.safetensors",
)


def checkpoint_tensors(model: TrainCausalLM, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The model's tensors under checkpoint names (experts unstacked), in checkpoint dtypes."""
    cfg = model.cfg
    inter = cfg.moe_intermediate_size
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        t = p.detach()
        if name.endswith("mlp.experts.gate_up_proj"):
            pre = name[: -len("gate_up_proj")]
            for e in range(t.shape[0]):
                out[f"{pre}{e}.gate_proj.weight"] = t[e, :inter]
                out[f"{pre}{e}.up_proj.weight"] = t[e, inter:]
        elif name.endswith("mlp.experts.down_proj"):
            pre = name[: -len("down_proj")]
            for e in range(t.shape[0]):
                out[f"{pre}{e}.down_proj.weight"] = t[e]
        else:
            out[name] = t
    want = expected_weights(cfg)
    if set(out) != set(want):
        extra, missing = sorted(set(out) - set(want)), sorted(set(want) - set(out))
        raise CheckpointError(f"model/checkpoint name mismatch: extra {extra[:3]}, missing {missing[:3]}")
    return {
        n: out[n].to(device="cpu", dtype=torch.float32 if keeps_fp32(n) else dtype).contiguous() for n in want
    }


def save_model(model: TrainCausalLM, out_dir: Path, dtype: torch.dtype) -> None:
    """Write the loadable checkpoint files of `model` into `out_dir` (which must exist)."""
    from safetensors.torch import save_file

    cfg = dataclasses.replace(model.cfg, torch_dtype=str(dtype).removeprefix("torch."), quant_block=None)
    save_file(checkpoint_tensors(model, dtype), str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(cfg.to_hf_dict(), indent=2) + "\n")
    gen: dict[str, Any] = {"_from_model_config": True, "eos_token_id": cfg.eos_token_id}
    if cfg.pad_token_id is not None:
        gen["pad_token_id"] = cfg.pad_token_id
    (out_dir / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    save_tokenizer(cfg, out_dir)


def optimizer_moments(
    model: TrainCausalLM, opt: torch.optim.Optimizer, momentum: bool
) -> dict[str, dict[str, torch.Tensor]]:
    out: dict[str, dict[str, torch.Tensor]] = {}
    for name, p in model.named_parameters():
        st = opt.state.get(p)
        if not st:
            continue
        keep = {"exp_avg_sq": st["exp_avg_sq"].to("cpu", torch.bfloat16)}
        if momentum:
            keep["exp_avg"] = st["exp_avg"].to("cpu", torch.bfloat16)
        out[name] = keep
    return out


def save_training(
    out_dir: str | Path,
    model: TrainCausalLM,
    opt: torch.optim.Optimizer,
    step: int,
    recipe: dict[str, Any],
    log_rows: list[dict[str, Any]],
    dtype: torch.dtype = torch.bfloat16,
    momentum: bool = False,
) -> Path:
    """Atomically (re)write `out_dir`: checkpoint + trainer state + log. Returns the directory."""
    out = Path(out_dir)
    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    try:  # a failed or interrupted write leaves `out` as it was and no partial copy beside it
        tmp.mkdir(parents=True)
        save_model(model, tmp, dtype)
        state = {"step": step, "recipe": recipe, "moments": optimizer_moments(model, opt, momentum)}
        torch.save(state, tmp / TRAINER_STATE)
        with (tmp / TRAIN_LOG).open("w") as f:
            for row in log_rows:
                f.write(json.dumps(row) + "\n")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = out.with_name(out.name + ".old")
    if out.exists():
        if old.exists():
            shutil.rmtree(old)
        os.replace(out, old)
    os.replace(tmp, out)
    if old.exists():
        shutil.rmtree(old)
    return out


def check_out_dir(out_dir: str | Path, resume: str | Path | None) -> None:
    """Refuse, before any training, an output directory the run could not save to or whose files a save
    would destroy (`save_training` replaces the whole directory): a file, a directory holding other files,
    or another run's checkpoint (only the resumed run's own directory may be saved over)."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"--out {out} is a file, not a directory")
    if out.is_dir() and any(out.iterdir()):
        if not (out / TRAINER_STATE).exists():
            raise CheckpointError(f"--out {out} holds files a save would delete: give a new or empty one")
        if resume is None or out.resolve() != Path(resume).resolve():
            raise CheckpointError(
                f"--out {out} holds a training run: --resume {out} to go on, or another --out"
            )
    parent = nearest_existing(out.parent)  # (the save creates the missing ones)
    if not parent.is_dir():
        raise CheckpointError(f"--out {out} cannot be written: {parent} is a file")
    try:  # a save writes a sibling of `out`, then renames it
        tempfile.TemporaryDirectory(dir=parent).cleanup()
    except OSError as e:
        raise CheckpointError(f"--out {out} cannot be written: {os_error_line(e)}") from None


def load_model_weights(model: TrainCausalLM, model_dir: str | Path, device: torch.device) -> None:
    """Load a checkpoint's weights into `model` through the engine's own loader, as fp32 trainables."""
    cfg = ModelConfig.from_json(model_dir)
    # (the dtype and how the indexers select are not the weights': --index-local-window may change the
    # window, the benches any of the selection's fields)
    m = model.cfg
    same = dataclasses.replace(
        cfg, torch_dtype=m.torch_dtype, **{name: getattr(m, name) for name in SELECTION_FIELDS}
    )
    if same != model.cfg:
        raise CheckpointError(f"{model_dir} holds a different architecture than the training config")
    model.load_weights(iter_weights(model_dir, cfg, dtype=torch.float32), device, torch.float32)
    model.mark_trainable()


def _trainer_state(model_dir: str | Path, mmap: bool = False) -> dict[str, Any]:
    p = Path(model_dir) / TRAINER_STATE
    if not Path(model_dir).is_dir():
        raise CheckpointError(f"{model_dir} is not a directory: not a training checkpoint")
    if not p.exists():
        raise CheckpointError(f"{model_dir} has no {TRAINER_STATE}: not a training checkpoint")
    try:
        state = torch.load(p, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as e:  # truncated, not a torch file, ...: whatever torch says, on one line
        raise CheckpointError(f"cannot read {p}: {one_line(e)}") from None
    if not isinstance(state, dict) or not {"step", "recipe", "moments"} <= state.keys():
        raise CheckpointError(f"{p} is not a trainer state (step, recipe, moments)")
    return state


def read_training(model_dir: str | Path) -> dict[str, Any]:
    """The trainer state and log of a training output directory."""
    d = Path(model_dir)
    state = _trainer_state(d)
    rows = []
    log = d / TRAIN_LOG
    for i, line in enumerate(log.read_text().splitlines() if log.exists() else [], 1):
        try:
            rows += [json.loads(line)] if line.strip() else []
        except json.JSONDecodeError:
            raise CheckpointError(f"{log}: line {i} is not JSON") from None
    state["log"] = rows
    return state


def read_recipe(model_dir: str | Path) -> dict[str, Any]:
    """The recipe a training output directory was saved with (the trainer state memory-mapped: the
    moments are not read)."""
    return dict(_trainer_state(model_dir, mmap=True)["recipe"])


def restore_moments(
    model: TrainCausalLM, opt: torch.optim.Optimizer, moments: dict[str, dict[str, torch.Tensor]], step: int
) -> int:
    """Seed AdamW's state from saved moments (missing exp_avg -> zeros). Returns params restored."""
    fused = any(g.get("fused") for g in opt.param_groups)
    n = 0
    for name, p in model.named_parameters():
        m = moments.get(name)
        if m is None or not p.requires_grad:
            continue
        sq = m["exp_avg_sq"].to(p.device, torch.float32)
        if sq.shape != p.shape:
            raise CheckpointError(f"optimizer state of {name}: shape {tuple(sq.shape)} != {tuple(p.shape)}")
        avg = m["exp_avg"].to(p.device, torch.float32) if "exp_avg" in m else torch.zeros_like(p)
        step_t = torch.tensor(float(step), dtype=torch.float32, device=p.device if fused else "cpu")
        opt.state[p] = {"step": step_t, "exp_avg": avg, "exp_avg_sq": sq}
        n += 1
    return n


def export_model(src: str | Path, dst: str | Path) -> Path:
    """Copy only the shipped checkpoint files (no trainer state, no log) from `src` to `dst`."""
    s, d = Path(src), Path(dst)
    d.mkdir(parents=True, exist_ok=True)
    for f in MODEL_FILES:
        shutil.copy2(s / f, d / f)
    return d
