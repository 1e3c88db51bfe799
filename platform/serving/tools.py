"""OpenAI tools on the request side: `tools`, `tool_choice`, `parallel_tool_calls`, and
the conversation (assistant `tool_calls`, `role: "tool"` results) rendered into the prompt.

A chat template with tool support (it reads `tools`, as Qwen2's does) renders the tools
and the tool turns itself. A template without it (SmolLM2's) gets the Hermes-style system
prompt below, assistant calls written as `<tool_call>` blocks and tool results as
`<tool_response>` user turns: the format the Hermes parser reads back and the
`required`/named grammar produces.

`tool_choice`: "none" (tools are not shown to the model, no call is parsed), "auto" (the
default with tools: calls are parsed from the output by the model family's parser),
"required" and a named function (the output is constrained to calls by the grammar).
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from loraplex.engine.errors import InvalidRequestError
from loraplex.engine.structured import StructuredOutput

from loraplex.platform.errors import BadRequestError
from loraplex.platform.serving.tool_parsers import PARSERS, ToolParser, parser_family

TOOLS_SYSTEM_PROMPT = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


@dataclass(frozen=True)
class ToolRequest:
    """A chat request's tools and how they may be called."""

    tools: tuple[dict, ...]
    choice: str  # none | auto | required | named
    name: str | None = None  # the function, when choice is "named"
    parallel: bool = True
    family: str = "hermes"  # the format `auto` calls are parsed in (tool_parsers.PARSERS)

    @property
    def constrained(self) -> bool:
        return self.choice in ("required", "named")

    @property
    def parses_calls(self) -> bool:
        return self.choice != "none"

    def constraint(self) -> StructuredOutput | None:
        """The grammar of `required` / named calls (Hermes format); None otherwise."""
        if not self.constrained:
            return None
        choice: Any = "required" if self.choice == "required" else {"type": "function",
                                                                   "function": {"name": self.name}}
        try:
            return StructuredOutput.tool_call(list(self.tools), choice, self.parallel)
        except InvalidRequestError as exc:
            raise BadRequestError(str(exc), "tools") from None

    def for_template(self, chat_template: str | None) -> "ToolRequest":
        """Constrained output is in the grammar's (Hermes) format whatever the family."""
        return replace(self, family="hermes" if self.constrained else parser_family(chat_template))

    def new_parser(self) -> ToolParser | None:
        """A parser for one choice's output; None when calls are not parsed."""
        return PARSERS[self.family](self.parallel) if self.parses_calls else None


def parse_tools(body: dict) -> ToolRequest | None:
    tools, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls", True)
    if parallel is None:
        parallel = True
    if not isinstance(parallel, bool):
        raise BadRequestError("parallel_tool_calls must be a boolean", "parallel_tool_calls")
    if not tools:
        if tools is not None and not isinstance(tools, list):
            raise BadRequestError("tools must be a list of functions", "tools")
        if choice not in (None, "none"):
            raise BadRequestError("tool_choice needs tools", "tool_choice")
        return None
    if not isinstance(tools, list):
        raise BadRequestError("tools must be a list of functions", "tools")
    checked = tuple(_tool(t, i) for i, t in enumerate(tools))
    names = [t["function"]["name"] for t in checked]
    if len(set(names)) != len(names):
        raise BadRequestError("tools declare the same function name twice", "tools")
    if choice is None or choice in ("none", "auto", "required"):
        return ToolRequest(checked, choice or "auto", None, parallel)
    fn = choice.get("function") if isinstance(choice, Mapping) and choice.get("type") == "function" else None
    name = fn.get("name") if isinstance(fn, Mapping) else None
    if not isinstance(name, str):
        raise BadRequestError('tool_choice must be "none", "auto", "required" or '
                              '{"type": "function", "function": {"name": ...}}', "tool_choice")
    if name not in names:
        raise BadRequestError(f"tool_choice names function {name!r}, which is not in tools", "tool_choice")
    return ToolRequest(checked, "named", name, parallel)


