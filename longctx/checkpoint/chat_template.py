"""Chat templates: GLM's prompt format, rendered with jinja2 like transformers does.

The default template (written into random checkpoints' `tokenizer_config.json`) is GLM-like:
`[gMASK]<sop>` then `<|role|>\\n{content}` per message, then `<|assistant|>\\n` as the generation
prompt. A model directory's own template (`chat_template` in tokenizer_config.json, or
`chat_template.jinja`) takes precedence when the caller passes it in.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from longctx.errors import CheckpointError, RequestError

ROLES = ("system", "user", "assistant", "observation")
# POST /v1/documents/{id}/ask's user turn is `document + DOCUMENT_QUESTION_SEPARATOR + question`
# (server/routes_documents.py); the trainer's document rows (train/data.py) render the same form
DOCUMENT_QUESTION_SEPARATOR = "\n\n"
_ROLE_ALIASES = {"tool": "observation"}

# With `tools`, a system turn lists them (one JSON object a line) after this text; an assistant turn's tool calls
# follow its content in GLM's call format, which `longctx.server.tools.parse_calls` reads back.
TOOLS_PREAMBLE = (
    "# Tools\n"
    "To call a tool, write <tool_call> and its name, then for each argument <arg_key>the name of the argument"
    "</arg_key><arg_value>its value (text as it is, anything else as JSON)</arg_value>, then </tool_call>. "
    "The tools:"
)

DEFAULT_CHAT_TEMPLATE = (
    "[gMASK]<sop>"
    "{% if tools %}<|system|>\n"
    + TOOLS_PREAMBLE
    + "{% for t in tools %}{{ '\\n' + (t | tojson) }}{% endfor %}{% endif %}"
    "{% for m in messages %}"
    "{% set role = 'observation' if m['role'] == 'tool' else m['role'] %}"
    "{% if role not in ['system', 'user', 'assistant', 'observation'] %}"
    "{{ raise_exception('unknown chat role ' + m['role']) }}"
    "{% endif %}"
    # transformers passes OpenAI-style content lists through unflattened: join their text parts.
    "{% if m['content'] is string %}{% set c = m['content'] %}"
    "{% elif m['content'] is none %}{% set c = '' %}"
    "{% else %}{% set c = m['content'] | selectattr('type', 'equalto', 'text') | map(attribute='text') | join('') %}"
    "{% endif %}"
    "{{ '<|' + role + '|>\\n' + c }}"
    "{% for tc in m['tool_calls'] or [] %}{% set f = tc['function'] if tc['function'] is defined else tc %}"
    "{{ '<tool_call>' + f['name'] }}{% set a = f['arguments'] %}"
    "{% if a is mapping %}{% for k, v in a.items() %}"
    "{{ '<arg_key>' + k + '</arg_key><arg_value>' + (v if v is string else v | tojson) + '</arg_value>' }}"
    "{% endfor %}{% elif a %}{{ a }}{% endif %}{{ '</tool_call>' }}{% endfor %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)


def _content_text(content: Any) -> str:
    # OpenAI-style content may be a list of parts; only text parts mean anything to a text model.
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence):
        parts = []
        for p in content:
            if isinstance(p, Mapping) and p.get("type", "text") == "text":
                parts.append(str(p.get("text", "")))
            elif isinstance(p, str):
                parts.append(p)
            else:
                raise RequestError(f"unsupported message content part {p!r:.60}")
        return "".join(parts)
    raise RequestError(
        f"message content must be a string or a list of text parts, not {type(content).__name__}"
    )


def normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Check roles and flatten content to strings (a one-line RequestError on bad input)."""
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or "role" not in m:
            raise RequestError(f"message {i} has no 'role'")
        role = str(m["role"])
        if _ROLE_ALIASES.get(role, role) not in ROLES:
            raise RequestError(f"message {i} has unknown role {role!r}; use one of {', '.join(ROLES)}, tool")
        msg = {**m, "role": role, "content": _content_text(m.get("content"))}
        if m.get("tool_calls"):
            msg["tool_calls"] = [_call_with_dict_arguments(tc) for tc in m["tool_calls"]]
        out.append(msg)
    return out


def _call_with_dict_arguments(tc: Any) -> Any:
    """A message's tool call with its function's `arguments` (OpenAI's JSON text) as a dict, where that text
    is a JSON object: templates iterate the arguments (GLM's write `<arg_key>` / `<arg_value>` pairs)."""
    if not isinstance(tc, Mapping):
        raise RequestError(f"a tool call must be an object, got {tc!r:.60}")
    f = tc.get("function", tc)
    if not isinstance(f, Mapping) or not isinstance(f.get("name"), str):
        raise RequestError(f"a tool call needs a function name, got {tc!r:.60}")
    a = f.get("arguments")
    if isinstance(a, str):
        try:
            parsed = json.loads(a)
        except ValueError:
            parsed = None
        if isinstance(parsed, dict):
            f = {**f, "arguments": parsed}
            return {**tc, "function": f} if "function" in tc else f
    return tc


