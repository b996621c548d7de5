"""``/v1/responses``: OpenAI's Responses API, chat with the conversation kept on the server.

``endpoints`` runs its requests (a turn, reading, listing the input items, deleting);
``shapes`` holds its request record, its input items as chat messages and its output items;
``store`` keeps stored responses per tenant (SQLite). It shares the generation steps
(``server.generation``), the request fields (``server.protocol``) and the streams
(``server.streaming``) with the chat and completions endpoints (``server.openai``).
"""
