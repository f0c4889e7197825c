"""Generated code for the encore.v1 protos (see protos/generate.sh)."""
