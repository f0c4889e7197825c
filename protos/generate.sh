#!/usr/bin/env bash
# Regenerates the Python modules for protos/encore/v1/*.proto (run from anywhere):
#   protos/generate.sh
# protoc names imports after the .proto path (`from encore.v1 import ...`); the installed package
# maps protos/ to `encore.protos`, so the sed rewrites them to `from encore.protos.encore.v1 ...`.
set -euo pipefail
cd "$(dirname "$0")"
python -m grpc_tools.protoc -I . --python_out=. --pyi_out=. --grpc_python_out=. encore/v1/*.proto
sed -i -E 's/^from encore\.v1 import/from encore.protos.encore.v1 import/' encore/v1/*_pb2_grpc.py
