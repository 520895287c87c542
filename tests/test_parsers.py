from dflash2.server.parsers import ReasoningParser, ToolCallParser


def test_reasoning_split_whole_and_streamed():
    text = "<think>first I add</think>The answer is 4."
    assert ReasoningParser.split(text) == ("first I add", "The answer is 4.")
    p, r, c = ReasoningParser(), "", ""
    for i in range(0, len(text), 3):  # deltas cut inside the tags
        a, b = p.feed(text[i : i + 3])
        r += a
        c += b
    a, b = p.flush()
    r += a
    c += b
    assert (r, c) == ("first I add", "The answer is 4.")


def test_hermes_tool_calls_whole_and_streamed():
    text = 'Let me check.<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    content, calls = ToolCallParser.parse("hermes", text)
    assert content == "Let me check." and calls[0]["function"]["name"] == "get_weather"
    assert calls[0]["function"]["arguments"] == '{"city": "Paris"}'
    p, content, calls = ToolCallParser("hermes"), "", []
    for i in range(0, len(text), 4):
        c, cl = p.feed(text[i : i + 4])
        content += c
        calls += cl
    c, cl = p.flush()
    content += c
    calls += cl
    assert content == "Let me check." and len(calls) == 1


def test_kimi_k2_tool_calls():
    text = (
        "ok<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
        '{"city": "Beijing"}<|tool_call_end|><|tool_call_begin|>functions.add:1<|tool_call_argument_begin|>'
        '{"a": 1}<|tool_call_end|><|tool_calls_section_end|>'
    )
    content, calls = ToolCallParser.parse("kimi_k2", text)
    assert content == "ok" and [c["function"]["name"] for c in calls] == ["get_weather", "add"]
    assert calls[0]["function"]["arguments"] == '{"city": "Beijing"}'
