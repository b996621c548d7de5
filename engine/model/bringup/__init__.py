"""Bringing the model side up for an engine, above the runner: what is decided and verified once,
before anything is served.

- ``platforms``: the platform for a device and attention backend (the one place that knows both
  ``engine.model.cpu`` and ``engine.model.cuda``), the device and the ``auto`` backend resolved;
- ``load``: ``load_model``, the device and dtype resolved (``auto`` included) before the core's
  loader reads the weights;
- ``build``: the KV pool sized for this machine and the runner, from an ``EngineConfig``;
- ``dtype_probe`` / ``dtype_probe_child``: the CPU's dtype chosen by measurement, its forward
  verified invariant, once per machine;
- ``invariance``: the batch-invariance check on the real forward (the probe's);
- ``device_check``: the check a CUDA engine (and FlashInfer's reference) runs on its own runner
  at start.
"""
