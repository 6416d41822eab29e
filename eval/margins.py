"""Gate row `margins`: where bf16 decides otherwise than fp32, was it a near-tie?

    python eval/margins.py [checkpoint=<dir>] [eval.criteria.margins.near_tie_margin=1.0]

Greedy bf16 text may legitimately differ from fp32 (spec 1.6), but only where fp32 itself hardly
preferred its token. Both models step through each clip frame by frame on the same inputs: after every
frame the bf16 call is given fp32's text, function token and codes as its previous ones (teacher
forcing), so one divergence does not carry into the next frames and every frame is judged on its own.
For each frame where the text or the function token differs, the row records fp32's top-1 minus top-2
logit on that channel; a divergence counts as a near-tie only when that margin is below
`near_tie_margin`. It fails on any divergence that is not a near-tie, or when more than
`max_divergence_rate` of the frames diverge at all (a model that is wrong everywhere by a little).

It reports how the talker's codes move as well (not judged: a code has no logit margin to call a near-tie):
the frames whose codes differ and the share of codes that do, every frame again on the same inputs. With
`++eval.models.bf16_dtype.talker_kv=fp8` the bf16 variant keeps its talker KV in float8 (`llm_weights=fp8` or
`fp8_weight_only`, the LLM's projections; `talker_weights=...`, the talker's; `mamba_ssm_state=bf16`, its SSM
state), and the row, run with and without, says what that costs against fp32 beside the bf16 run's own figures.

It also checks the codec of the bf16 deployment: its PCM must equal what the fp32 codec makes of the
same codes (the codec always runs in fp32, spec 9.9: bf16 collapses its reconstruction).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from eval.models import TopTwo, clip_audio
from eval.row import FAIL, PASS, Criteria, GateContext, RowResult


@dataclass
class Divergence:
    frame: int
    channel: str          # text | function
    fp32_token: int
    bf16_token: int
    fp32_margin: float    # fp32's top-1 minus top-2 logit on that channel at that frame


@dataclass
class TeacherForced:
    frames: int
    divergences: list[Divergence] = field(default_factory=list)
    text_margins: list[float] = field(default_factory=list)   # fp32's, every frame
    codec_max_abs_err: float = 0.0
    code_diverging_frames: int = 0   # frames whose codes differ at all
    codes_differing: int = 0         # codes that differ, of frames x num_quantizers

    @property
    def diverging_frames(self) -> int:
        return len({d.frame for d in self.divergences})


@torch.no_grad()
def teacher_forced(fp32, bf16, audio: torch.Tensor, seed: int = 0) -> TeacherForced:
    """Step fp32 and bf16 through `audio` (whole frames) on the same inputs; see the module doc."""
    from nemo_duplex.models.config import SamplingParams
    from nemo_duplex.serving.frame_step import admit, frame_step, special_ids
    from nemo_duplex.serving.state import allocate_call_state

    dev = fp32.stt_model.embed_tokens.weight.device
    n = fp32.cfg.samples_per_frame_in
    K = audio.shape[0] // n
    chunks = audio[: K * n].to(dev, torch.float32).view(K, n)
    slot = torch.zeros(1, dtype=torch.int64, device=dev)
    no_force = torch.full((1,), -1, dtype=torch.int64, device=dev)
    specials = special_ids(fp32, dev)
    states = []
    for model in (fp32, bf16):
        st = allocate_call_state(model, 1, K, dev, max_prompt_tokens=0)
        admit(model, st, 0, None, seed, SamplingParams())  # greedy: the reference decisions
        states.append(st)
    st32, st16 = states
    reference_codec = fp32.codec.allocate_stream_state(2, dev)
    func_top2 = TopTwo(fp32.stt_model.function_head) if fp32.has_function_head else None
    result = TeacherForced(frames=K)
    try:
        for k in range(K):
            a = frame_step(fp32, st32, slot, chunks[k: k + 1], no_force, specials)
            b = frame_step(bf16, st16, slot, chunks[k: k + 1], no_force, specials)
            m_text = float(a.top2[0, 0] - a.top2[0, 1])
            result.text_margins.append(m_text)
            if int(a.text[0]) != int(b.text[0]):
                result.divergences.append(Divergence(k, "text", int(a.text[0]), int(b.text[0]), m_text))
            if int(a.func[0]) != int(b.func[0]):
                m_func = float(func_top2.last[0, 0] - func_top2.last[0, 1]) if func_top2 else float("nan")
                result.divergences.append(Divergence(k, "function", int(a.func[0]), int(b.func[0]), m_func))
            moved = int((a.codes != b.codes).sum())
            result.codes_differing += moved
            result.code_diverging_frames += moved > 0
            pcm = fp32.codec.decode_step(b.codes, reference_codec, slot)
            result.codec_max_abs_err = max(result.codec_max_abs_err, float((pcm - b.pcm.float()).abs().max()))
            # teacher forcing: the bf16 call carries on from fp32's decisions
            st16.prev_text.copy_(st32.prev_text)
            st16.prev_func.copy_(st32.prev_func)
            st16.prev_codes.copy_(st32.prev_codes)
            st16.seen.copy_(st32.seen)
    finally:
        if func_top2 is not None:
            func_top2.remove()
    return result


def margins(ctx: GateContext, criteria: Criteria) -> RowResult:
    ms = ctx.models()
    bar = float(criteria["near_tie_margin"])
    seed = int(ctx.settings.get("seed", 0))
    per_clip, failures = {}, []
    frames = diverging = ties = code_frames = codes_moved = 0
    codec_err = 0.0
    non_ties: list[str] = []
    for clip in ctx.progress(ctx.model_clips(), "margins"):
        audio = clip_audio(clip, ms.fp32.cfg, ctx.settings.get("max_seconds"))
        r = teacher_forced(ms.fp32, ms.bf16, audio, seed)
        frames += r.frames
        diverging += r.diverging_frames
        codec_err = max(codec_err, r.codec_max_abs_err)
        code_frames += r.code_diverging_frames
        codes_moved += r.codes_differing
        for d in r.divergences:
            if d.fp32_margin < bar:
                ties += 1
            else:
                non_ties.append(f"{clip.name} frame {d.frame} {d.channel}: fp32 {d.fp32_token} vs bf16 "
                                f"{d.bf16_token} at fp32 margin {d.fp32_margin:.3f}")
        per_clip[clip.name] = {
            "frames": r.frames, "diverging_frames": r.diverging_frames,
            "divergences": [vars(d) for d in r.divergences],
            "fp32_text_margin_median": float(torch.tensor(r.text_margins).median()),
            "codec_max_abs_err": r.codec_max_abs_err, "code_diverging_frames": r.code_diverging_frames,
            "codes_differing": r.codes_differing}
    rate = diverging / max(frames, 1)
    metrics = {"frames": frames, "diverging_frames": diverging, "divergence_rate": rate, "near_ties": ties,
               "non_ties": len(non_ties), "codec_max_abs_err": codec_err, "code_diverging_frames": code_frames,
               "codes_differing_rate": codes_moved / max(frames * ms.fp32.cfg.talker.num_quantizers, 1),
               # what the variant keeps in fewer bits than the deployment's default (eval.models.bf16_dtype)
               "talker_kv": ms.bf16.cfg.dtype.talker_kv_pool, "llm_weights": ms.bf16.cfg.dtype.llm_weights or "llm",
               "talker_weights": ms.bf16.cfg.dtype.talker_weights or "talker",
               "mamba_ssm_state": ms.bf16.cfg.dtype.mamba_ssm_state}
    if len(non_ties) > criteria["max_non_tie_divergences"]:
        failures.append(f"{len(non_ties)} bf16 divergences are not near-ties (fp32 margin >= {bar}): "
                        + "; ".join(non_ties[:4]) + (" ..." if len(non_ties) > 4 else ""))
    if rate > criteria["max_divergence_rate"]:
        failures.append(f"bf16 decides otherwise than fp32 on {diverging} of {frames} frames "
                        f"({rate:.1%} > {criteria['max_divergence_rate']:.1%}) with the same inputs")
    if codec_err > criteria["codec_max_abs_err"]:
        failures.append(f"the bf16 deployment's codec output differs from the fp32 codec on the same codes by "
                        f"{codec_err:.3g} (> {criteria['codec_max_abs_err']}): the codec must run in fp32 (spec 9.9)")
    reason = "; ".join(failures) or (f"bf16 = fp32 decisions on {frames - diverging} of {frames} frames"
                                     + (f"; the {ties} divergences are all near-ties (fp32 margin < {bar})"
                                        if ties else ""))
    return RowResult(FAIL if failures else PASS, reason, metrics, {"clips": per_clip})
