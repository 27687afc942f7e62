"""Tool schemas and action parsing: every malformed action becomes a structured error, never an exception."""

from __future__ import annotations

import json

import pytest

from agentenv.rl.policy import tool_call
from agentenv.rl.tools import TOOLS, ToolCall, ToolOutput, parse_action, tool_schemas

pytestmark = pytest.mark.no_runtime


def test_schemas_are_openai_functions_and_json():
    schemas = tool_schemas()
    assert json.loads(json.dumps(schemas)) == schemas
    names = [s["function"]["name"] for s in schemas]
    assert names == ["run_shell", "run_python", "read_file", "write_file", "edit_file", "list_files", "submit"]
    for s in schemas:
        assert s["type"] == "function"
        params = s["function"]["parameters"]
        assert params["type"] == "object" and params["additionalProperties"] is False
        assert set(params["required"]) <= set(params["properties"])


def test_schemas_subset_and_unknown_name():
    assert [s["function"]["name"] for s in tool_schemas(["submit"])] == ["submit"]
    with pytest.raises(ValueError, match="names: unknown tools"):
        tool_schemas(["rm_rf"])


def test_parse_accepts_openai_and_short_forms():
    call = parse_action(tool_call("run_shell", call_id="c1", command="ls"))
    assert isinstance(call, ToolCall) and call.arguments == {"command": "ls"} and call.call_id == "c1"
    short = parse_action({"name": "read_file", "arguments": {"path": "a.txt", "limit": 3}})
    assert isinstance(short, ToolCall) and short.arguments["limit"] == 3
    empty = parse_action({"name": "submit", "arguments": ""})
    assert isinstance(empty, ToolCall) and empty.arguments == {}


@pytest.mark.parametrize("action, kind, needle", [
    pytest.param("ls", "invalid_action", "tool call object", id="not-a-dict"),
    pytest.param({"function": {"arguments": "{}"}}, "invalid_action", "function.name", id="no-name"),
    pytest.param({"name": "rm_rf", "arguments": {}}, "unknown_tool", "unknown tool 'rm_rf'", id="unknown-tool"),
    pytest.param({"name": "run_shell", "arguments": "{not json"}, "invalid_arguments", "not valid JSON",
                 id="bad-json"),
    pytest.param({"name": "run_shell", "arguments": {}}, "invalid_arguments", "missing required", id="missing"),
    pytest.param({"name": "run_shell", "arguments": {"command": 3}}, "invalid_arguments", "must be string",
                 id="wrong-type"),
    pytest.param({"name": "run_shell", "arguments": {"command": "ls", "sudo": True}}, "invalid_arguments",
                 "unknown argument", id="extra-arg"),
    pytest.param({"name": "read_file", "arguments": {"path": "a", "offset": 0}}, "invalid_arguments", ">= 1",
                 id="below-minimum"),
    pytest.param({"name": "read_file", "arguments": {"path": "a", "limit": True}}, "invalid_arguments",
                 "must be integer", id="bool-as-int"),
    pytest.param({"name": "submit", "arguments": "[1, 2]"}, "invalid_arguments", "JSON object", id="array-args"),
])
def test_malformed_actions_become_error_outputs(action, kind, needle):
    out = parse_action(action)
    assert isinstance(out, ToolOutput)
    assert out.error["type"] == kind
    assert needle in out.error["message"] and out.content.startswith("error:")


def test_every_tool_has_a_runner():
    assert all(callable(t.run) for t in TOOLS.values())
