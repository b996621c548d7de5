"""The CUDA path: FlashInfer's paged attention over the radix pages and what makes a step fast
and exact on a GPU.

- ``flashinfer_backend`` (the attention backend; its ``flashinfer_plan`` per pass and
  ``flashinfer_reference``, the same calls in torch, which runs them on the CPU in CI);
- ``step_buffers``: a pass's integers in one pinned buffer, one copy to the device;
- ``graphs``: decode steps replayed from CUDA graphs, per batch-size bucket;
- ``cascade_rule``: when attending a shared prefix once pays on the device;
- ``device_check``: the start-up check that the runner's passes are batch-invariant.

The runner (``engine.model.runner``) is the one caller: it packs each pass through
``StepBuffers`` and hands decode passes to ``DecodeGraphs``; ``engine.model.build`` decides
what is on. Everything here but the capture and FlashInfer's kernels runs on the CPU.
"""
