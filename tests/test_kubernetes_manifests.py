"""docs/kubernetes/: valid YAML, and commands that Pagoda's own parsers accept.

The two engine nodes must agree on the parallel sizes, node count and master
address, and the ports each pod opens must be the ones the engine uses
(torch.distributed at --master-port, the channel at the ports after it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from pagoda.engine_core.args import engine_config_from_args
from pagoda.engine_core.cli import build_parser

MANIFESTS = Path(__file__).resolve().parent.parent / "docs" / "kubernetes"


def documents() -> dict[str, list[dict[str, Any]]]:
    return {
        path.name: [d for d in yaml.safe_load_all(path.read_text()) if d]
        for path in sorted(MANIFESTS.glob("*.yaml"))
    }


def containers(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        c
        for d in docs
        if d["kind"] in ("StatefulSet", "Deployment")
        for c in d["spec"]["template"]["spec"]["containers"]
    ]


def test_every_manifest_is_valid_yaml_with_kinds_and_names() -> None:
    found = documents()
    assert set(found) == {"engine-node0.yaml", "engine-node1.yaml", "api-servers.yaml"}
    for docs in found.values():
        for d in docs:
            assert d["apiVersion"] and d["kind"] and d["metadata"]["name"]


def test_engine_nodes_agree_and_open_the_ports_the_engine_uses() -> None:
    found = documents()
    configs = {}
    for name in ("engine-node0.yaml", "engine-node1.yaml"):
        (container,) = containers(found[name])
        command = container["command"]
        assert command[0] == "engine-core"
        ns = build_parser().parse_args(command[1:])
        configs[name] = (ns, engine_config_from_args(ns), container)
    ns0, node0, container0 = configs["engine-node0.yaml"]
    ns1, node1, _ = configs["engine-node1.yaml"]
    assert not ns0.headless and ns1.headless
    assert (node0.node_rank, node1.node_rank) == (0, 1)
    for field in ("tensor_parallel_size", "nnodes", "master_addr", "master_port"):
        assert getattr(node0, field) == getattr(node1, field), field
    port, world = node0.master_port, node0.world_size
    needed = {port, *range(port + 2, port + 3 + world)}  # torch.distributed, the channel
    opened = {p["containerPort"] for p in container0["ports"]}
    assert needed <= opened, needed - opened
    service = next(d for d in found["engine-node0.yaml"] if d["kind"] == "Service")
    assert needed <= {p["port"] for p in service["spec"]["ports"]}
    # The API servers reach node 0's engine address.
    (api,) = containers(found["api-servers.yaml"])
    engine = next(a for a in api["command"] if a.startswith("--engine="))
    host = node0.master_addr
    assert engine == f"--engine=tcp://{host}:{ns0.address.rsplit(':', 1)[1]}"
