"""Command-line flags of the engine core (vLLM's names). Imports no torch."""

from __future__ import annotations

import argparse
import json

from pagoda.engine_core.config import EXECUTOR_BACKENDS, EngineConfig


def parse_lora_module(text: str) -> tuple[str, str]:
    """`name=path`, or vLLM's JSON form `{"name": ..., "path": ...}`."""
    if text.lstrip().startswith("{"):
        try:
            spec = json.loads(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"--lora-modules: invalid JSON {text!r}") from None
        name, path = spec.get("name"), spec.get("path")
    else:
        name, _, path = text.partition("=")
    if not isinstance(name, str) or not isinstance(path, str) or not name or not path:
        raise argparse.ArgumentTypeError(
            f'--lora-modules takes name=path or {{"name": ..., "path": ...}}, got {text!r}'
        )
    return name, path


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine")
    g.add_argument(
        "--model",
        default=None,
        help="GGUF file, HF or CTranslate2 model directory, or a packaged model's name "
        "(Systran/faster-whisper-tiny.en) (default: SmolLM2-135M-Instruct)",
    )
    g.add_argument("--served-model-name", default=None)
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument(
        "--quantization",
        "-q",
        default=None,
        choices=["gguf", "int8"],
        help="gguf: also keep a GGUF model's 4-bit weights and run steps of up to 6 tokens "
        "on them (CPU, bfloat16); int8: dynamic W8A8 linears (int8 weights per channel, "
        "activations per token; CPU with AVX512-VNNI), from any checkpoint or a "
        "compressed-tensors int8 one",
    )
    g.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--max-num-seqs", type=int, default=256)
    g.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="tokens a step may schedule, decode rows and prompt chunks together "
        "(default: 512 for a model generating on the CPU, else 2048)",
    )
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument(
        "--kv-cache-memory-bytes",
        type=int,
        default=None,
        help="KV cache budget in bytes (default: min(4 GiB, 25%% of free memory) on CPU)",
    )
    g.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seeds the random draws of requests that give no seed of their own",
    )
    g.add_argument(
        "--runner",
        default="auto",
        choices=["auto", "generate", "pooling"],
        help="pooling: serve a decoder's embeddings (last-token pooling) instead of generating",
    )
    _add_profiler_arg(g)
    g.add_argument(
        "--max-waiting-requests",
        type=int,
        default=None,
        help="refuse new requests (503 + Retry-After) while this many wait to be scheduled",
    )
    g.add_argument(
        "--grammar-compile-timeout",
        type=float,
        default=20.0,
        metavar="SECONDS",
        help="fail (400) a request whose structured-output grammar is not compiled by then",
    )
    g.add_argument(
        "--max-queue-wait",
        type=float,
        default=None,
        metavar="SECONDS",
        help="fail (503) a request still waiting for its first schedule after this long",
    )
    g.add_argument(
        "--paused-request-timeout",
        type=float,
        default=300.0,
        metavar="SECONDS",
        help="while paused (POST /pause), how long a new request waits for resume before a 503",
    )
    g.add_argument(
        "--weight-transfer-config",
        default=None,
        metavar="JSON",
        help='how trainers send weights: {"backend": "gloo" | "nccl" | "file"} '
        "(default: gloo on CPU, nccl on CUDA)",
    )
    g.add_argument(
        "--kv-transfer-config",
        default=None,
        metavar="JSON",
        help='KV connector: {"kv_connector": "OffloadingConnector", "kv_role": "kv_both", '
        '"kv_connector_extra_config": {"cpu_bytes": N}} keeps evicted prefix blocks in host memory',
    )
    g.add_argument(
        "--speculative-config",
        default=None,
        metavar="JSON",
        help='speculative decoding by prompt lookup: {"method": "ngram", '
        '"num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}',
    )
    g.add_argument(
        "--sleep-offload-dir",
        default=None,
        help="where sleep level 1 spills CPU weights (default: the system temp dir)",
    )
    g.add_argument(
        "--enable-lora",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="serve LoRA adapters (requests pick one by model name)",
    )
    g.add_argument("--max-loras", type=int, default=1, help="adapters resident at once")
    g.add_argument("--max-lora-rank", type=int, default=16, help="largest adapter rank accepted")
    g.add_argument(
        "--lora-modules",
        type=parse_lora_module,
        action="append",
        default=None,
        metavar="NAME=PATH",
        help='a PEFT adapter to serve as model NAME (repeatable; also {"name":..,"path":..})',
    )
    g.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=1,
        help="ranks each layer is sharded over",
    )
    g.add_argument(
        "--pipeline-parallel-size",
        "-pp",
        type=int,
        default=1,
        help="stages the layers are split into",
    )
    g.add_argument(
        "--enable-expert-parallel",
        action="store_true",
        help="mixtures of experts: split the experts whole over the tensor-parallel ranks "
        "instead of sharding each expert; with `pagoda serve --data-parallel-size N`, over "
        "the N engine cores, which then step in lockstep",
    )
    g.add_argument(
        "--distributed-executor-backend",
        default=None,
        choices=list(EXECUTOR_BACKENDS),
        help="how the engine reaches its workers (default: uni for one rank, mp for more)",
    )
    g.add_argument("--nnodes", type=int, default=1, help="hosts the ranks are spread over")
    g.add_argument("--node-rank", type=int, default=0, help="this host's index among them")
    g.add_argument(
        "--master-addr",
        default="127.0.0.1",
        help="node 0's address (torch.distributed and the workers' channel)",
    )
    g.add_argument(
        "--master-port",
        type=int,
        default=29500,
        help="torch.distributed's port on node 0; the channel takes the ports after it",
    )
    g.add_argument("--num-threads", type=int, default=None, help="torch threads on CPU")
    g.add_argument(
        "--enforce-eager",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="CUDA: never replay CUDA graphs for decode",
    )


