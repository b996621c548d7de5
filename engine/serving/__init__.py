"""The serving side of the engine: callers in, outputs out.

The public ``Engine`` (``engine``) validates and tokenises at the boundary (``validation``,
``prompts``) and queues requests on the loop thread (``loop``), which runs the scheduler and
the model runner and hands each caller its events through the sink of a ``RequestHandle``
(``engine.api``, where outputs, stats and errors live too); text comes from ``detokenizer``;
``chat`` keeps conversations; ``stats`` snapshots the loop's counters; ``cli`` is the command
line.
"""
