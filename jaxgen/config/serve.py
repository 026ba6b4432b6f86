"""What serve.py reads (configs/serve.yaml): the engine and its limits, the HTTP server, several processes."""

from __future__ import annotations

import dataclasses
from typing import Literal

from jaxgen.config.base import check, check_literals
from jaxgen.config.devices import DistributedConfig, MeshConfig

MAX_CHUNK_STEPS = 1024
MAX_PAGE_SIZE = 2**16
MAX_KV_GB = 1e6  # a petabyte: beyond any device; the page count from it must stay a finite integer
MAX_PAGES = 2**31 - 1


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# what only the host reads (the HTTP server, the scheduler, the loader); the page count and the draft's config
# reach the programs as arguments of their own
HOST_ONLY = ("kv_memory_gb", "num_pages", "prefix_caching", "precompile", "overlap", "draft", "spec_gate",
             "lora_root", "max_body_bytes", "max_queue", "request_timeout_s", "shutdown_grace_s",
             "admin_token")  # fmt: skip


@dataclasses.dataclass(frozen=True)
class ServeConfig:
    """The serving engine (`jaxgen.inference.engine`): decode slots and the paged KV cache's memory budget."""

    slots: int = 16  # sequences decoded together
    page_size: int = 16  # tokens per KV-cache page
    kv_memory_gb: float = 1.0  # the page pool's size; pages = this / bytes of one page (all layers)
    num_pages: int = 0  # an exact page count instead of kv_memory_gb (tests); 0 = from the budget
    chunk_steps: int = 8  # decode steps per jitted chunk, between scheduling decisions
    # prompt tokens prefilled per step (vLLM's max_num_batched_tokens), in one call: a step admits many short
    # prompts at once, and a longer prompt runs in chunks between decode chunks
    prefill_chunk: int = 16384
    # dispatch each decode chunk before taking the last one's results (one chunk of lag), so that the host's
    # work overlaps the device's
    overlap: bool = True
    max_logprobs: int = 5  # the most top alternatives a request may ask for
    # states of structured output's grammar table held from the start (rounded up to a power of two), so that
    # constraints within them compile nothing after ready; each state costs vocab_size x 4 bytes of device
    # memory. 0: as many as 64 MiB holds, at most 4096. A constraint beyond them grows the table (one compile).
    grammar_states: int = 0
    prefix_caching: bool = True  # share the pages of prompt prefixes already in the cache
    # serve.py http: every program a request can reach compiled before /health is ok (`jaxgen.inference.precompile`)
    precompile: bool = True
    # the KV cache's dtype: int8 holds about twice the tokens of bfloat16 per GB (one float32 scale per token
    # and kv head beside the int8 values)
    cache_dtype: Literal["float32", "bfloat16", "int8"] = "float32"
    # how the weights are held: auto = the checkpoint's dtype on GPU/TPU (bfloat16 for most Hugging Face
    # folders), float32 on CPU (XLA:CPU's bfloat16 products are slow); bfloat16 weights compute in bfloat16;
    # float32 weights of a bfloat16 model (model.dtype) are held in bfloat16 for decoding
    param_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    # int8: every attention and MLP weight held as int8 with a scale per output channel, its products int8 x int8
    # (`jaxgen.model.quant`); quantize_embedding: the embedding and the head too
    quantize: Literal["none", "int8"] = "none"
    quantize_embedding: bool = False
    # a run or Hugging Face folder whose model (a smaller one, with the same tokenizer), or an EAGLE-3 head's
    # folder (jaxgen.training.eagle, jaxgen.hf.eagle3), drafts for requests with num_speculative_tokens > 0;
    # None = n-gram lookup over each request's prompt and output
    draft: str | None = None
    # speculation runs only where it pays: per batch size, a decode chunk speculates while measured tokens/s of
    # speculative chunks reach 0.95 of plain ones (jaxgen.inference.spec_gate); false: whenever a row asks
    spec_gate: bool = True
    # speculative decoding's rule (jaxgen.inference.speculative): exact = every output token for token what plain
    # decoding gives; standard = a draft kept with probability min(1, p/q), exact in distribution (an EAGLE head's
    # sampled drafts are kept more often). With standard every chunk of speculating rows speculates (spec_gate
    # is not applied: a plain chunk cannot take over a pending residual draw)
    spec_rule: Literal["exact", "standard"] = "exact"
    # multi-LoRA serving (docs/serving.md): up to max_loras adapters of rank up to max_lora_rank held on the device
    # at once, each request naming one (or none); 0 = off. lora_modules: "NAME=FOLDER" adapters loaded at start
    max_loras: int = 0
    max_lora_rank: int = 16
    lora_modules: tuple[str, ...] = ()
    # POST /v1/load_lora_adapter reads adapter folders inside this folder alone (symlinks and `..` resolved; a
    # relative lora_path is taken inside it); None = only with the admin token (any folder). Never a pickle
    lora_root: str | None = None
    # several processes (`serve.py generate --input`): split = each serves its share of the lines on its own
    # devices (data parallel); shared = one engine on a mesh over every process's devices (model parallel)
    processes: Literal["split", "shared"] = "split"
    # the engine's mesh (data, tensor) over this process's devices (split) or every process's (shared); -1 = the rest
    data_parallel: int = 1  # slots split over devices
    tensor_parallel: int = 1  # heads, kv heads and the MLP split over devices
    # the HTTP server's limits
    max_body_bytes: int = 4_000_000  # a larger request body gets 413 before it is parsed
    max_queue: int = 1024  # requests waiting beyond this get 429 with Retry-After
    request_timeout_s: float = 0.0  # a request running longer is cancelled (408); 0 = no limit
    shutdown_grace_s: float = 10.0  # on SIGTERM, running sequences get this long before their streams are ended
    # the bearer token of POST /v1/admin/update_weights (new weights into the live engine; None = no such route)
    # and of POST /v1/load_lora_adapter from any folder
    admin_token: str | None = None

    @property
    def for_programs(self) -> ServeConfig:
        """These settings with the host-only ones (`HOST_ONLY`) at their defaults: a jitted program's static
        `serve` argument, so that settings differing only in those share compiled programs (jaxgen.executables)."""
        defaults = ServeConfig()
        return dataclasses.replace(self, **{k: getattr(defaults, k) for k in HOST_ONLY})

    def __post_init__(self):
        check_literals(self, "serve")
        for name in ("slots", "page_size", "chunk_steps", "prefill_chunk", "max_body_bytes", "max_queue"):
            value = getattr(self, name)
            check(_is_int(value) and value > 0, f"serve.{name}", value, "a positive integer")
        # a decode chunk's output buffers have chunk_steps columns, and its loop runs them without a break
        check(self.chunk_steps <= MAX_CHUNK_STEPS, "serve.chunk_steps", self.chunk_steps, f"at most {MAX_CHUNK_STEPS}")
        check(self.page_size <= MAX_PAGE_SIZE, "serve.page_size", self.page_size, f"at most {MAX_PAGE_SIZE} tokens")
        check(
            isinstance(self.kv_memory_gb, int | float) and 0 < self.kv_memory_gb <= MAX_KV_GB, "serve.kv_memory_gb",
            self.kv_memory_gb, f"a number > 0 and at most {MAX_KV_GB:g} (GB)",
        )  # fmt: skip
        check(
            _is_int(self.num_pages) and (self.num_pages == 0 or 2 <= self.num_pages <= MAX_PAGES), "serve.num_pages",
            self.num_pages, f"0 (from serve.kv_memory_gb) or from 2 to {MAX_PAGES} (page ids are int32)",
        )  # fmt: skip
        check(_is_int(self.max_logprobs) and self.max_logprobs >= 0, "serve.max_logprobs", self.max_logprobs,
              "an integer >= 0")  # fmt: skip
        check(_is_int(self.grammar_states) and 0 <= self.grammar_states <= 2**20, "serve.grammar_states",
              self.grammar_states, "an integer from 0 (automatic) to 1048576")  # fmt: skip
        check(
            self.quantize == "int8" or not self.quantize_embedding, "serve.quantize_embedding", self.quantize_embedding,
            f"true only with serve.quantize=int8 (it is {self.quantize}): the embedding is quantized with the rest",
        )  # fmt: skip
        for name in ("request_timeout_s", "shutdown_grace_s"):
            value = getattr(self, name)
            check(isinstance(value, int | float) and 0 <= value < float("inf"), f"serve.{name}", value, "a number >= 0")
        for name in (
            "overlap",
            "prefix_caching",
            "precompile",
            "quantize_embedding",
            "spec_gate",
        ):  # a string is truthy
            check(isinstance(getattr(self, name), bool), f"serve.{name}", getattr(self, name), "true or false")
        check(self.draft is None or (isinstance(self.draft, str) and bool(self.draft)), "serve.draft", self.draft,
               "null or the path of a run or Hugging Face folder")  # fmt: skip
        self._check_loras()
        check(self.admin_token is None or (isinstance(self.admin_token, str) and len(self.admin_token) >= 8),
              "serve.admin_token", "<hidden>", "null or a string of at least 8 characters")  # fmt: skip
        for name in ("data_parallel", "tensor_parallel"):
            value = getattr(self, name)
            check(value == -1 or value > 0, f"serve.{name}", value, "a positive integer, or -1 for the rest")
        check(
            (self.data_parallel, self.tensor_parallel) != (-1, -1), "serve.tensor_parallel", -1,
            "a positive integer when serve.data_parallel is -1 (one of the two may take the rest)",
        )  # fmt: skip
        check(
            self.processes == "split" or self.data_parallel == 1, "serve.data_parallel", self.data_parallel,
            "1 with serve.processes=shared (one engine, tensor parallel over every process's devices); "
            "serve.processes=split is the data parallelism across processes",
        )  # fmt: skip

    def _check_loras(self):
        check(_is_int(self.max_loras) and 0 <= self.max_loras <= 1024, "serve.max_loras", self.max_loras,
              "an integer from 0 (no adapters) to 1024")  # fmt: skip
        check(_is_int(self.max_lora_rank) and 1 <= self.max_lora_rank <= 1024, "serve.max_lora_rank",
              self.max_lora_rank, "an integer from 1 to 1024")  # fmt: skip
        modules = self.lora_modules
        ok = isinstance(modules, tuple) and all(isinstance(m, str) and "=" in m and m.index("=") > 0 for m in modules)
        check(ok, "serve.lora_modules", modules, 'a list of "NAME=FOLDER" (PEFT adapter folders)')
        check(self.lora_root is None or (isinstance(self.lora_root, str) and bool(self.lora_root)), "serve.lora_root",
              self.lora_root, "null or the folder that HTTP clients may load adapter folders from")  # fmt: skip
        check(len(modules) <= self.max_loras, "serve.lora_modules", modules,
              f"at most serve.max_loras={self.max_loras} adapters")  # fmt: skip

    @property
    def mesh(self) -> MeshConfig:
        return MeshConfig(data=self.data_parallel, tensor=self.tensor_parallel)


