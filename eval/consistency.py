"""Gate row `consistency`: offline, streaming and the engine say the same thing.

    python eval/consistency.py [checkpoint=<dir>] [eval.models.batch_calls=32] [eval.models.graphs=auto]

The model as configured runs every clip

- offline (NVIDIA's `offline_inference`, spec 7.1: the reference, full LLM replay per frame),
- streaming (`stream_inference`, spec 7.2: one call, cached state, one frame per step),
- through one engine: a live call (1280-sample appends) and an upload per clip, all at once, then a batch of
  `batch_calls` calls that open at different ticks, cycling over the clips, uploads mixed with live
  calls of several append sizes. The engine is shared by all of it, so slots are reused: state left
  over from an earlier call would show. With a GPU the engine runs again with captured graphs
  (`graphs: auto`).

Per pair it records the token agreement per frame (text and function channels), the first frame where
they differ and the reference's top-1/top-2 margin there (on the channel that differs). Offline and
streaming compare on text and function tokens (their talker loops differ by design, spec 7.1 vs 7.2:
offline frame 0 has all-zero codes); the engine calls compare with streaming on the tokens, the codes
and the PCM (up to the first code that differs). A divergence whose margin is at least
`near_tie_margin` fails the row; near-tie divergences are counted against `max_near_tie_divergences`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from eval.models import TopTwo, clip_audio, first_difference, make_engine, margin
from eval.report import AudioSample
from eval.row import FAIL, PASS, Criteria, GateContext, RowResult
from nemo_duplex.serving.drive import CallPlan, drive


@dataclass
class Reference:
    """A path's per-frame decisions and the margins behind them, the yardstick of a comparison."""
    text: torch.Tensor        # [K] int64
    func: torch.Tensor        # [K] int64
    text_top2: torch.Tensor   # [K, 2]
    func_top2: torch.Tensor | None  # [K, 2], None without a function head
    codes: torch.Tensor | None = None   # [K, Q]
    pcm: torch.Tensor | None = None     # [K * 1764]


@dataclass
class Comparison:
    clip: str
    pair: str                       # e.g. "offline/streaming", "streaming/engine live"
    frames: int
    text_agreement: float           # fraction of frames with the same text token
    func_agreement: float
    first_token_diff: int | None    # first frame where text or function differs
    channel: str | None             # the channel that differs there (text wins a tie)
    margin: float | None            # the reference's top-1 minus top-2 logit there, on that channel
    first_code_diff: int | None = None
    pcm_max_abs_err: float | None = None  # over the frames before the first code difference

    def describe(self) -> str:
        return (f"{self.clip} {self.pair}: {self.channel} differs first at frame {self.first_token_diff} "
                f"(reference margin {self.margin:.3f})")


def _with_function_margins(model, run):
    """Run `run()` while hooking the function head; returns (result, [calls, 2] top-2 or None)."""
    if not model.has_function_head:
        return run(), None
    hook = TopTwo(model.stt_model.function_head)
    try:
        result = run()
    finally:
        hook.remove()
    return result, hook.stacked()


def references(model, audio: torch.Tensor, seed: int) -> tuple[Reference, Reference]:
    """(offline, streaming) on the K whole frames of `audio` (offline's lookahead frame dropped)."""
    from nemo_duplex.models.model import offline_inference
    from nemo_duplex.serving.frame_step import stream_inference

    K = audio.shape[0] // model.cfg.samples_per_frame_in
    off, off_func = _with_function_margins(model, lambda: offline_inference(model, audio, seed=seed))
    st, st_func = _with_function_margins(model, lambda: stream_inference(model, audio, seed=seed))
    offline = Reference(off.text_tokens[:K].cpu(), off.function_tokens[:K].cpu(), off.text_logits_top2[:K].cpu(),
                        None if off_func is None else off_func[:K])
    streaming = Reference(st.text_tokens.cpu(), st.function_tokens.cpu(), st.text_logits_top2.cpu(), st_func,
                          st.codes.cpu(), st.wav.float().cpu())
    return offline, streaming


