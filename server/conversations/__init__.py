"""``/v1/conversations``: OpenAI's Conversations API, on the response store's folder and
tenancy (``store``: the SQLite records; ``endpoints``: the routes)."""
