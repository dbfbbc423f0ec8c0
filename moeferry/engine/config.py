"""EngineConfig: every parameter of the engine, in one frozen object.

`ServeConfig` (the `serve` flags) resolves into it, `WorkerSpec` carries it across the spawn
boundary and `LLM(...)` builds it from keyword arguments. Sizes the engine can only know once
the checkpoint is read (state slots, context limit, KV tokens) come from one function,
`derive_sizes`; the memory plan (`moeferry.memory.plan`) may then change them, and the engine
reports what it resolved in `Engine.sizes`.
"""
from __future__ import annotations

from dataclasses import dataclass

from moeferry.moe import cpu_layers

MOE_BACKENDS = ("resident", "offload", "cpu", "hybrid")  # plus "auto": decided at load (Engine.build)
EXPERT_LOADS = ("auto", "serial", "parallel")


@dataclass(frozen=True)
class EngineConfig:
    model_dir: str
    device: str = "cpu"                 # resolved: cpu, cuda or cuda:N
    dtype: str = "float32"              # resolved: float32, bfloat16 or float16
    # experts
    moe_backend: str = "resident"       # one of MOE_BACKENDS
    moe_cache_size: int | None = None   # device expert slots (offload backends)
    moe_cache_rate: float | None = None  # ... or a fraction of all routed experts
    moe_cache_auto: bool = False        # ... or what the memory plan leaves
    moe_cache_policy: str = "lru"
    moe_prefill_overlap: bool = True    # stream layer l+1's experts while layer l computes
    moe_decode_prefetch: bool = True    # offload decode: fetch layer l+1's predicted misses while layer l computes
    moe_prefetch_width: int | None = None  # experts a row that prefetch guesses (None: the top-k)
    moe_prefetch_budget: int | None = None  # most of them a row it copies (None: a quarter of the top-k)
    moe_cpu_threads: int | None = None  # None: the physical cores
    moe_cpu_layers: str | None = None   # offload / cpu: MoE layers with no device slots, on the CPU (moe.cpu_layers)
    moe_hybrid_max_fetch: int | None = None  # hybrid: most PCIe fetches per layer and step
    expert_load: str = "auto"           # auto, serial or parallel
    # memory budget (the plan's inputs)
    memory_ratio: float | None = None
    gpu_memory_limit: int | None = None  # bytes
    kv_reserve_tokens: int | None = None
    num_tokens: int | None = None       # explicit KV capacity; None = planned (default: one full context)
    num_state_slots: int | None = None  # explicit; None = derived from max_running_requests
    page_size: int = 1
    # scheduling
    max_seq_len: int | None = None      # None = the model's max_position_embeddings
    max_running_requests: int = 8
    max_extend_tokens: int = 8192
    prefix_cache: bool = True
    checkpoint_token_ids: tuple[int, ...] = ()  # decode: save the recurrent state just after these tokens (the
    #                                             tool-call opener: the next turn resumes there), for the prefix cache
    max_wait_steps: int = 256           # a queued request waits about this long for a running one to yield (0: off)
    overlap_schedule: bool = True       # launch the next step before the host reads this step's tokens
    decode_log_interval: int = 40       # a decode status line every this many steps with decode tokens
    # CUDA graphs
    cuda_graphs: bool = True
    cuda_graph_max_bs: int | None = None  # largest decode batch captured (None: max_running_requests); larger run eagerly
    progress: bool = False              # progress bars while loading
    compile_workers: int = 8            # Triton kernels compiled ahead of the probe on this many threads (0: off)

    def __post_init__(self):
        if self.moe_backend not in MOE_BACKENDS + ("auto",):
            raise ValueError(f"moe_backend must be one of {', '.join(MOE_BACKENDS)}, got {self.moe_backend!r}")
        if self.expert_load not in EXPERT_LOADS:
            raise ValueError(f"expert_load must be one of {', '.join(EXPERT_LOADS)}, got {self.expert_load!r}")
        if sum(x is not None and x is not False for x in
               (self.moe_cache_size, self.moe_cache_rate, self.moe_cache_auto or None)) > 1:
            raise ValueError("give at most one of moe_cache_size, moe_cache_rate, moe_cache_auto")
        if self.moe_backend == "resident" and self.sizes_expert_cache:
            raise ValueError("--moe-cache-size/-rate/-auto size the expert cache of the offload backends; "
                             "--moe-backend resident keeps every expert on the device")
        if self.kv_reserve_tokens is not None and self.num_tokens is not None:
            raise ValueError("--kv-reserve-tokens is a floor the memory plan keeps; --num-tokens/--num-pages fix "
                             "the KV size exactly: give one")
        if self.moe_cache_rate is not None and not 0 < self.moe_cache_rate <= 1:
            raise ValueError(f"moe_cache_rate must be in (0, 1], got {self.moe_cache_rate}")
        object.__setattr__(self, "moe_cpu_layers", cpu_layers.check(self.moe_cpu_layers))  # "8" and 8 alike
        if self.moe_cpu_layers and self.moe_backend not in ("offload", "cpu", "auto"):
            raise ValueError("moe_cpu_layers (--moe-cpu-layers) applies to the offload and cpu backends "
                             f"(--moe-backend offload or cpu), not {self.moe_backend}")
        if self.moe_hybrid_max_fetch is not None and self.moe_backend != "hybrid":
            raise ValueError("moe_hybrid_max_fetch (--moe-hybrid-max-fetch) applies to the hybrid backend "
                             "(--moe-backend hybrid)")
        for field, default, backends, refusal in OFFLOAD_SETTINGS:
            value = getattr(self, field)
            if value != default and self.moe_backend not in backends + ("auto",):
                raise ValueError(refusal.format(value=value))
        if self.moe_cpu_threads is not None and self.moe_backend not in ("cpu", "hybrid") and not self.moe_cpu_layers:
            raise ValueError("moe_cpu_threads (--moe-cpu-threads) applies to the cpu and hybrid backends "
                             "and to --moe-cpu-layers")
        for name, flag in (("moe_prefetch_width", "--moe-prefetch-width"),
                           ("moe_prefetch_budget", "--moe-prefetch-budget")):
            if getattr(self, name) is not None and not self.moe_decode_prefetch:
                raise ValueError(f"{flag} sizes the decode prefetch, which --disable-moe-decode-prefetch "
                                 "turns off: give one")
        if self.compile_workers < 0:
            raise ValueError(f"compile_workers must be at least 0, got {self.compile_workers}")
        if self.memory_ratio is not None and not 0 < self.memory_ratio <= 1:
            raise ValueError(f"memory_ratio must be in (0, 1], got {self.memory_ratio}")
        for name in ("moe_cache_size", "num_tokens", "num_state_slots", "page_size", "max_seq_len",
                     "max_running_requests", "max_extend_tokens", "kv_reserve_tokens", "moe_cpu_threads",
                     "moe_hybrid_max_fetch", "cuda_graph_max_bs", "decode_log_interval", "moe_prefetch_width",
                     "moe_prefetch_budget"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        object.__setattr__(self, "checkpoint_token_ids", tuple(self.checkpoint_token_ids))
        if self.checkpoint_token_ids and not self.prefix_cache:
            raise ValueError("checkpoint_token_ids (--enable-special-token-ckpt) saves states for the prefix cache, "
                             "which is off (--no-prefix-cache / --cache-type naive)")
        if self.cuda_graph_max_bs is not None and not self.cuda_graphs:
            raise ValueError("cuda_graph_max_bs (--cuda-graph-max-bs) sizes the decode CUDA graphs, which "
                             "--disable-cuda-graphs turns off: give one")
        if self.moe_cache_policy not in CACHE_POLICIES:
            raise ValueError(f"moe_cache_policy must be one of {', '.join(CACHE_POLICIES)}")

    @property
    def sizes_expert_cache(self) -> bool:
        """Whether a flag sizes the expert cache (--moe-cache-size, -rate or -auto)."""
        return bool(self.moe_cache_size or self.moe_cache_rate or self.moe_cache_auto)

    @property
    def offloads_experts(self) -> bool:
        return self.moe_backend not in ("resident", "auto")

    @property
    def plans_memory(self) -> bool:
        """Whether pool sizes come from the measured memory plan rather than the given sizes."""
        return (self.moe_cache_auto or self.kv_reserve_tokens is not None or self.memory_ratio is not None
                or self.gpu_memory_limit is not None)


CACHE_POLICIES = ("lru", "lfu")

# Settings of the offload backends' experts: (field, default, the backends it acts on, the refusal
# elsewhere). Accepted with auto; an auto that resolves to resident puts them back to their
# defaults (`planning.choose_backend`, logged).
OFFLOAD_SETTINGS = (
    ("moe_decode_prefetch", True, ("offload", "hybrid"),
     "--disable-moe-decode-prefetch applies to the offload and hybrid backends (their decode prefetch)"),
    ("moe_prefetch_width", None, ("offload", "hybrid"),
     "--moe-prefetch-width {value} applies to the offload and hybrid backends (their decode prefetch)"),
    ("moe_prefetch_budget", None, ("offload", "hybrid"),
     "--moe-prefetch-budget {value} applies to the offload and hybrid backends (their decode prefetch)"),
    ("moe_prefill_overlap", True, ("offload", "hybrid", "cpu"),
     "--disable-moe-prefill-overlap applies to the offload, hybrid and cpu backends (their prefill staging)"),
    ("moe_cache_policy", "lru", ("offload", "hybrid"),
     "--moe-cache-policy {value} applies to the offload and hybrid backends (the cpu backend's cache keeps "
     "what its boot fill placed; resident keeps every expert)"),
)


@dataclass(frozen=True)
class EngineSizes:
    """What the engine resolved: reported in `Ready` and used by the scheduler and the frontend."""
    num_pages: int
    page_size: int
    num_state_slots: int
    max_seq_len: int      # context limit: prompt + output
    expert_slots: int     # device expert slots (every expert when resident)

    @property
    def kv_tokens(self) -> int:
        return self.num_pages * self.page_size


def state_slots_for(cfg: EngineConfig) -> int:
    """One recurrent-state slot per running sequence, plus room for the prefix cache's GDN
    checkpoints."""
    if cfg.num_state_slots is not None:
        return cfg.num_state_slots
    n = cfg.max_running_requests
    return 2 * n + 8 if cfg.prefix_cache else n


def context_limit(cfg: EngineConfig, model_max_positions: int) -> int:
    return cfg.max_seq_len or model_max_positions


def derive_sizes(cfg: EngineConfig, model_max_positions: int, kv_tokens: int | None = None,
                 expert_slots: int = 0) -> EngineSizes:
    """The pool sizes for `cfg` (KV tokens: as given, else the explicit flag, else one full
    context); a sequence can never outgrow the KV pool, so the pool bounds the context too."""
    context = context_limit(cfg, model_max_positions)
    tokens = kv_tokens or cfg.num_tokens or context
    pages = -(-tokens // cfg.page_size)
    return EngineSizes(pages, cfg.page_size, state_slots_for(cfg), min(context, pages * cfg.page_size),
                       expert_slots)
