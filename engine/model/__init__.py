"""The model side of the engine: tensors in, tokens out.

The core here runs on any device: loading a checkpoint (``loader``, ``model_config``), the
Llama-family forward over paged KV (``llama``, ``forward_batch``, ``kv_pool``, ``attention``),
sampling (``sampler``), one pass per scheduler batch (``runner``). What differs by device is
asked of a ``platform`` (the interface: ``platform``), which ``cpu`` and ``cuda`` provide; what
is decided and verified once per engine or machine (the platform chosen, the pool sized, the
dtype measured, invariance checked) is the bring-up's (``bringup``), above the runner. It knows
nothing of requests' lifetimes, text or callers.
"""
