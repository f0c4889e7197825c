"""Speculative decoding: drafters and the acceptance rules of the verify step."""
