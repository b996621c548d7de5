"""OpenAI's chat completions and completions endpoints, and vLLM's beside them: one module per
endpoint (``chat``, ``completions``, ``models``, ``tokenization``), their request records and
the checks only they make (``records``), and the bodies they answer with (``bodies``: the
envelope, usage, log-probabilities).
"""
