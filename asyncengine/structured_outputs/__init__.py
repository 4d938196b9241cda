"""Structured outputs: a request's output constrained to a JSON schema, a regex, a list of
choices or a grammar, enforced token by token with xgrammar masks.

`params` (what a request asks), `grammar` (its conversion and checks), `compiler`
(compiled off the step loop, cached), `waiting` (requests waiting for their grammar),
`engine_side` (what the engine holds), `matcher` (one sequence's grammar state) and `masks`
(applied to a step's logits). Only `params` is imported here: xgrammar loads on first use.
"""

from asyncengine.structured_outputs.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
