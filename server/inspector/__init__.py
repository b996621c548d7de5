"""The cache inspector: what the KV cache holds, seen from the server.

``endpoints`` serves ``GET /inspect`` (the page in ``static/``) and ``GET /inspect/state``;
``view`` makes the engines' ``InspectSnapshot``s into the state's JSON (labels, tenants' text
hidden); ``traffic`` keeps the last minutes the page plots (``TrafficLog``); ``cli`` is
``radixkv inspect``, the same state as text in a terminal.
"""
