"""The serving side of the engine: callers in, outputs out.

The public ``Engine`` (``engine``) validates and tokenises at the boundary (``validation``,
``prompts``) and queues requests on the loop thread (``loop``), which runs the scheduler and
the model runner and hands each caller its events through a ``RequestHandle`` (``handle``);
text comes from ``detokenizer``; ``chat`` keeps conversations; ``stats``, ``outputs`` and
``errors`` are what callers get back; ``cli`` is the command line.
"""
