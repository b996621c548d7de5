"""Speculative decoding from what the engine already holds, as one step extension.

``drafter`` guesses a decoding request's next tokens (the radix tree, its own context, its
namespace's running and cached sequences); ``gate`` decides how many of them each request
verifies this step (a pass's cost against each draft's chance of acceptance); ``extension``
(``SpeculativeDecoding``) turns decode entries into verify entries with them and learns what
verification accepted.
"""