def _tojson(x: Any) -> str:
    return json.dumps(x, ensure_ascii=False)


def _render_builtin(
    messages: list[dict[str, Any]], add_generation_prompt: bool, tools: Sequence[Any] | None = None
) -> str:
    # Same output as DEFAULT_CHAT_TEMPLATE, for environments without jinja2.
    s = "[gMASK]<sop>"
    if tools:
        s += "<|system|>\n" + TOOLS_PREAMBLE + "".join("\n" + _tojson(t) for t in tools)
    for m in messages:
        s += f"<|{_ROLE_ALIASES.get(m['role'], m['role'])}|>\n{m['content']}"
        for tc in m.get("tool_calls") or []:
            f = tc.get("function", tc)
            s += "<tool_call>" + f["name"]
            a = f.get("arguments")
            if isinstance(a, Mapping):
                for k, v in a.items():
                    s += f"<arg_key>{k}</arg_key><arg_value>{v if isinstance(v, str) else _tojson(v)}</arg_value>"
            elif a:
                s += str(a)
            s += "</tool_call>"
    if add_generation_prompt:
        s += "<|assistant|>\n"
    return s


def _raise(msg: str) -> None:
    raise RequestError(str(msg).splitlines()[0] if msg else "chat template error")


def _environment() -> Any:
    """The jinja environment templates render in: transformers' options, so templates render identically."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    return ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[])


def check_chat_template(template: str) -> None:
    """A RequestError (one line, with the line number) for a template jinja cannot parse."""
    import jinja2

    try:
        _environment().parse(template)
    except jinja2.TemplateSyntaxError as e:
        raise RequestError(f"line {e.lineno}: {e.message}") from None


def _render_jinja(
    template: str, messages: list[dict[str, Any]], add_generation_prompt: bool, **kw: Any
) -> str:
    import jinja2

    env = _environment()
    env.globals["raise_exception"] = _raise
    env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(x, ensure_ascii=False, indent=indent)
    try:
        return env.from_string(template).render(
            messages=messages, add_generation_prompt=add_generation_prompt, **kw
        )
    except jinja2.TemplateError as e:
        raise RequestError(f"chat template failed: {str(e).splitlines()[0] if str(e) else e!r}") from None


def apply_chat_template(
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool = True,
    template: str | None = None,
    use_jinja: bool | None = None,
    **template_kwargs: Any,
) -> str:
    """Render chat `messages` ([{"role", "content"}, ...]) into the prompt text.

    `template` is a jinja chat template (default: `DEFAULT_CHAT_TEMPLATE`). With jinja2 installed
    it renders like transformers' `apply_chat_template(tokenize=False)`; without it only the
    default template can be rendered (by a built-in renderer with identical output).
    `use_jinja=False` forces the built-in renderer (tests compare the two).
    """
    msgs = normalize_messages(messages)
    tpl = DEFAULT_CHAT_TEMPLATE if template is None else template
    if use_jinja is None:
        try:
            import jinja2  # noqa: F401

            use_jinja = True
        except ImportError:
            use_jinja = False
    if use_jinja:
        return _render_jinja(tpl, msgs, add_generation_prompt, **template_kwargs)
    if tpl != DEFAULT_CHAT_TEMPLATE:
        raise RequestError("this model's chat template needs jinja2 (pip install jinja2)")
    return _render_builtin(msgs, add_generation_prompt, template_kwargs.get("tools"))


def load_chat_template(model_dir: str | Path) -> str | None:
    """A model directory's chat template (`chat_template.jinja` or tokenizer_config.json), or None."""
    d = Path(model_dir)
    jinja_file = d / "chat_template.jinja"
    if jinja_file.exists():
        try:
            return jinja_file.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:  # (a traceback before)
            raise CheckpointError(f"{jinja_file} is not valid UTF-8 (byte {e.start})") from None
    cfg_file = d / "tokenizer_config.json"
    if not cfg_file.exists():
        return None
    try:  # (bytes: a file that is not UTF-8 failed in read_text, a traceback; so did one not an object)
        cfg = json.loads(cfg_file.read_bytes())
    except ValueError as e:  # (JSONDecodeError, UnicodeDecodeError)
        raise CheckpointError(f"{cfg_file} is not valid JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{cfg_file} is not a JSON object")
    tpl = cfg.get("chat_template")
    if isinstance(tpl, list):  # transformers also allows [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in tpl if isinstance(t, Mapping)}
        tpl = named.get("default")
    return tpl if isinstance(tpl, str) else None
