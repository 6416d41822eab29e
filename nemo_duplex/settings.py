"""The settings schema of every entry point: typed dataclasses registered with Hydra's ConfigStore.

The dataclasses are the one source of truth for keys, types and defaults. The YAML files in conf/ only
select and override: `conf/<app>.yaml` picks its app's schema, a model preset (`conf/model/`) and
Hydra's run directory and help; nothing else repeats a default. A key that is not in the schema is an
error at composition ("Key 'x' is not in struct"), and so is a value of the wrong type.

Each app's schema holds only the keys that app reads, so a setting one app would ignore is refused
there instead of being dropped (the load test does not take `serve.*`: it sets the server's limits itself;
`scripts/make_checkpoint.py` takes no `device`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import OmegaConf

from nemo_duplex.models.config import ModelConfig, SamplingParams


def default_device() -> str:
    """`device`'s default: the GPU when this machine has one, else the CPU."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def deployment_dtype(device: str) -> str:
    """`model/dtype=auto`'s compute dtype for the encoder, LLM and talker on `device`: bf16 on a GPU (the
    deployment, model/dtype=bf16), fp32 on the CPU (the reference numerics, model/dtype=fp32)."""
    return "fp32" if str(device) == "cpu" else "bf16"


# Registered on import, not in register(): a config composed in one process may be resolved in another
# (a Ray Serve replica), and every process that imports the settings can resolve these.
OmegaConf.register_new_resolver("default_device", default_device, replace=True)
OmegaConf.register_new_resolver("deployment_dtype", deployment_dtype, replace=True)

# Every 8 calls from 16 to 64, every 16 to 160, every 32 to 256: a batch pads to the next bucket, and with
# powers of two a batch of 65 ran as 128 (49 ms instead of ~34 on the H200); buckets above engine.max_calls
# are not captured (graphs/capture.py buckets_for). docs/performance.md "Load" has both sets measured.
# From 2, not 1: the compiled step's one dynamic build serves every bucket but 1 (Dynamo specialises a size
# of 1), which would be a build of its own at every start (~50 s of a restart on an H100); a call alone
# runs padded to 2 (H100, position 600: 12.93 ms against 12.56 captured by hand at 1).
CAPTURE_BUCKETS = (2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 144, 160, 192, 224, 256)


