"""The engine's serving kernels: faster ways to compute what `models/pocket/` defines, for the
batched engine only. The model there stays the faithful one (the single-request path runs it, and
it equals the reference); everything here is tested against it.

- `row_contexts.py`: each AR row's context kept dense for the decode attention, and that attention;
  `row_attention.py`/`.cpp`: its C++ torch operators.
- `cpu_decoder.py`: the engine's Mimi decoder on a CPU, as GEMMs; `decoder_ops.py`/`.cpp`: its
  C++ torch operators; `traces.py`: its parts replayed as TorchScript traces.
- `int8.py`, `bf16.py`: the reduced-precision linear layers `precision.py` serves with.
- `native.py`: how every C++ operator is built and loaded (`vector_math.h`: the math they share).
"""
