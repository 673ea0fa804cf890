"""A checkpoint's generation_config.json: its EOS ids end the engine's generations, and `longctx serve` takes
its sampling defaults for the fields a request leaves out (`--generation-config auto`, vLLM's default)."""

from __future__ import annotations

import json
import shutil

import pytest

from longctx.checkpoint.generation_config import GenerationDefaults, load_generation_config
from longctx.errors import CheckpointError

from .server_helpers import fake_server, openai_client


def test_the_file_read_and_checked(tmp_path):
    assert load_generation_config(tmp_path) == GenerationDefaults()  # (no file: no defaults)
    f = tmp_path / "generation_config.json"
    f.write_text(
        json.dumps(
            {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "eos_token_id": [5, 7], "do_sample": True}
        )
    )
    g = load_generation_config(tmp_path)
    assert g.sampling() == {"temperature": 0.6, "top_p": 0.95, "top_k": 20} and g.eos_token_ids == (5, 7)
    for bad, words in [
        ({"temperature": -1}, "temperature -1"),
        ({"top_p": 0}, "top_p 0"),
        ({"top_k": 2.5}, "top_k 2.5"),
        ({"max_new_tokens": True}, "max_new_tokens True"),
        ({"eos_token_id": ["x"]}, "eos_token_id must be"),
    ]:
        f.write_text(json.dumps(bad))
        with pytest.raises(CheckpointError, match=words):
            load_generation_config(tmp_path)
    f.write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        load_generation_config(tmp_path)


def test_its_eos_ids_end_the_engines_generations(tiny_dir, tmp_path):
    from longctx import Engine

    d = tmp_path / "m"
    shutil.copytree(tiny_dir, d)
    prompt = list(b"a prompt to go on from")
    with Engine(str(d), device="cpu") as e:
        free = e.generate(prompt, max_new_tokens=12, ignore_eos=True)[0].token_ids
    stop = free[4]
    cut = free.index(stop)
    gen = json.loads((d / "generation_config.json").read_text())
    (d / "generation_config.json").write_text(
        json.dumps({**gen, "eos_token_id": [gen["eos_token_id"], stop]})
    )
    with Engine(str(d), device="cpu") as e:
        assert stop in e.cfg.eos_ids()
        out = e.generate(prompt, max_new_tokens=12)[0]
    assert out.token_ids == free[: cut + 1] and out.finish_reason == "stop"


def test_serve_takes_its_sampling_defaults(tmp_path):
    """The fake engine echoes the prompt when greedy and writes random bytes otherwise: a file with
    temperature 0 makes a request without one greedy, and its max_new_tokens the default max_tokens;
    `--generation-config none` and a request's own fields win over it."""
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "max_new_tokens": 5}))
    msgs = [{"role": "user", "content": "echo me back please"}]
    with fake_server(tmp_path, "--served-model-name", "fake") as s:
        c = openai_client(s)
        r = c.chat.completions.create(model="fake", messages=msgs)
        again = c.chat.completions.create(model="fake", messages=msgs)
        assert (
            r.usage.completion_tokens == 5
            and r.choices[0].message.content == again.choices[0].message.content
        )
        assert r.choices[0].message.content == "\ne"  # (greedy: the echo of [gMASK]<sop><|user|>\ne...)
        own = c.chat.completions.create(model="fake", messages=msgs, max_tokens=3, temperature=1.0, seed=1)
        assert own.usage.completion_tokens == 3 and "echo" not in (own.choices[0].message.content or "")
    with fake_server(
        tmp_path, "--served-model-name", "fake", "--generation-config", "none", "--max-context", "64"
    ) as s:
        r = openai_client(s).chat.completions.create(model="fake", messages=msgs, seed=3)
        assert r.usage.completion_tokens > 5  # (the rest of the context)
