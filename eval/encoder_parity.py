"""Gate row `encoder_parity`: the streaming encoder equals the offline one, frame by frame.

    python eval/encoder_parity.py [checkpoint=<dir>] [eval.models.chunk_sizes=[320,1280,4000]]

Each clip goes through the engine as a live call, once per append size ("chunk size": how a client's
audio arrives; the engine regroups it into 1280-sample frames, so the encoder output must not depend
on it), with the encoder frames of every step recorded; all of a model's calls run side by side in
one engine. They are compared with the offline encoder over the whole clip (spec 2.8: streaming
frame k = offline frame k; the design's streaming geometry makes that hold from frame 0, spec 12.2):

- fp32 streaming vs fp32 offline: minimum per-frame cosine and maximum per-frame relative error;
- bf16 streaming vs the fp32 offline yardstick: the same, and besides the absolute bounds its error
  must stay within `bf16_factor` times the error bf16 makes anyway, offline (bf16 offline vs fp32
  offline), on every clip and chunk size: streaming may not add error of its own.
"""
from __future__ import annotations

from eval.models import clip_audio, frame_errors, make_engine, offline_encoder
from eval.row import FAIL, PASS, Criteria, GateContext, RowResult
from nemo_duplex.serving.drive import CallPlan, drive


def _summary(errors: dict) -> dict:
    cos, rel = errors["cosine"], errors["rel"]
    return {"min_cosine": float(cos.min()), "worst_cosine_frame": int(cos.argmin()),
            "max_rel_err": float(rel.max()), "worst_rel_frame": int(rel.argmax()), "clip_rel_err": errors["clip_rel"]}


def encoder_parity(ctx: GateContext, criteria: Criteria) -> RowResult:
    ms = ctx.models()
    settings = ctx.settings
    chunk_sizes = [int(c) for c in settings.get("chunk_sizes", (1280,))]
    max_seconds = settings.get("max_seconds")
    failures: list[str] = []
    per_clip: dict[str, dict] = {}
    worst = {"fp32_min_cosine": 1.0, "fp32_max_rel_err": 0.0, "bf16_min_cosine": 1.0, "bf16_max_rel_err": 0.0,
             "bf16_max_factor": 0.0}
    clips = ctx.model_clips()
    audios = [clip_audio(clip, ms.fp32.cfg, max_seconds) for clip in clips]
    yardsticks, bf16_offlines = [], []
    for clip, audio in zip(clips, audios):
        frames = audio.shape[0] // ms.fp32.cfg.samples_per_frame_in
        yardstick = offline_encoder(ms.fp32, audio)[:frames]       # K+1 offline frames; streaming has K
        bf16_offline = frame_errors(offline_encoder(ms.bf16, audio)[:frames], yardstick)
        yardsticks.append(yardstick)
        bf16_offlines.append(bf16_offline)
        per_clip[clip.name] = {"frames": frames, "bf16_offline": _summary(bf16_offline)}
    # Every clip at every append size as calls of one engine per model: a tick steps the whole batch,
    # which costs little more than stepping one call on the CPU, and the engine's slots must keep their
    # calls' encoder state apart besides. At most as many at once as the consistency row's batch (the
    # engine size this model is run at anyway), so many long clips do not size the engine past that.
    calls = [(c, chunk) for c in range(len(clips)) for chunk in chunk_sizes]
    at_once = min(len(calls), max(int(settings.get("batch_calls", 8)), len(chunk_sizes)))
    seconds = max(a.shape[0] for a in audios) / ms.fp32.cfg.source_sample_rate
    for name, model in ctx.progress((("fp32", ms.fp32), ("bf16", ms.bf16)), "encoder_parity"):
        engine = make_engine(model, ms.tokenizer, at_once, seconds)
        records = drive(engine, [CallPlan(audios[c], chunk=chunk) for c, chunk in calls], record_encoder=True,
                        at_once=at_once)
        for (c, chunk), rec in zip(calls, records):
            clip, yardstick, bf16_offline = clips[c], yardsticks[c], bf16_offlines[c]
            entry, frames = per_clip[clip.name], yardstick.shape[0]
            if rec.encoder_out.shape[0] != frames:
                failures.append(f"{clip.name} {name} chunk {chunk}: {rec.encoder_out.shape[0]} streaming frames, "
                                f"expected {frames}")
                continue
            s = _summary(frame_errors(rec.encoder_out, yardstick))
            key = f"{name}_chunk{chunk}"
            entry[key] = s
            where = f"{clip.name} {name} streaming, {chunk}-sample appends"
            worst[f"{name}_min_cosine"] = min(worst[f"{name}_min_cosine"], s["min_cosine"])
            worst[f"{name}_max_rel_err"] = max(worst[f"{name}_max_rel_err"], s["max_rel_err"])
            if s["min_cosine"] < criteria[f"{name}_min_cosine"]:
                failures.append(f"{where}: cosine {s['min_cosine']:.6f} at frame {s['worst_cosine_frame']} "
                                f"< {criteria[f'{name}_min_cosine']}")
            if s["max_rel_err"] > criteria[f"{name}_max_rel_err"]:
                failures.append(f"{where}: relative error {s['max_rel_err']:.3g} at frame {s['worst_rel_frame']} "
                                f"> {criteria[f'{name}_max_rel_err']}")
            if name == "bf16":
                # streaming may not add error to what bf16 costs anyway (per clip and per worst frame)
                factor = max(s["clip_rel_err"] / max(bf16_offline["clip_rel"], 1e-30),
                             s["max_rel_err"] / max(float(bf16_offline["rel"].max()), 1e-30))
                entry[key]["factor_over_offline"] = factor
                worst["bf16_max_factor"] = max(worst["bf16_max_factor"], factor)
                if factor > criteria["bf16_factor"]:
                    failures.append(f"{where}: error {factor:.2f}x that of bf16 offline "
                                    f"(> {criteria['bf16_factor']}x)")
    reason = ("; ".join(failures[:6]) + (f"; ... {len(failures) - 6} more" if len(failures) > 6 else "")
              if failures else
              f"streaming = offline on {len(clips)} clips x appends of {chunk_sizes} samples: fp32 cosine >= "
              f"{worst['fp32_min_cosine']:.7f}, bf16 within {worst['bf16_max_factor']:.2f}x of bf16 offline")
    return RowResult(FAIL if failures else PASS, reason, worst, {"clips": per_clip, "chunk_sizes": chunk_sizes})
