"""encore.v1: the serving API (generate.proto) and its generated modules."""