@dataclass
class EngineConfig:
    # Call places. null: on a GPU as many calls of max_call_s as its memory holds, at most the largest capture
    # bucket (serving/memory.py calls_for_device); 8 on the CPU. The server prints the number it took.
    max_calls: Optional[int] = None
    max_call_s: float = 160.0          # a call past this many seconds of input ends with reason "limit"
    max_pending_s: float = 30.0        # input received but not yet stepped, per call
    max_prompt_tokens: int = 512
    # The LLM's and the talker's KV live in pages of kv_page_len positions (a power of two, >= 16; 64 are
    # 5.1 s), taken as a call grows and returned when it ends (serving/pages.py). kv_pool_gib: GiB of pages
    # in all; null = enough for every call at max_call_s (no call is ever refused for pages). Set, a call is
    # admitted only if the pages its limit (its own max_call_s, else this one) could need fit beside what
    # the live calls could still need: refused at open_call, never cut mid-call. The memory plan counts it.
    kv_page_len: int = 64
    kv_pool_gib: Optional[float] = None
    # admissions cached by (prompt, speaker), in MiB (state.PrefixCache; 0 turns the cache off): at full size
    # an entry is 146-154 MiB (the fp32 SSM state, plus its prompt's KV: no prompt to 512 tokens), so
    # 1280 MiB hold 8 prompts of 512 tokens
    prefix_cache_mib: int = 1280
    # A new call's admission (its prompt's prefill, then the talker warm-up: ~0.2-0.3 s of host time at
    # 500 tokens on the H200) runs on a thread of its own (serving/admitter.py; on CUDA on a stream of the
    # lowest priority) beside the live calls' steps. H200, 128 lockstep calls while calls with fresh
    # 500-token prompts arrive twice a second: live lag p99 74-82 ms against 57-59 without arrivals; on the
    # engine thread, 8.3 s (docs/performance.md). false: on the engine thread between steps, in pieces,
    # at most admission_pieces_per_tick between two steps while calls are live (an engine driven tick by
    # tick, serving/drive.py, always does).
    admission_thread: bool = True
    # With the admission thread: a call still not admitted this long after its admission was submitted
    # (waiting behind others included: a live caller's audio meets max_pending_s by then) ends with an
    # error naming this setting, rather than waiting on a thread that never finishes it (its slot stays the
    # thread's until the thread is done with it); /health reports an admission under way that long.
    max_admission_s: float = 30.0
    # With the admission thread, > 0: each piece of an admission (a prompt chunk, the warm-up) starts only in a
    # gap between the live calls' steps where the previous piece's time fits before the next step is due
    # (Engine.step_gap), waiting at most this long for one, then it runs anyway. 0 (default): pieces back to back,
    # beside the steps. Off because it did not pay: H100, 128 lockstep calls while calls with fresh 500-token
    # prompts arrive twice a second, 80 ms: live lag p99 142 ms against 139 with 0, the arrivals' first packet
    # p50 3.4 s against 0.34 (more than half the pieces found no gap: the arrivals' catch-up steps fill them).
    admission_gap_wait_ms: float = 0.0
    # A step (or, without the admission thread, an admission piece) still under way this long (no bucket's
    # step takes a second on the H200) marks the engine stalled: /health answers 503 "engine_stalled" so that
    # an orchestrator restarts the server; a kernel that never finishes cannot be cut from Python.
    max_step_s: float = 10.0
    # A prompt is prefilled in pieces of this many tokens, the rest in falling powers of two (0: whole;
    # frame_step.prompt_pieces), eager or captured alike.
    prefill_chunk_tokens: int = 256
    admission_pieces_per_tick: int = 2
    # The admission's prefill pieces and talker warm-up replayed from CUDA graphs, one per piece size
    # (serving/admission_graphs.py; prefill_chunk_tokens must then be a power of two): "auto" = where the
    # steps are captured (engine.graphs), true, false (eager, op by op). Either way the talker's warm-up is
    # computed once per speaker and copied into each new call's slot.
    prefill_graphs: Any = "auto"
    capture_buckets: list[int] = field(default_factory=lambda: list(CAPTURE_BUCKETS))
    graphs: Any = "auto"               # "auto" | true | false: "auto" = captured on CUDA, eager on the CPU (graphs/capture.py)
    # any of graphs/capture.py's BACKENDS (its docstring says when). "cudagraph": torch.compile (Inductor)
    # builds the step once for every bucket, each bucket's CUDA graph recorded by hand; at the hand capture's
    # step and host time (H100, N = 1 / 32 / 128), and through the server as real time at 128 calls. Its
    # first start compiles (~3.5 min on an H100), a restart loads the compile cache (61 s to ready);
    # "cudagraph-eager", the hand capture of the step as written, is the fallback: no compiler, ready in
    # under a minute (docs/performance.md, "Compiled back ends").
    graph_backend: str = "cudagraph"
    # Where the compiled back ends keep torch.compile's work between runs (graphs/compile_cache.py):
    # "auto" = outputs/compile_cache in this checkout when the back end compiles; a directory; null = off.
    compile_cache_dir: Optional[str] = "auto"
    # The compiled back ends build the step with a dynamic batch dimension: one build serves every bucket
    # except 1 (and any that a branch on the batch size sets apart), not one build per bucket and variant;
    # each bucket still records its own CUDA graph. For start-up time (graphs/capture.py): with `cudagraph`
    # and the buckets from 2, a server of 128 places restarted from its compile cache in 61 s on an H100.
    # "auto": on wherever the step is compiled; true names a setting a back end that compiles nothing warns of.
    compile_dynamic_batch: Any = "auto"    # "auto" | true | false
    # Also capture each bucket for batches of greedy calls only (no sort over the vocabulary; greedy is the
    # default sampling): H200, position 1000, N=32 / 128: -1.0 / -2.8 ms per step, for twice the captures.
    greedy_graphs: bool = True
    # Run the step's off-critical-path work (the RNN-T, the text's bookkeeping) on a second CUDA stream,
    # a parallel branch of each captured graph (frame_step.branch); false = one stream, the plain order.
    side_stream: bool = True
    # Pipelined steps (frame_step): 1, a step's talker + codec run for the frame each call heard in its
    # previous step, on a third CUDA stream beside this step's encoder + LLM; 2, also its LLM for that
    # frame, and the encoder for the new frame on a fourth stream, the talker + codec two frames back. No
    # chain of small dependent kernels fills the GPU alone, so beside each other they take less than one
    # after the other (H200, N=32, position 1000: 16.98 / 14.79 / 14.04 ms a step for 0 / 1 / 2;
    # docs/performance.md). Outputs are the serial step's bit for bit; each frame's event
    # comes `pipeline` steps later (80 ms more audio latency each), and a call that ends its input takes
    # that many more steps for its last frames. false / true = 0 / 1.
    pipeline: int = 0
    # SMs the text half's cuBLASLt GEMMs (the LLM's, the heads') leave free for the other halves' kernels
    # (frame_step.sm_carveout), where the speech half's chain beside the LLM is the step's critical path.
    # "auto": half the SMs two deep with the hand capture or eager steps, else 0 (graphs/capture.py
    # check_sm_carveout). H200, two deep, N = 1 / 32 / 64 / 128: 7.10 / 13.99 / 22.04 / 37.24 ms without,
    # 6.82 / 13.46 / 21.17 / 36.37 with 64 (docs/performance.md). 0: off.
    llm_sm_carveout: Any = "auto"      # "auto" | an SM count
    # Every step runs one row count: only the capture bucket that covers max_calls (or the largest
    # configured), eager steps padded to it too. Then a call's output never depends on which calls share
    # its step, bit for bit, also in bf16 on the GPU, where with several buckets cuBLASLt's split-K and
    # cuDNN pick other kernels for other row counts (graphs/capture.py). Cost: a step of few calls runs
    # the whole bucket's rows (docs/performance.md has it measured).
    batch_invariant: bool = False
    idle_wait_s: float = 0.005
    # torch's CUDA GEMM library for the whole process, "cublaslt" | "cublas"; the app selects it before the model
    # loads (runtime.select_blas): cuBLASLt's picks were faster for the step's GEMMs on the H200
    blas_library: str = "cublaslt"
    # Hold a step up to this long after its oldest frame arrived for live calls whose next frame is due
    # by then (coalesce_wait), so calls whose frames arrive together (lockstep clients) are stepped
    # together instead of split over two steps. 0 = step whatever is pending at once.
    coalesce_ms: float = 15.0
    # ... but never longer than the last step took (coalesce_limit); false = the fixed bound
    coalesce_at_most_step: bool = True
    # Wait (within the bound) for calls opened together with a call whose first frame is pending and that
    # have sent no frame yet (opened_together); false = a call without a frame is never waited for.
    wait_opened_together: bool = True
    # Hold a step (within the same bound) while calls are still opening: until no call has opened for
    # this long. Callers that start together reach the event loop one after another, each opening its
    # call and sending its first frame at once; the engine cannot wait for a call it has not heard of
    # (calls opened earlier and together are waited for by their open times: opened_together). 0 = off.
    open_quiet_ms: float = 3.0
    # Under load, keep the engine's duty cycle at most this: after a step that took T, the next one starts
    # no sooner than T / max_duty after the last one started, unless every live call has a frame pending
    # (nothing more is coming), and no paced frame is held past duty_hold_cap_ms. Why: a step reads every
    # weight once whatever its batch, so with staggered callers stepping whatever has arrived settles at
    # back-to-back steps of a third of the calls each (128 staggered calls: 26-29 ms steps of
    # 39-50 rows, the GPU never idle) and any stall makes packets late; fewer, larger steps leave slack.
    # 0 = off (step whatever is pending, after coalescing).
    max_duty: float = 0.0
    duty_hold_cap_ms: float = 40.0


