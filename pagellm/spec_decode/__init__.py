"""Speculative decoding: cheap proposals (prompt lookup, a draft model) verified by the
target in one forward, with outputs distributed exactly as without (see `decoder`)."""
