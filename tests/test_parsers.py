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


def test_incremental_detokenizer_streams_what_decoding_the_whole_output_does():
    """server.app.Detokenizer decodes a window a step (the last piece and what followed it), not the
    whole output: with SmolLM2's byte-level tokenizer, multi-byte characters split across tokens, special
    tokens and stop strings, fed in uneven chunks, each delta equals what decoding the whole output each
    time gives (held back: an incomplete character, the start of a stop string), and the text in the end
    is the whole output's decode cut at the first stop string."""
    import random

    import transformers as tf

    from dflash2.engine.request import Request
    from dflash2.sampling import SamplingParams
    from dflash2.server.app import Detokenizer, stop_prefix_len, trim_stop
    from dflash2.target.loading import default_target_path

    tok = tf.AutoTokenizer.from_pretrained(default_target_path())
    text = "Hé said: naïve café — 東京 🙂👍🏽 and <|im_end|> then “quoted” text, 3.14 . END of it\n\n  spaces  ok"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert any("\ufffd" in tok.decode(ids[:k]) for k in range(1, len(ids)))  # a character split across tokens

    def whole(req, sent: list[str], final: bool) -> str:  # the decode of the whole output each time
        full = trim_stop(tok.decode(req.output_ids, skip_special_tokens=True), req)
        if not final:
            if full.endswith("\ufffd"):
                return ""
            full = full[: len(full) - stop_prefix_len(full, req.stop_strings)]
        if len(full) <= len(sent[0]):
            return ""
        out, sent[0] = full[len(sent[0]) :], full
        return out

    class Counted:  # the tokenizer, recording how many tokens each decode reads
        lengths: list[int] = []

        def decode(self, x, **kw):
            self.lengths.append(len(x))
            return tok.decode(x, **kw)

    rng = random.Random(0)
    for stops in ((), ("END",), ("café — 東",), ("🙂",)):
        for _ in range(5):
            req = Request([1], SamplingParams(), stop_strings=stops)
            detok, sent, got = Detokenizer(Counted()), [""], []
            while len(req.output_ids) < len(ids):
                req.output_ids += ids[len(req.output_ids) : len(req.output_ids) + rng.randint(1, 4)]
                final = len(req.output_ids) == len(ids)
                got.append(detok.delta(req, final))
                assert got[-1] == whole(req, sent, final)
            assert "".join(got) == trim_stop(tok.decode(ids, skip_special_tokens=True), req)
    # a window, not the whole output (chunks of 1-4 tokens; a split character or a skipped special token
    # widens it for a step or two)
    assert max(Counted.lengths) <= 16 < len(ids)
