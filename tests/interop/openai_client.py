"""The official `openai` Python client against `agentstack model serve`.

Usage: python openai_client.py BASE_URL   (BASE_URL ends in /v1)
Exits non-zero (with a traceback) on the first failed check.
"""

import json
import sys

import openai

base_url = sys.argv[1]
client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=300)

models = client.models.list()
model = models.data[0].id
print("models:", [m.id for m in models.data])

# Chat, with logprobs.
r = client.chat.completions.create(
    model=model,
    messages=[{"role": "user", "content": "What is the capital of France?"}],
    max_tokens=12,
    temperature=0,
    logprobs=True,
    top_logprobs=3,
)
choice = r.choices[0]
assert choice.message.role == "assistant"
assert isinstance(choice.message.content, str) and choice.message.content, choice
assert choice.finish_reason in ("stop", "length"), choice.finish_reason
lp = choice.logprobs.content
assert len(lp) == r.usage.completion_tokens, (len(lp), r.usage)
for entry in lp:
    assert entry.logprob <= 0.0
    assert len(entry.top_logprobs) == 3
    assert entry.top_logprobs[0].logprob >= entry.top_logprobs[-1].logprob
print("chat:", repr(choice.message.content))

# Greedy is deterministic, and the seed makes sampling repeatable.
again = client.chat.completions.create(
    model=model, messages=[{"role": "user", "content": "What is the capital of France?"}],
    max_tokens=12, temperature=0,
)
assert again.choices[0].message.content == choice.message.content
seeded = [
    client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Tell me a word."}],
        max_tokens=8, temperature=1.0, seed=123,
    ).choices[0].message.content
    for _ in range(2)
]
assert seeded[0] == seeded[1], seeded

# n choices.
r = client.chat.completions.create(
    model=model, messages=[{"role": "user", "content": "Say hi."}], max_tokens=6, n=3, temperature=1.0, seed=1,
)
assert [c.index for c in r.choices] == [0, 1, 2]

# Streaming.
stream = client.chat.completions.create(
    model=model,
    messages=[{"role": "user", "content": "Count to five."}],
    max_tokens=20,
    temperature=0,
    stream=True,
    stream_options={"include_usage": True},
)
text, finish, usage = "", None, None
for chunk in stream:
    if chunk.usage is not None:
        usage = chunk.usage
    for c in chunk.choices:
        text += c.delta.content or ""
        finish = c.finish_reason or finish
assert text, "empty stream"
assert finish in ("stop", "length"), finish
assert usage is not None and usage.completion_tokens > 0
print("stream:", repr(text))

# Tools: a forced call is always well-formed and matches the schema.
tools = [{
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
        },
    },
}]
r = client.chat.completions.create(
    model=model,
    messages=[{"role": "user", "content": "What's the weather in Paris?"}],
    tools=tools,
    tool_choice="required",
    parallel_tool_calls=False,
    max_tokens=60,
    temperature=0,
)
choice = r.choices[0]
assert choice.finish_reason == "tool_calls", choice
assert len(choice.message.tool_calls) == 1, choice.message.tool_calls
call = choice.message.tool_calls[0]
assert call.function.name == "get_weather"
args = json.loads(call.function.arguments)
assert isinstance(args["city"], str) and args["unit"] in ("celsius", "fahrenheit"), args
print("tool call:", call.function.name, args)

# The call and its result go back in; the model answers.
r = client.chat.completions.create(
    model=model,
    messages=[
        {"role": "user", "content": "What's the weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "18 degrees and sunny"},
    ],
    tools=tools,
    max_tokens=20,
    temperature=0,
)
assert r.choices[0].message.content is not None or r.choices[0].message.tool_calls

# Streaming with tools.
stream = client.chat.completions.create(
    model=model,
    messages=[{"role": "user", "content": "Weather in Oslo?"}],
    tools=tools, tool_choice={"type": "function", "function": {"name": "get_weather"}},
    parallel_tool_calls=False, max_tokens=60, temperature=0, stream=True,
)
calls, finish = [], None
for chunk in stream:
    for c in chunk.choices:
        calls += c.delta.tool_calls or []
        finish = c.finish_reason or finish
assert finish == "tool_calls" and calls and calls[0].function.name == "get_weather", (finish, calls)
json.loads(calls[0].function.arguments)

# JSON schema responses.
schema = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 40}, "age": {"type": "integer", "minimum": 0, "maximum": 150}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
r = client.chat.completions.create(
    model=model,
    messages=[{"role": "user", "content": "Invent a person."}],
    response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema}},
    max_tokens=120,
    temperature=0,
)
assert r.choices[0].finish_reason == "stop", r.choices[0]
person = json.loads(r.choices[0].message.content)
assert isinstance(person["name"], str) and isinstance(person["age"], int), person
print("json:", person)

# Completions with logprobs.
r = client.completions.create(model=model, prompt="The sky is", max_tokens=5, temperature=0, logprobs=2)
assert r.choices[0].text
assert len(r.choices[0].logprobs.tokens) == r.usage.completion_tokens

# Bad input is a 400 with a message.
try:
    client.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}], temperature=-1)
except openai.BadRequestError as e:
    assert "temperature" in str(e), e
else:
    raise AssertionError("temperature=-1 was accepted")

print("ok")
