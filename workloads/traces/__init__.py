"""What requests look like, offline and deterministic for a seed: text traces sized with the
real tokenizer (``generators``: chat, rag, agent, few-shot, shared-prefix, unique, sessions,
tenants) and their records and files (``trace``), a session's prompts as token ids
(``prompts``), token-level synthetic traces for the simulators and the tree bench
(``synthetic``), and the ideal hit rate of an infinite cache (``ideal``).
"""
