"""What the Responses API tests send: greedy sampling and a function tool in its flat shape."""

GREEDY = {"temperature": 0.0}
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather now in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}