@dataclass
class ServeConfig:
    """The `serve:` block (scripts/serve.py). The call places, the longest call and the input budget are the
    engine's (`engine.max_calls`, `engine.max_call_s`, `engine.max_pending_s`): one setting each."""
    host: str = "127.0.0.1"             # loopback only; another bind without api_keys logs a warning
    port: int = 8000
    api_keys: list[str] = field(default_factory=list)   # none: no key asked (server/access.py)
    api_keys_file: Optional[str] = None  # one key a line ('#' comments), added to api_keys
    allowed_origins: list[str] = field(default_factory=list)   # browser origins besides the server's own ("*": any)
    max_client_secrets: int = 1024      # live Realtime client secrets (POST /v1/realtime/client_secrets); 0: none
    cors_origins: list[str] = field(default_factory=list)      # CORS for POST /generate from these origins (off)
    gil_switch_interval_ms: float = 0.1  # scripts/serve.py: how soon the engine thread gets the GIL back
    max_upload_mb: float = 16.0         # POST /generate body size
    max_upload_s: float = 160.0         # POST /generate clip duration
    max_message_kb: int = 1024          # largest WebSocket message accepted
    max_outbound_frames: int = 64       # frames waiting for a slow client before its call ends (5.1 s)
    slow_consumer_grace_s: float = 2.0  # then the socket is cut even if the error could not be delivered
    max_connections: Optional[int] = None   # open call connections (WebSockets, uploads); None: engine.max_calls + 16
    idle_timeout_s: float = 30.0        # a session that sends nothing this long (before end of input) ends
    resume_grace_s: float = 10.0        # a WebSocket call whose connection is lost (no close frame) waits this long for
                                        # its client to reconnect with its resume token; 0 = a lost connection hangs up
    resume_buffer_kb: int = 512         # the newest messages a call sent, kept for a reconnect (~8 s of 24 kHz Realtime)
    deadline_ms: float = 80.0           # a frame later than this after its input arrived is a deadline miss
    warmup_frames: int = 2              # silent frames through a throwaway call before /health says ready
    max_tools: int = 5                  # tools per session (vLLM-Omni's limit, spec 3.9)
    max_tool_call_tokens: int = 512     # function-channel tokens between <SPECIAL_20> and <SPECIAL_21> (spec 8.5)
    max_tool_output_tokens: int = 1024  # tokens of one injected <TOOL_RESPONSE> (spec 8.5)
    tool_on_hold_min_frames: int = 17   # frames between a tool call and its result's injection (spec 8.5)
    tool_timeout_s: float = 15.0        # a tool call with no output this long gets an error result (the model says so)
    shutdown_grace_s: float = 10.0      # SIGTERM: calls get this long to end before they are cut (server_shutdown)
    speech_hangover_ms: float = 800.0   # Realtime speech_stopped: this long after the user transcript's last token
    static_dir: str | None = None       # serve the page from here instead of the package's static/
    replicas: int = 1                   # >1: that many engines on Ray Serve, one GPU each (server/replicas.py)
    # Build the engine (the compiled step into engine.compile_cache_dir), then exit without serving: an image
    # or a first deployment prepared ahead, so that each server and replica starts from the compile cache
    prepare_only: bool = False
    ray_address: Optional[str] = None   # the Ray cluster of the replicas: "local" (start one here), "auto" (join the
                                        # running one), "ray://host:port"; null: local if replicas > 1, else no Ray


