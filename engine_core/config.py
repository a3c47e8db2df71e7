"""EngineConfig: every engine-core setting, frozen, built once by the CLI."""

from __future__ import annotations

from dataclasses import dataclass

from pagoda.engine_core.core.spec_decode import parse_speculative_config


@dataclass(frozen=True)
class EngineConfig:
    """Settings of one engine core, with vLLM's knob names.

    Values the engine discovers at run time (the number of KV blocks, EOS ids,
    the effective max_model_len) are returned by the loader and runner and
    passed on as arguments; they are never written back here.
    """

    model: str | None = None  # GGUF file, HF directory, or None for the default
    served_model_name: str | None = None
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    # "gguf": besides the dense weights, keep a GGUF model's 4-bit linear
    # weights and run steps of up to 6 tokens on them (CPU, bfloat16). "int8":
    # the decoder's linears in dynamic W8A8 (kernels/linear_int8.py). None: dense only.
    quantization: str | None = None
    device: str = "auto"  # auto | cpu | cuda
    max_model_len: int | None = None
    max_num_seqs: int = 256
    # Tokens a step may schedule (decode rows and prompt chunks together).
    # None: default_max_num_batched_tokens() once the model is known.
    max_num_batched_tokens: int | None = None
    block_size: int = 16
    enable_prefix_caching: bool = True
    kv_cache_memory_bytes: int | None = None  # None: a default from free memory
    seed: int = 0
    num_threads: int | None = None  # torch intra-op threads on CPU
    profiler_dir: str | None = None  # where start/stop_profile write traces
    # Load shedding: requests beyond this many waiting are refused (None: no bound).
    max_waiting_requests: int | None = None
    # A request not yet scheduled after this many seconds is failed (None: no limit).
    max_queue_wait_s: float | None = None
    # A structured-output grammar still compiling after this long fails its
    # request (a 400): schemas built to blow up compilation get a bounded answer.
    grammar_compile_timeout_s: float = 20.0
    sleep_offload_dir: str | None = None  # level-1 sleep spills CPU weights here
    # RL training: a request arriving while the engine is paused waits this
    # long for resume, then fails (503).
    paused_request_timeout_s: float = 300.0
    # How a trainer sends new weights (vLLM's --weight-transfer-config):
    # {"backend": "gloo" | "nccl" | "file"}; None: gloo on CPU, nccl on CUDA.
    weight_transfer_backend: str | None = None
    # vLLM's --kv-transfer-config as parsed JSON items: {"kv_connector":
    # "OffloadingConnector", "kv_connector_extra_config": {"cpu_bytes": N}}
    # keeps evicted prefix blocks in a host-memory tier.
    kv_transfer_config: str | None = None
    # vLLM's --speculative-config as JSON: {"method": "ngram",
    # "num_speculative_tokens": k, "prompt_lookup_max": n, "prompt_lookup_min": m}
    # (core/spec_decode.py parses it); None: no speculative decoding.
    speculative_config: str | None = None
    # auto | generate | pooling (vLLM's --runner): "pooling" serves a decoder's
    # embeddings (last-token pooling) instead of generating.
    runner: str = "auto"
    enforce_eager: bool = False  # CUDA: no CUDA graphs for decode steps
    # Multi-LoRA: adapters resident at once (device slots), their largest rank,
    # and (name, path) adapters registered at start-up.
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    lora_modules: tuple[tuple[str, str], ...] = ()
    # Parallelism, vLLM's meaning: the model's layers sharded over
    # tensor_parallel_size ranks and split into pipeline_parallel_size stages.
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    # Mixtures of experts: experts split whole over the tensor-parallel ranks
    # instead of each expert being sharded (vLLM's --enable-expert-parallel).
    enable_expert_parallel: bool = False
    # Expert parallelism across data-parallel engine cores (enable_expert_parallel
    # with data_parallel_size > 1): this engine's rank among them, and where the
    # engines' torch.distributed world meets (vLLM's --data-parallel-address and
    # --data-parallel-rpc-port).
    data_parallel_size: int = 1
    data_parallel_rank: int = 0
    data_parallel_address: str = "127.0.0.1"
    data_parallel_rpc_port: int = 29550
    # uni | mp | ray | external_launcher; None: uni for one rank, mp for more.
    distributed_executor_backend: str | None = None
    # Several hosts (mp): the ranks are spread evenly over nnodes nodes; node 0
    # runs the engine core and its ranks, the others only workers
    # (`engine-core --headless`), reaching node 0 at master_addr: torch.distributed
    # at master_port, the executor's channel at the ports after it.
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500

    @property
    def expert_parallel_engines(self) -> bool:
        """Whether the experts are split over data-parallel engine cores, which
        then step in lockstep (worker/expert_parallel.py)."""
        return self.enable_expert_parallel and self.data_parallel_size > 1

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def result_rank(self) -> int:
        """The rank whose step result is the engine's: the first rank of the
        last pipeline stage (its tensor-parallel ranks all sample the same
        tokens; earlier stages compute no logits)."""
        return (self.pipeline_parallel_size - 1) * self.tensor_parallel_size

    @property
    def local_ranks(self) -> range:
        """The ranks this node runs."""
        per_node = self.world_size // self.nnodes
        return range(self.node_rank * per_node, (self.node_rank + 1) * per_node)

    @property
    def executor_backend(self) -> str:
        """The executor this config runs on, with the default resolved."""
        if self.distributed_executor_backend is not None:
            return self.distributed_executor_backend
        return "uni" if self.world_size == 1 else "mp"

    def __post_init__(self) -> None:
        parse_speculative_config(self.speculative_config)  # a clear error at start
        if self.quantization not in (None, "gguf", "int8"):
            raise ValueError(f"quantization must be gguf, int8 or unset, got {self.quantization!r}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(
                f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}"
            )
        if self.block_size not in (8, 16, 32, 64, 128):
            raise ValueError(f"block_size must be one of 8, 16, 32, 64, 128, got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be at least 1")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be at least 1")
        if self.runner not in ("auto", "generate", "pooling"):
            raise ValueError(f"runner must be auto, generate or pooling, got {self.runner!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError("max_model_len must be at least 1")
        if self.max_waiting_requests is not None and self.max_waiting_requests < 0:
            raise ValueError("max_waiting_requests must be at least 0")
        if self.weight_transfer_backend not in (None, "gloo", "nccl", "file"):
            raise ValueError(
                "the weight transfer backend must be gloo, nccl or file, "
                f"got {self.weight_transfer_backend!r}"
            )
        if self.paused_request_timeout_s <= 0:
            raise ValueError("paused_request_timeout_s must be positive")
        if self.max_queue_wait_s is not None and self.max_queue_wait_s <= 0:
            raise ValueError("max_queue_wait must be positive")
        if self.max_loras < 1:
            raise ValueError("max_loras must be at least 1")
        if self.max_lora_rank < 1:
            raise ValueError("max_lora_rank must be at least 1")
        if self.lora_modules and not self.enable_lora:
            raise ValueError("lora_modules need enable_lora")
        if self.grammar_compile_timeout_s <= 0:
            raise ValueError("grammar_compile_timeout must be positive")
        if self.tensor_parallel_size < 1 or self.pipeline_parallel_size < 1:
            raise ValueError("tensor_parallel_size and pipeline_parallel_size must be at least 1")
        backends = (None, *EXECUTOR_BACKENDS)
        if self.distributed_executor_backend not in backends:
            raise ValueError(
                f"distributed_executor_backend must be one of {', '.join(EXECUTOR_BACKENDS)}, "
                f"got {self.distributed_executor_backend!r}"
            )
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise ValueError("nnodes must be at least 1 and node_rank in [0, nnodes)")
        if self.world_size % self.nnodes:
            raise ValueError(
                f"a world size of {self.world_size} does not spread evenly over {self.nnodes} nodes"
            )
        if self.nnodes > 1 and self.executor_backend != "mp":
            raise ValueError("several nodes need --distributed-executor-backend mp")
        if self.executor_backend == "uni" and self.world_size > 1:
            raise ValueError(
                f"the uni executor runs one rank; a world size of {self.world_size} "
                "needs --distributed-executor-backend mp or ray"
            )


EXECUTOR_BACKENDS = ("uni", "mp", "ray", "external_launcher")


# Per-step token budgets when none is given. A pooling model computes each
# prompt whole in one step, so its budget also caps the prompt length. A
# decoder generating on the CPU gets smaller steps: at 512 tokens the
# linears are still at the arithmetic peak (the weights are read once per
# step, ~10 ms against ~270 ms of arithmetic), and prompts arriving while
# others decode wait for a step a quarter as long. The total arithmetic does
# not depend on the budget, only how prompts are cut among the decodes.
# Measured with the default model, 128-token prompts, alternating servers
# (docs/benchmarks.md): TTFT median at 64 concurrent 2.5 s (2,048) -> 1.35 s
# (1,024) -> 1.0 s (512), at 16 1.25 -> 0.7 -> 0.55 s, output throughput the
# same within the host's noise. 768 gave no TTFT gain over 1,024 (the waves
# of 64 requests split unevenly); 256 lost output to per-step costs.
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
CPU_GENERATE_MAX_NUM_BATCHED_TOKENS = 512


def default_max_num_batched_tokens(pooling_only: bool, device_type: str) -> int:
    if pooling_only or device_type != "cpu":
        return DEFAULT_MAX_NUM_BATCHED_TOKENS
    return CPU_GENERATE_MAX_NUM_BATCHED_TOKENS
