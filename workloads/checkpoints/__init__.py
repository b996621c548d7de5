"""Models for where the bundled one cannot go as it is: random weights of its shape for the
GPU machines (``random_model``), and its weights as a plain HF directory for peers such as
``vllm serve`` (``export_hf``).
"""