@dataclass
class MemoryConfig:
    """The start-up check that the model (and a server's call pools) fit the device (nemo_duplex/serving/memory.py)."""
    check: bool = True
    device_gib: Optional[float] = None  # the budget; null = what the device has free (CUDA: free memory;
                                        # CPU: MemAvailable)
    reserve_gib: Optional[float] = None  # beyond the weights and pools; null = 6 on CUDA (activations, graph
                                         # pools of every bucket, the CUDA context; 5.2 GiB measured), 1 on the CPU


@dataclass
class WandbConfig:
    mode: str = "offline"           # offline (no account; `wandb sync` later) | online | disabled
    project: str = "nemo-duplex"


@dataclass
class ModelApp:
    """What every app that loads the model takes."""
    model: ModelConfig = field(default_factory=ModelConfig)
    # A directory in the official layout, a Hugging Face repo id (revision= picks a branch, tag or commit),
    # or `embedded` (the seeded tiny checkpoint under outputs/checkpoints/). Default: the preset's.
    checkpoint: str = "${model.default_checkpoint}"
    revision: Optional[str] = None
    tokenizer: Optional[str] = None   # the LLM's tokenizer.json (a file, a directory or a repo id); null =
                                      # beside the checkpoint, else its `pretrained_llm` (Nemotron-Nano-9B-v2)
    device: str = "${default_device:}"   # cpu | cuda | cuda:N; by default the GPU when there is one
    memory: MemoryConfig = field(default_factory=MemoryConfig)


