"""`engine-core`: load a model and serve it to frontends over ZeroMQ."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import shutil
import signal
import sys

import setproctitle

from pagoda.engine_core.args import add_engine_args, engine_config_from_args
from pagoda.protocol.addresses import default_ipc_address, split_address


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="engine-core", description=__doc__)
    add_engine_args(parser)
    parser.add_argument(
        "--address",
        default=None,
        help="ipc:///path or tcp://host:port (default: ipc in a private runtime dir)",
    )
    parser.add_argument(
        "--curve-keys",
        default=None,
        metavar="DIR",
        help="encrypt a tcp address with CURVE and admit only API servers whose key is in "
        "DIR/clients (make DIR with: pagoda curve-keys DIR); without it tcp binds to loopback",
    )
    parser.add_argument("--log-level", default="info")
    parser.add_argument(
        "--data-parallel-rank",
        type=int,
        default=None,
        help="this engine core's rank among data-parallel ones (shown in its process title; "
        "with --enable-expert-parallel, its rank in the engines' expert-parallel world)",
    )
    parser.add_argument(
        "--data-parallel-size",
        type=int,
        default=1,
        help="how many data-parallel engine cores share the experts "
        "(with --enable-expert-parallel; `pagoda serve` passes it)",
    )
    parser.add_argument(
        "--data-parallel-address",
        default="127.0.0.1",
        help="where the expert-parallel engines' torch.distributed world meets (rank 0's host)",
    )
    parser.add_argument(
        "--data-parallel-rpc-port",
        type=int,
        default=29550,
        help="the port of that meeting point",
    )
    parser.add_argument(
        "--headless",
        action="store_true",
        help="run only this node's workers (--node-rank > 0) for the engine core on node 0",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    # What ps and top show: the role first, then the flags it was started with.
    rank = "" if ns.data_parallel_rank is None else f"-{ns.data_parallel_rank}"
    flags = sys.argv[1:] if argv is None else argv
    setproctitle.setproctitle(" ".join([f"pagoda::engine-core{rank}", *flags]))
    logging.basicConfig(
        level=ns.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    log = logging.getLogger("engine-core")
    address = ns.address or default_ipc_address()
    try:
        split_address(address)
        config = engine_config_from_args(ns)
        if ns.data_parallel_size < 1:
            raise ValueError("--data-parallel-size must be at least 1")
        if ns.data_parallel_size > 1:
            dp_rank = ns.data_parallel_rank
            if dp_rank is None or not 0 <= dp_rank < ns.data_parallel_size:
                raise ValueError(
                    "--data-parallel-size > 1 needs --data-parallel-rank in "
                    f"[0, {ns.data_parallel_size})"
                )
            config = dataclasses.replace(
                config,
                data_parallel_size=ns.data_parallel_size,
                data_parallel_rank=dp_rank,
                data_parallel_address=ns.data_parallel_address,
                data_parallel_rpc_port=ns.data_parallel_rpc_port,
            )
    except ValueError as e:
        parser.error(str(e))

    if ns.headless or config.node_rank > 0:
        if config.node_rank == 0:
            parser.error("--headless is for the nodes other than 0 (--node-rank > 0)")
        setproctitle.setproctitle(" ".join([f"pagoda::workers-node-{config.node_rank}", *flags]))
        from pagoda.engine_core.worker.proc import run_headless

        return run_headless(config)

    from pagoda.engine_core.core.engine import EngineCore
    from pagoda.engine_core.executor import ExecutorError
    from pagoda.engine_core.model_config import ModelLoadError
    from pagoda.engine_core.server import EngineCoreServer

    try:
        engine = EngineCore(config)
    except (ModelLoadError, ValueError, ExecutorError) as e:
        log.error("cannot start: %s", e)
        return 2
    try:
        server = EngineCoreServer(engine, address, ns.curve_keys)
    except Exception as e:  # noqa: BLE001 - zmq bind errors
        log.error("cannot bind %s: %s", address, e)
        return 2

    def on_signal(signum: int, _frame: object) -> None:
        log.info("signal %d: stopping", signum)
        server.stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    print(f"engine-core listening on {server.address}", flush=True)
    try:
        status = server.run()
    finally:
        if ns.address is None:
            # The private runtime directory made above; gone already is fine.
            shutil.rmtree(os.path.dirname(address[len("ipc://") :]), ignore_errors=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