def compare(clip: str, pair: str, ref: Reference, text: torch.Tensor, func: torch.Tensor,
            codes: torch.Tensor | None = None, pcm: torch.Tensor | None = None) -> Comparison:
    K = ref.text.shape[0]
    if text.shape[0] != K:
        raise ValueError(f"{clip} {pair}: {text.shape[0]} frames against the reference's {K}")
    t, f = first_difference(ref.text, text), first_difference(ref.func, func)
    first, channel, m = None, None, None
    if t is not None or f is not None:
        first = min(x for x in (t, f) if x is not None)
        channel = "text" if t == first else "function"
        top2 = ref.text_top2 if channel == "text" else ref.func_top2
        m = margin(top2, first) if top2 is not None else float("nan")
    cmp = Comparison(clip, pair, K, float((ref.text == text).float().mean()), float((ref.func == func).float().mean()),
                     first, channel, m)
    if codes is not None and ref.codes is not None:
        cmp.first_code_diff = first_difference(ref.codes, codes)
        same = K if cmp.first_code_diff is None else cmp.first_code_diff
        n = same * (pcm.shape[0] // K)
        cmp.pcm_max_abs_err = float((pcm[:n] - ref.pcm[:n]).abs().max()) if n else 0.0
    return cmp


def _graph_settings(setting) -> list[bool]:
    """eval.models.graphs: auto (off, and on as well where a GPU is present), true, false."""
    if setting in (False, "false", "off"):
        return [False]
    if setting in (True, "true", "on"):
        return [False, True]
    if setting != "auto":
        raise ValueError(f"eval.models.graphs must be auto, true or false, not {setting!r}")
    return [False, True] if torch.cuda.is_available() else [False]


def batch_plans(audios: list[torch.Tensor], calls: int, chunk_sizes: list[int], seed: int) -> list[CallPlan]:
    """`calls` calls cycling over the clips, opening at staggered ticks (0, 3, 6, ... wrapping at 31),
    every third an upload and the others live with the append sizes in turn."""
    plans = []
    for i in range(calls):
        upload = i % 3 == 1
        plans.append(CallPlan(audios[i % len(audios)], start=(3 * i) % 31, upload=upload,
                              chunk=chunk_sizes[i % len(chunk_sizes)], seed=seed))
    return plans


def consistency(ctx: GateContext, criteria: Criteria) -> RowResult:
    ms = ctx.models()
    model = ms.configured
    s = ctx.settings
    seed = int(s.get("seed", 0))
    chunk_sizes = [int(c) for c in s.get("chunk_sizes", (1280,))]
    batch = int(s.get("batch_calls", 8))
    clips = ctx.model_clips()
    audios = [clip_audio(c, model.cfg, s.get("max_seconds")) for c in clips]
    seconds = max(a.shape[0] for a in audios) / model.cfg.source_sample_rate
    comparisons: list[Comparison] = []
    refs: list[Reference] = []
    for clip, audio in ctx.progress(list(zip(clips, audios)), "consistency: offline/streaming"):
        offline, streaming = references(model, audio, seed)
        refs.append(streaming)
        comparisons.append(compare(clip.name, "offline/streaming", offline, streaming.text, streaming.func))
    sample = AudioSample(f"agent_streaming_{clips[0].name}", refs[0].pcm.numpy(), model.cfg.target_sample_rate,
                         caption=f"agent text: {ms.tokenizer.decode(refs[0].text.tolist())[:200]!r}")

    graph_runs = _graph_settings(s.get("graphs", "auto"))
    for graphs in graph_runs:
        tag = "graphs" if graphs else "eager"
        slots = max(batch, 2)
        engine = make_engine(model, ms.tokenizer, slots, seconds, graphs=graphs,
                             graph_backend=s.get("graph_backend"))
        # every clip's live call and upload side by side (as many at once as the engine holds): a tick steps
        # them all for little more than one call costs on the CPU, and the batch below then reuses their slots
        pairs = [CallPlan(audio, upload=upload, seed=seed) for audio in audios for upload in (False, True)]
        records = iter(drive(engine, pairs, at_once=slots))
        for clip, ref in zip(clips, refs):
            for name, rec in (("live", next(records)), ("upload", next(records))):
                comparisons.append(compare(clip.name, f"streaming/engine {name} ({tag})", ref, rec.text_tokens,
                                           rec.function_tokens, rec.codes, rec.wav))
        plans = batch_plans(audios, batch, chunk_sizes, seed)
        for i, rec in enumerate(drive(engine, plans)):
            p, c = plans[i], i % len(clips)
            how = "upload" if p.upload else f"live {p.chunk}"
            comparisons.append(compare(clips[c].name, f"streaming/engine batch call {i} ({how}, start {p.start}, {tag})",
                                       refs[c], rec.text_tokens, rec.function_tokens, rec.codes, rec.wav))
    result = judge(comparisons, criteria, graph_runs)
    result.audio.append(sample)
    return result


def judge(comparisons: list[Comparison], criteria: Criteria, graph_runs: list[bool]) -> RowResult:
    bar = float(criteria["near_tie_margin"])
    diverged = [c for c in comparisons if c.first_token_diff is not None]
    non_ties = [c for c in diverged if not (c.margin < bar)]   # a NaN margin (unknown) is no near-tie
    ties = [c for c in diverged if c.margin < bar]
    code_first = [c for c in comparisons if c.first_code_diff is not None
                  and (c.first_token_diff is None or c.first_code_diff < c.first_token_diff)]
    pcm_errs = [c.pcm_max_abs_err for c in comparisons if c.pcm_max_abs_err is not None]
    pcm_err = max(pcm_errs, default=0.0)
    failures = []
    if non_ties:
        failures.append(f"{len(non_ties)} paths part at a frame that is no near-tie (margin >= {bar}): "
                        + "; ".join(c.describe() for c in non_ties[:3]) + (" ..." if len(non_ties) > 3 else ""))
    if len(ties) > criteria["max_near_tie_divergences"]:
        failures.append(f"{len(ties)} near-tie divergences > {criteria['max_near_tie_divergences']} allowed: "
                        + "; ".join(c.describe() for c in ties[:3]) + (" ..." if len(ties) > 3 else ""))
    if len(code_first) > criteria["max_code_divergences"]:
        failures.append(f"{len(code_first)} engine calls whose codes differ from streaming before any token does: "
                        + "; ".join(f"{c.clip} {c.pair}: frame {c.first_code_diff}" for c in code_first[:3]))
    if pcm_err > criteria["pcm_max_abs_err"]:
        failures.append(f"engine PCM differs from streaming by {pcm_err:.3g} on equal codes "
                        f"(> {criteria['pcm_max_abs_err']})")
    kinds = {}
    for c in comparisons:
        kind = c.pair.split(" (")[0].split(" call ")[0]
        kinds.setdefault(kind, []).append(min(c.text_agreement, c.func_agreement))
    metrics = {"comparisons": len(comparisons), "diverged": len(diverged), "near_ties": len(ties),
               "non_ties": len(non_ties), "code_divergences": len(code_first), "pcm_max_abs_err": pcm_err}
    metrics.update({"min_agreement_" + k.replace("/", "_vs_").replace(" ", "_"): min(v) for k, v in kinds.items()})
    details = {"graphs_runs": graph_runs,
               "graphs_note": "" if True in graph_runs else "graphs on: not run (no GPU, or eval.models.graphs=false)",
               "comparisons": [vars(c) for c in comparisons]}
    reason = "; ".join(failures) or (f"{len(comparisons) - len(diverged)} of {len(comparisons)} path pairs agree "
                                     "on every frame" + (f", {len(ties)} part at near-ties" if ties else "")
                                     + ("" if True in graph_runs else " (graphs on: not run, no GPU)"))
    return RowResult(FAIL if failures else PASS, reason, metrics, details)
