"""The Kimi chat format, rendered the same way by Python (engine, trainer) and by Jinja (tokenizer_config.json).

    [<|im_system|>tool_declare<|im_middle|>TOOLS_JSON<|im_end|>]
    [<|im_system|>reasoning_effort<|im_middle|>low|high|max<|im_end|>]
    <|im_system|>system<|im_middle|>...<|im_end|>
    <|im_user|>user<|im_middle|>...<|im_end|>
    <|im_assistant|>assistant<|im_middle|><think>...</think>answer[TOOL_CALLS]<|im_end|>
    <|im_system|>tool<|im_middle|>## Return of functions.get_weather:0\n...<|im_end|>

An image part of a message is `<|media_begin|>image<|media_content|><|media_pad|><|media_end|>` (Kimi K2.5's
marker); the engine repeats `<|media_pad|>` once per merged patch of the image.

Tool calls use the Kimi K2 section markers; a call's id is `functions.NAME:INDEX`.
"""

from __future__ import annotations

import json
from typing import Any

IM_SYSTEM, IM_USER, IM_ASSISTANT = "<|im_system|>", "<|im_user|>", "<|im_assistant|>"
IM_MIDDLE, IM_END = "<|im_middle|>", "<|im_end|>"
CALLS_BEGIN, CALLS_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CALL_BEGIN, CALL_ARGS, CALL_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
THINK_BEGIN, THINK_END = "<think>", "</think>"
PAD = "<|pad|>"
MEDIA_BEGIN, MEDIA_CONTENT, MEDIA_PAD, MEDIA_END = (
    "<|media_begin|>",
    "<|media_content|>",
    "<|media_pad|>",
    "<|media_end|>",
)
IMAGE_MARKER = f"{MEDIA_BEGIN}image{MEDIA_CONTENT}{MEDIA_PAD}{MEDIA_END}"
IMAGE_PART_TYPES = ("image_url", "image")  # OpenAI's part, and transformers' processor convention

# Control tokens dropped from output text; the markers the parsers read must survive decoding.
SPECIAL_TOKENS = [PAD, IM_SYSTEM, IM_USER, IM_ASSISTANT, IM_MIDDLE, IM_END]
MARKER_TOKENS = [CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_ARGS, CALL_END, THINK_BEGIN, THINK_END]
MEDIA_TOKENS = [MEDIA_BEGIN, MEDIA_CONTENT, MEDIA_PAD, MEDIA_END]  # control tokens too: dropped from output text
REASONING_EFFORTS = ("low", "high", "max")
GENERATION_PROMPT = f"{IM_ASSISTANT}assistant{IM_MIDDLE}"


def tools_json(tools: list[dict[str, Any]]) -> str:
    return json.dumps(tools, separators=(",", ":"), ensure_ascii=False)


def tool_call_id(name: str, index: int) -> str:
    return f"functions.{name}:{index}"


def render_tool_calls(calls: list[dict[str, Any]]) -> str:
    """OpenAI-style `tool_calls` (function name + JSON-string arguments) → Kimi K2 section."""
    parts = [CALLS_BEGIN]
    for i, call in enumerate(calls):
        fn = call["function"]
        args = fn["arguments"]
        args = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
        parts.append(f"{CALL_BEGIN}{call.get('id') or tool_call_id(fn['name'], i)}{CALL_ARGS}{args}{CALL_END}")
    return "".join(parts) + CALLS_END


def content_text(content: str | list[dict[str, Any]] | None) -> str:
    """A message's content as template text: text parts in order, an image marker for each image part."""
    if not content:
        return ""
    if isinstance(content, str):
        return content
    return "".join(IMAGE_MARKER if p["type"] in IMAGE_PART_TYPES else p.get("text", "") for p in content)


def render_message(message: dict[str, Any]) -> str:
    role, content = message["role"], content_text(message.get("content"))
    if role == "system":
        return f"{IM_SYSTEM}system{IM_MIDDLE}{content}{IM_END}"
    if role == "user":
        return f"{IM_USER}user{IM_MIDDLE}{content}{IM_END}"
    if role == "tool":
        return f"{IM_SYSTEM}tool{IM_MIDDLE}## Return of {message.get('tool_call_id', '')}\n{content}{IM_END}"
    if role == "assistant":
        text = GENERATION_PROMPT
        if message.get("reasoning_content"):
            text += f"{THINK_BEGIN}{message['reasoning_content']}{THINK_END}"
        text += content
        if message.get("tool_calls"):
            text += render_tool_calls(message["tool_calls"])
        return text + IM_END
    raise ValueError(f"messages: unknown role {role!r}")


def render_chat(
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool = True,
    reasoning_effort: str | None = None,
) -> str:
    """The prompt text for a conversation (what the model is trained on and served with)."""
    if reasoning_effort is not None and reasoning_effort not in REASONING_EFFORTS:
        raise ValueError(f"reasoning_effort must be one of {REASONING_EFFORTS}, got {reasoning_effort!r}")
    text = ""
    if tools:
        text += f"{IM_SYSTEM}tool_declare{IM_MIDDLE}{tools_json(tools)}{IM_END}"
    if reasoning_effort:
        text += f"{IM_SYSTEM}reasoning_effort{IM_MIDDLE}{reasoning_effort}{IM_END}"
    text += "".join(render_message(m) for m in messages)
    if add_generation_prompt:
        text += GENERATION_PROMPT
    return text


# The same rendering in Jinja, stored in tokenizer_config.json so `apply_chat_template` agrees (tested).
JINJA_TEMPLATE = (
    "{%- macro text(c) -%}{%- if c is string -%}{{ c }}{%- elif c -%}{%- for p in c -%}"
    "{%- if p.type == 'text' -%}{{ p.text }}{%- elif p.type in ['image_url', 'image'] -%}"
    "<|media_begin|>image<|media_content|><|media_pad|><|media_end|>{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{%- endmacro -%}"
    "{%- if tools -%}<|im_system|>tool_declare<|im_middle|>{{ tools | tojson(separators=(',', ':')) }}<|im_end|>"
    "{%- endif -%}"
    "{%- if reasoning_effort -%}<|im_system|>reasoning_effort<|im_middle|>{{ reasoning_effort }}<|im_end|>"
    "{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'system' -%}<|im_system|>system<|im_middle|>{{ text(m.content) }}<|im_end|>"
    "{%- elif m.role == 'user' -%}<|im_user|>user<|im_middle|>{{ text(m.content) }}<|im_end|>"
    "{%- elif m.role == 'tool' -%}<|im_system|>tool<|im_middle|>## Return of {{ m.tool_call_id or '' }}\n"
    "{{ text(m.content) }}<|im_end|>"
    "{%- elif m.role == 'assistant' -%}<|im_assistant|>assistant<|im_middle|>"
    "{%- if m.reasoning_content -%}<think>{{ m.reasoning_content }}</think>{%- endif -%}"
    "{{ text(m.content) }}"
    "{%- if m.tool_calls -%}<|tool_calls_section_begin|>"
    "{%- for c in m.tool_calls -%}<|tool_call_begin|>"
    "{{ c.id or ('functions.' ~ c.function.name ~ ':' ~ loop.index0) }}<|tool_call_argument_begin|>"
    "{%- if c.function.arguments is string -%}{{ c.function.arguments }}"
    "{%- else -%}{{ c.function.arguments | tojson }}{%- endif -%}<|tool_call_end|>"
    "{%- endfor -%}<|tool_calls_section_end|>{%- endif -%}<|im_end|>"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
)