@dataclass
class ServeApp(ModelApp):
    """scripts/serve.py."""
    seed: int = 0                     # a call's seed when its session sets none
    sampling: SamplingParams = field(default_factory=SamplingParams)   # a call's text sampling when it sets none
    engine: EngineConfig = field(default_factory=EngineConfig)
    serve: ServeConfig = field(default_factory=ServeConfig)


@dataclass
class RunClipApp(ModelApp):
    """scripts/run_clip.py."""
    mode: str = "offline"             # offline (spec 7.1) | streaming (spec 7.2) | engine (batched, several clips)
    clip: Optional[str] = None        # a WAV (any rate; resampled); null = eval/clips/example.wav
    clips: Optional[list[str]] = None  # mode=engine: the clips run at once
    offsets: Optional[list[int]] = None  # mode=engine: the start frame of each clip
    prompt: Optional[str] = None      # system prompt
    seed: int = 0
    sampling: SamplingParams = field(default_factory=SamplingParams)
    dump: Optional[str] = None        # write the named tensors (tokens, codes, PCM) to this .safetensors file
    out: Optional[str] = None         # output directory; null = the run directory
    engine: EngineConfig = field(default_factory=EngineConfig)


@dataclass
class MakeCheckpointApp:
    """scripts/make_checkpoint.py."""
    model: ModelConfig = field(default_factory=ModelConfig)
    seed: int = 0
    out: Optional[str] = None         # null = outputs/checkpoints/<model.name>-seed<seed>


@dataclass
class BenchConfig:
    """scripts/bench_step.py: one frame step timed per batch size and position."""
    batch_sizes: list[int] = field(default_factory=lambda: [1, 8, 32, 64, 128])
    positions: list[int] = field(default_factory=lambda: [100, 2000])
    iters: int = 20
    warmup: int = 3
    compare_eager: bool = True
    cpu_bandwidth: float = 1.0e10     # bytes/s assumed for the floor on the CPU (no copy measurement there)
    paged: bool = True                # the KV pools in pages of engine.kv_page_len, as the engine has them


@dataclass
class BenchStepApp(ModelApp):
    engine: EngineConfig = field(default_factory=EngineConfig)
    bench: BenchConfig = field(default_factory=BenchConfig)
    seed: int = 0


