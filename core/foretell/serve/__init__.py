"""``foretell serve``: OpenAI- and Anthropic-compatible HTTP APIs over the batch scheduler.

- :mod:`foretell.serve.app`: the ASGI app (routes, API key, errors as each API shapes them);
- :mod:`foretell.serve.openai_routes`, :mod:`foretell.serve.anthropic_routes`: each API's
  bodies in, replies and streamed events out;
- :mod:`foretell.serve.generation`: what the routes share (prompts, limits, submitting to
  the scheduler, cancelling on disconnect);
- :mod:`foretell.serve.tools`, :mod:`foretell.serve.grammar`: tool calls in the model's own
  format, and structured output enforced through a grammar;
- :mod:`foretell.serve.metrics`, :mod:`foretell.serve.server`: ``/metrics``, and running
  (SIGTERM drains, then the cache flushes).

It sits above the engine, as the CLI does: nothing below imports it. docs/serve.md is the
user's page.
"""