def _add_profiler_arg(g: argparse._ArgumentGroup) -> None:
    g.add_argument(
        "--profiler-dir",
        default=None,
        help="enables /start_profile and /stop_profile; torch.profiler traces land here",
    )


def weight_transfer_backend(text: str | None) -> str | None:
    """The backend of a --weight-transfer-config JSON object (None: the device's default)."""
    if text is None:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--weight-transfer-config is not JSON: {e}") from None
    if not isinstance(value, dict) or not isinstance(value.get("backend"), str):
        raise ValueError('--weight-transfer-config must be an object like {"backend": "gloo"}')
    return str(value["backend"])


def engine_config_from_args(ns: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=ns.model,
        served_model_name=ns.served_model_name,
        dtype=ns.dtype,
        quantization=ns.quantization,
        device=ns.device,
        max_model_len=ns.max_model_len,
        max_num_seqs=ns.max_num_seqs,
        max_num_batched_tokens=ns.max_num_batched_tokens,
        block_size=ns.block_size,
        enable_prefix_caching=ns.enable_prefix_caching,
        kv_cache_memory_bytes=ns.kv_cache_memory_bytes,
        seed=ns.seed,
        num_threads=ns.num_threads,
        profiler_dir=ns.profiler_dir,
        max_waiting_requests=ns.max_waiting_requests,
        max_queue_wait_s=ns.max_queue_wait,
        grammar_compile_timeout_s=ns.grammar_compile_timeout,
        sleep_offload_dir=ns.sleep_offload_dir,
        paused_request_timeout_s=ns.paused_request_timeout,
        kv_transfer_config=ns.kv_transfer_config,
        speculative_config=ns.speculative_config,
        weight_transfer_backend=weight_transfer_backend(ns.weight_transfer_config),
        runner=ns.runner,
        enforce_eager=ns.enforce_eager,
        enable_lora=ns.enable_lora,
        max_loras=ns.max_loras,
        max_lora_rank=ns.max_lora_rank,
        lora_modules=tuple(ns.lora_modules or ()),
        tensor_parallel_size=ns.tensor_parallel_size,
        enable_expert_parallel=ns.enable_expert_parallel,
        pipeline_parallel_size=ns.pipeline_parallel_size,
        distributed_executor_backend=ns.distributed_executor_backend,
        nnodes=ns.nnodes,
        node_rank=ns.node_rank,
        master_addr=ns.master_addr,
        master_port=ns.master_port,
    )


def engine_args_to_argv(ns: argparse.Namespace) -> list[str]:
    """The engine flags of a parsed namespace, back as an argv list."""
    probe = argparse.ArgumentParser(add_help=False)
    add_engine_args(probe)
    argv: list[str] = []
    for action in probe._actions:
        value = getattr(ns, action.dest, None)
        if value is None or value == action.default:
            continue
        flag = action.option_strings[0]
        if isinstance(action, argparse.BooleanOptionalAction):
            argv.append(flag if value else "--no-" + flag[2:])
        elif action.nargs == 0:  # store_true and the like: the flag alone
            argv.append(flag)
        elif action.dest == "lora_modules":
            for name, path in value:
                argv += [flag, f"{name}={path}"]
        else:
            argv += [flag, str(value)]
    return argv
