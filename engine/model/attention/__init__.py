"""Attention backends behind one interface (``base``): plan once per pass, run once per layer.

Here the ones that run on any device: ``torch_backend`` (SDPA for prefill, ``paged_decode``,
the LSE-merged ``cascade``). A platform adds its own and says which a name means
(``engine.model.platform``): the CPU's exact kernel in ``engine.model.cpu``, FlashInfer in
``engine.model.cuda``.
"""
