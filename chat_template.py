"""Chat templates, rendered the way transformers renders them (docs/spec.md §2: a row is a
ChatML conversation).

What it holds: Qwen2.5-Instruct's template (the default for a checkpoint that brings none,
and what `chatml_template` re-targets to another default system turn), and `render_chat`,
which compiles a template as transformers' `apply_chat_template` does (sandboxed jinja2,
trim/lstrip blocks, its `tojson`, `raise_exception`, `strftime_now`) and renders a
conversation of system / user / assistant turns.

What it leaves to others: reading a checkpoint's template and turning the text into ids
(tokenizer.py: `Tokenizer.render_chat`, `encode_chat`, the MARS loss span in
`encode_chat_with_loss_mask`); which system turn the default data uses (data/synthetic.py).
It knows no tokens, only text.
"""

import json
from datetime import datetime
from functools import lru_cache

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

DEFAULT_SYSTEM_PROMPT = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."

# Qwen2.5-Instruct's chat template, written into tokenizer_config.json by save() so that
# transformers' apply_chat_template works on our files. render_chat() is its non-tool branch.
QWEN25_CHAT_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""  # noqa: E501, RUF100


def chatml_template(default_system: str) -> str:
    """Qwen2.5-Instruct's template with another default system turn (used when a conversation
    brings none): a checkpoint should carry the system turn of the data it was trained on."""
    literal = default_system.replace("\\", "\\\\").replace("'", "\\'")
    return QWEN25_CHAT_TEMPLATE.replace(DEFAULT_SYSTEM_PROMPT, literal)


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # transformers' tojson: no HTML escaping (jinja's own filter escapes < > &)
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@lru_cache(maxsize=16)
def compile_template(template: str) -> jinja2.Template:
    """A chat template compiled as transformers compiles it (utils/chat_template_utils.py):
    sandboxed, trim_blocks and lstrip_blocks, loop controls, and its tojson / raise_exception /
    strftime_now. (Its {% generation %} tag, used only for assistant masks, is not provided.)"""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


def render_chat(messages: list[dict], add_generation_prompt: bool = False,
                template: str = QWEN25_CHAT_TEMPLATE, special_tokens: dict | None = None) -> str:
    """A conversation of system / user / assistant turns rendered by a chat template
    (default: Qwen2.5-Instruct's), with the special-token names transformers passes."""
    for m in messages:
        if m["role"] not in ("system", "user", "assistant") or m.get("tool_calls"):
            raise ValueError(f"render_chat: role {m['role']!r} / tool calls are not supported")
        if not isinstance(m["content"], str):
            raise TypeError(f"render_chat: a {m['role']} message's content is not a string")
    if not messages:
        raise ValueError("render_chat: no messages")
    return compile_template(template).render(messages=list(messages), tools=None, documents=None,
                                             add_generation_prompt=add_generation_prompt,
                                             **(special_tokens or {}))