@dataclass
class LoadTestConfig:
    """scripts/bench.py: N paced callers through the real server (docs/performance.md "Load")."""
    url: Optional[str] = None         # a running server; null = start scripts/serve.py with this run's model/engine
    n_calls: list[int] = field(default_factory=lambda: [1, 8, 16, 32, 64, 96, 128, 160])
    starts: list[str] = field(default_factory=lambda: ["lockstep", "staggered"])
    stagger_s: float = 2.0            # staggered: the N starts are spread over this
    lead_s: float = 1.0               # connect, then the schedule starts this much later
    duration_s: float = 20.0          # input per call (the clip looped); every call sends the same bytes
    # [lo, hi] seconds: caller i's input is instead drawn uniform in [lo, hi] (a numpy Generator seeded by
    # loadtest.seed: caller i has the same length at every N), rounded up to whole 80 ms frames, and the caller
    # declares it, plus one frame, as its max_call_s (the engine holds memory for that long only). null: every
    # caller sends duration_s and declares nothing
    length_mix: Optional[list[float]] = None
    clip: Optional[str] = None        # null = eval/clips/example.wav
    seed: int = 0
    callers_per_process: int = 32     # above this the callers are sharded over processes (scripts/bench.py says why)
    jitter_buffer_ms: float = 160.0   # the client's playback buffer: a packet later than its slot is an underrun
    uploads: bool = False             # also POST an upload_s WAV to /generate every upload_every_s
    upload_runs: list[int] = field(default_factory=list)   # after the sweep: N staggered calls again with uploads
    upload_s: float = 20.0
    upload_every_s: float = 2.0
    extra_calls: int = 16             # server places beyond the largest N when uploads (or arrivals) are on
    arrival_runs: list[int] = field(default_factory=list)  # after the sweep: N lockstep calls again, new calls arriving
    arrival_every_s: float = 0.5      # a new call this often, each with a fresh system prompt of
    arrival_prompt_tokens: int = 500  # this many tokens (BOS and EOS included) and
    arrival_s: float = 2.0            # this much audio, sent at once
    max_call_s: float = 30.0          # the server's engine.max_call_s: its pools are sized by it (memory.py)
    startup_timeout_s: float = 900.0  # model build + graph capture
    run_timeout_s: float = 60.0       # a run's calls are cut this long after their input should have ended
    metrics_every_s: float = 0.5      # /metrics and GPU memory sampling
    stop_when_late: bool = True       # skip larger N of a start mode once an N was not real time
    time_budget_s: float = 540.0      # skip runs that would end past this (results so far are always written)
    server_args: list[str] = field(default_factory=list)   # more overrides for scripts/serve.py
    out: Optional[str] = None         # results directory (default $OUT, else the run directory)
    plots: bool = True


@dataclass
class LoadTestApp(ModelApp):
    """scripts/bench.py. The model, engine, device, seed and sampling settings are passed on to the server it
    starts; the server's limits come from `loadtest` (its max_call_s, the largest N)."""
    seed: int = 0
    sampling: SamplingParams = field(default_factory=SamplingParams)
    engine: EngineConfig = field(default_factory=EngineConfig)
    loadtest: LoadTestConfig = field(default_factory=LoadTestConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)


@dataclass
class ProfileConfig:
    graphs: bool = False      # profile the captured step (engine.graph_backend) instead of the eager stages
    greedy: bool = False      # ... with the greedy-only graphs
    top: int = 45             # ops / kernels listed
    first: int = 40           # kernels of one replay listed in order
    host: int = 0             # with graphs: this many calls' host path under cProfile (the busiest functions)


@dataclass
class ProfileApp(BenchStepApp):
    """scripts/dev/profile_step.py: where one frame step's GPU time goes."""
    profile: ProfileConfig = field(default_factory=ProfileConfig)


SCHEMAS = {"serve_schema": ServeApp, "run_clip_schema": RunClipApp, "make_checkpoint_schema": MakeCheckpointApp,
           "bench_step_schema": BenchStepApp, "loadtest_schema": LoadTestApp, "profile_schema": ProfileApp}


def register(extra: dict[str, type] | None = None) -> None:
    """Store the schemas in Hydra's ConfigStore (what conf/<app>.yaml's defaults name). Idempotent."""
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    for name, node in {**SCHEMAS, **(extra or {})}.items():
        cs.store(name=name, node=node)
