"""Helpers the test suites share (no tests here). Test modules import these, never each other.

- `support.attention`: the padded-gather reference attention and the checks against it (the
  model's paged attention, the engine's dense row contexts).
- `support.engine`: the engine suites' single-request reference, request runners and checks.
- `support.faults`: fault injection under concurrent streams (CPU and CUDA fault suites).
- `support.oracle`: intone's single path against the pocket-tts package.
- `support.runner`: a model runner with scratch requests, for the tests that call its steps.
- `support.server`: an in-process `intone serve` on a free port, and WebSocket helpers.
"""