def _tool(tool: Any, i: int) -> dict:
    where = f"tools[{i}]"
    if not isinstance(tool, Mapping) or tool.get("type") != "function" or not isinstance(tool.get("function"), Mapping):
        raise BadRequestError(f"{where} must be {{'type': 'function', 'function': {{...}}}}", "tools")
    fn = tool["function"]
    unknown = set(fn) - {"name", "description", "parameters", "strict"}
    if unknown:
        raise BadRequestError(f"{where}.function has unknown fields: {', '.join(sorted(unknown))}", "tools")
    if not isinstance(fn.get("name"), str) or not fn["name"]:
        raise BadRequestError(f"{where}.function.name must be a non-empty string", "tools")
    if fn.get("description") is not None and not isinstance(fn["description"], str):
        raise BadRequestError(f"{where}.function.description must be a string", "tools")
    params = fn.get("parameters")
    if params is not None and not isinstance(params, Mapping):
        raise BadRequestError(f"{where}.function.parameters must be a JSON schema object", "tools")
    out = {"name": fn["name"]}
    if fn.get("description"):
        out["description"] = fn["description"]
    out["parameters"] = dict(params) if params is not None else {"type": "object", "properties": {}}
    return {"type": "function", "function": out}


# -- the conversation, rendered for the template --------------------------------------
def template_supports_tools(chat_template: str | None) -> bool:
    return bool(chat_template) and "tools" in chat_template


def prepare_messages(messages: Any, tools: ToolRequest | None, native: bool) -> tuple[Any, list[dict] | None]:
    """The messages (and `tools=` argument) to hand the chat template. `native`: the
    template renders tools itself; otherwise tools, calls and results become text."""
    if not isinstance(messages, list):
        return messages, None  # the tokenizer reports the problem
    shown = list(tools.tools) if tools is not None and tools.choice != "none" else None
    if native:
        return [_native(m) for m in messages], shown
    out = [_as_text(m, i) for i, m in enumerate(messages)]
    if shown:
        block = TOOLS_SYSTEM_PROMPT.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in shown))
        if out and isinstance(out[0], dict) and out[0].get("role") == "system":
            out[0] = {**out[0], "content": f"{_text(out[0].get('content'))}\n\n{block}"}
        else:
            out.insert(0, {"role": "system", "content": block})
    return out, None


def _native(m: Any) -> Any:
    """Templates index arguments as a mapping (Qwen2's `tool_call.arguments | tojson`)."""
    if not isinstance(m, dict) or not isinstance(m.get("tool_calls"), list):
        return m
    calls = []
    for c in m["tool_calls"]:
        fn = c.get("function") if isinstance(c, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
            c = {**c, "function": {**fn, "arguments": _arguments(fn["arguments"])}}
        calls.append(c)
    return {**m, "tool_calls": calls}


def _as_text(m: Any, i: int) -> Any:
    if not isinstance(m, dict):
        return m
    role = m.get("role")
    if role == "tool":
        return {"role": "user", "content": f"<tool_response>\n{_text(m.get('content'))}\n</tool_response>"}
    if role == "assistant" and m.get("tool_calls"):
        calls = m["tool_calls"]
        if not isinstance(calls, list):
            raise BadRequestError(f"messages[{i}].tool_calls must be a list", "messages")
        blocks = [_call_block(c, i) for c in calls]
        content = _text(m.get("content"))
        return {"role": "assistant", "content": "\n".join(([content] if content else []) + blocks)}
    return {k: v for k, v in m.items() if k not in ("tool_calls", "tool_call_id")}


def _call_block(call: Any, i: int) -> str:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise BadRequestError(f"messages[{i}].tool_calls entries need function.name", "messages")
    args = fn.get("arguments", "{}")
    args = _arguments(args) if isinstance(args, str) else args
    return "<tool_call>\n" + json.dumps({"name": fn["name"], "arguments": args}, ensure_ascii=False) + "\n</tool_call>"


def _arguments(text: str) -> Any:
    try:
        return json.loads(text) if text.strip() else {}
    except ValueError:
        raise BadRequestError("tool_calls arguments must be a JSON object encoded as a string",
                              "messages") from None


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, list):  # text parts, as the tokenizer accepts them
        return "\n".join(p.get("text", "") for p in content if isinstance(p, dict))
    return str(content)