@dataclasses.dataclass(frozen=True)
class HttpConfig:
    """The HTTP server of `serve.py http`. Its API key is never read from a file: --api-key or JAXGEN_API_KEY."""

    host: str = "127.0.0.1"  # the address to bind; 127.0.0.1 = this machine only
    port: int = 8000
    model_name: str | None = None  # the model id clients send; None = the checkpoint folder's name
    metrics_need_key: bool = False  # /metrics asks for the API key too (by default it is public, as /health is)

    def __post_init__(self):
        check(bool(self.host), "http.host", self.host, "an address such as 127.0.0.1 or 0.0.0.0")
        check(0 <= self.port <= 65535, "http.port", self.port, "an integer in [0, 65535] (0 = any free port)")
        check(self.model_name is None or bool(self.model_name), "http.model_name", self.model_name, "null or a name")
        check(isinstance(self.metrics_need_key, bool), "http.metrics_need_key", self.metrics_need_key, "true or false")


@dataclasses.dataclass(frozen=True)
class ServeCommandConfig:
    """What `serve.py` reads (configs/serve.yaml): the engine and its limits, and the HTTP server."""

    serve: ServeConfig = dataclasses.field(default_factory=ServeConfig)
    http: HttpConfig = dataclasses.field(default_factory=HttpConfig)
    distributed: DistributedConfig = dataclasses.field(default_factory=DistributedConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)
