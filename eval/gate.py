"""The correctness gate: one command says whether a build, a config or a checkpoint is still right.

    python eval/gate.py                                   # rows and criteria of conf/eval/gate.yaml
    python eval/gate.py checkpoint=<dir or repo id> eval.asr.backend=whisper eval.asr.model_path=<m>
    python eval/gate.py eval.only_clips=[question_capital,noise_white] wandb.mode=disabled
    python eval/gate.py device=cuda model=nemotron_duplex checkpoint=<dir> eval.models.max_seconds=null

The rows: wer_pipeline (the ASR itself), encoder_parity (eval/encoder_parity.py), margins
(eval/margins.py), consistency (eval/consistency.py), agent_wer. One row alone:
`python eval/gate.py eval.rows=[margins]`. The model rows run the clips of `eval.models.clips`, cut to
`eval.models.max_seconds`, on the models of eval/models.py (fp32 yardstick, bf16 variant, configured).

Each row runs on the configured clips and is judged against its criteria, which are read once before
the first row, frozen (read-only mappings) and hashed into the report. A row ends pass, fail or n/a;
n/a (the row cannot mean anything for the loaded weights, e.g. agent WER with random weights) always
carries its reason and is never counted as a pass. Writes <out>/gate.md and gate.json, logs a W&B run
(wandb.mode offline by default), and exits 1 when any row failed.

Adding a row: write `def my_row(ctx: GateContext, criteria: Criteria) -> RowResult`, list it in ROWS,
and give it a `criteria.my_row` block (and a place in `rows`) in conf/eval/gate.yaml.
"""
from __future__ import annotations

import datetime as dt
import hashlib
import json
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Callable, Iterable, Mapping

from tqdm import tqdm

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eval.clips.make_clips import Clip, ClipSetConfig, load_clips, make_clips  # noqa: E402
from eval.consistency import consistency  # noqa: E402
from eval.encoder_parity import encoder_parity  # noqa: E402
from eval.margins import margins  # noqa: E402
from eval.models import ModelSet, clip_audio, ieee_fp32, load_model_set  # noqa: E402
from eval.report import AudioSample, GateReport, RowRecord, format_table, log_wandb, write_report  # noqa: E402
from eval.row import FAIL, NA, NON_SPEECH_KINDS, PASS, SPEECH_KINDS, AgentReply, Criteria, GateContext, RowResult  # noqa: E402,F401
from eval.wer import check_speech, normalize_text, wer  # noqa: E402

# ---------------------------------------------------------------------------------------------------
# Criteria: read once, frozen, hashed


def freeze(value):
    """Deep read-only copy: dicts -> MappingProxyType, lists -> tuples."""
    if isinstance(value, Mapping):
        return MappingProxyType({k: freeze(v) for k, v in value.items()})
    if isinstance(value, (list, tuple)):
        return tuple(freeze(v) for v in value)
    return value


def thaw(value):
    """Plain dict/list copy of a frozen value (for JSON)."""
    if isinstance(value, Mapping):
        return {k: thaw(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return [thaw(v) for v in value]
    return value


def criteria_hash(criteria: Criteria) -> str:
    return hashlib.sha256(json.dumps(thaw(criteria), sort_keys=True).encode()).hexdigest()


# ---------------------------------------------------------------------------------------------------
# Rows


@dataclass
class Row:
    name: str
    run: Callable[[GateContext, Criteria], RowResult]


def wer_pipeline(ctx: GateContext, criteria: Criteria) -> RowResult:
    """The ASR check itself, on clips whose words are known: speech clips must be heard as speech and
    transcribed within the WER bounds; silence and noise clips must not pass as speech."""
    speech, non_speech = ctx.clips_of(SPEECH_KINDS), ctx.clips_of(NON_SPEECH_KINDS)
    speech = [c for c in speech if c.text]
    if not speech or not non_speech:
        return RowResult(FAIL, "needs clips with known words and silence/noise clips; got "
                               f"{len(speech)} and {len(non_speech)} (see conf/eval/clips.yaml)")
    asr = ctx.transcriber()
    per_clip, refs, hyps, detected = {}, [], [], 0
    for clip in ctx.progress(speech, "wer_pipeline: speech"):
        wav, sr = clip.load()
        ok, ev = check_speech(wav, sr, asr)
        text = ev.text if ev.text is not None else asr(wav, sr)  # rejected clips are still scored
        refs.append(clip.text)
        hyps.append(text)
        detected += ok
        per_clip[clip.name] = {"is_speech": ok, "wer": wer(clip.text, text), "hypothesis": text,
                               "reference": normalize_text(clip.text)}
    accepted = []
    for clip in ctx.progress(non_speech, "wer_pipeline: noise"):
        wav, sr = clip.load()
        ok, ev = check_speech(wav, sr, asr)
        accepted += [clip.name] if ok else []
        per_clip[clip.name] = {"is_speech": ok, "evidence": ev.to_dict()}
    metrics = {
        "corpus_wer": wer(refs, hyps),
        "max_clip_wer": max(per_clip[c.name]["wer"] for c in speech),
        "speech_detected": detected / len(speech),
        "noise_accepted": len(accepted),
    }
    failures = []
    if metrics["corpus_wer"] > criteria["max_corpus_wer"]:
        failures.append(f"corpus WER {metrics['corpus_wer']:.3f} > {criteria['max_corpus_wer']}")
    if metrics["max_clip_wer"] > criteria["max_clip_wer"]:
        failures.append(f"worst clip WER {metrics['max_clip_wer']:.3f} > {criteria['max_clip_wer']}")
    if metrics["speech_detected"] < criteria["min_speech_detected"]:
        failures.append(f"speech detected on {metrics['speech_detected']:.2f} of speech clips "
                        f"< {criteria['min_speech_detected']}")
    if metrics["noise_accepted"] > criteria["max_noise_accepted"]:
        failures.append(f"silence/noise passed as speech: {accepted}")
    first = speech[0]
    audio = [AudioSample(f"wer_pipeline_{first.name}", *first.load(), caption=f"ASR: {hyps[0]!r}")]
    return RowResult(FAIL if failures else PASS, "; ".join(failures) or
                     f"ASR WER {metrics['corpus_wer']:.3f} on {len(speech)} clips; {len(non_speech)} "
                     "silence/noise clips rejected", metrics, {"clips": per_clip}, audio)


def agent_wer(ctx: GateContext, criteria: Criteria) -> RowResult:
    """The talker says what the LLM wrote: ASR of the agent's audio against the agent's own text, over
    every speech clip. Replies with no text are listed but not scored."""
    if ctx.checkpoint_kind == "random":
        return RowResult(NA, "random weights: the agent's text and audio are noise by construction, so "
                             "their WER means nothing (load a trained checkpoint, eval.checkpoint_kind=trained)")
    if ctx.respond is None:
        return RowResult(FAIL, "trained weights but no model runner to make the agent's replies "
                               "(GateContext.respond is None)")
    asr = ctx.transcriber()
    per_clip, refs, hyps, spoken, silent = {}, [], [], 0, []
    samples = []
    for clip in ctx.progress(ctx.clips_of(SPEECH_KINDS), "agent_wer"):
        reply = ctx.respond(clip)
        if not normalize_text(reply.text):
            silent.append(clip.name)
            continue
        ok, ev = check_speech(reply.audio, reply.sample_rate, asr)
        text = ev.text if ok else ""  # audio that is not speech says none of the words
        refs.append(reply.text)
        hyps.append(text)
        spoken += ok
        per_clip[clip.name] = {"is_speech": ok, "wer": wer(reply.text, text), "agent_text": reply.text,
                               "asr": text, "evidence": ev.to_dict()}
        if len(samples) < 2:
            samples.append(AudioSample(f"agent_{clip.name}", reply.audio, reply.sample_rate,
                                       caption=f"text: {reply.text!r} | ASR: {text!r}"))
    if not refs:
        return RowResult(FAIL, f"the agent wrote no text on any of {len(silent)} speech clips",
                         {"replies_scored": 0}, {"silent": silent})
    metrics = {"corpus_wer": wer(refs, hyps), "speech_fraction": spoken / len(refs), "replies_scored": len(refs),
               "replies_without_text": len(silent)}
    failures = []
    if metrics["corpus_wer"] > criteria["max_corpus_wer"]:
        failures.append(f"agent WER {metrics['corpus_wer']:.3f} > {criteria['max_corpus_wer']}")
    if metrics["speech_fraction"] < criteria["min_speech_fraction"]:
        failures.append(f"only {metrics['speech_fraction']:.2f} of replies with text sound like speech "
                        f"(< {criteria['min_speech_fraction']})")
    return RowResult(FAIL if failures else PASS, "; ".join(failures) or
                     f"agent WER {metrics['corpus_wer']:.3f} over {len(refs)} replies",
                     metrics, {"clips": per_clip, "silent": silent}, samples)


ROWS: dict[str, Callable[[GateContext, Criteria], RowResult]] = {
    "wer_pipeline": wer_pipeline,       # the ASR itself (eval/wer.py)
    "encoder_parity": encoder_parity,   # streaming encoder = offline (eval/encoder_parity.py)
    "margins": margins,                 # bf16 vs fp32 decisions, near-ties only (eval/margins.py)
    "consistency": consistency,         # offline = streaming = engine (eval/consistency.py)
    "agent_wer": agent_wer,             # the talker says the agent's text
}


# ---------------------------------------------------------------------------------------------------
# Runner


def select_rows(names: Iterable[str], criteria: Criteria, known: Mapping[str, Callable] = ROWS) -> list[Row]:
    """Rows by name, checked before anything runs: every row must exist and have criteria."""
    names = list(names)
    unknown = [n for n in names if n not in known]
    if unknown:
        raise KeyError(f"unknown gate rows {unknown}; known: {sorted(known)}")
    without = [n for n in names if n not in criteria]
    if without:
        raise KeyError(f"rows {without} have no criteria: add them under eval.criteria in conf/eval/gate.yaml")
    return [Row(n, known[n]) for n in names]


def run_rows(rows: list[Row], criteria: Criteria, ctx: GateContext, run_name: str, config: dict,
             audio_limit: int = 4) -> tuple[GateReport, list[AudioSample]]:
    """Run every row in order with a progress bar. A row that raises is a fail (with its traceback),
    never skipped. Returns the report and up to `audio_limit` audio samples."""
    if not isinstance(criteria, MappingProxyType):
        raise TypeError("criteria must be frozen (eval.gate.freeze) before the run")
    report = GateReport(run_name=run_name, started=dt.datetime.now().isoformat(timespec="seconds"),
                        criteria_sha256=criteria_hash(criteria), criteria=thaw(criteria), config=config)
    samples: list[AudioSample] = []
    bar = tqdm(rows, desc="gate", unit="row", disable=not ctx.show_progress)
    for row in bar:
        bar.set_postfix_str(row.name)
        t0 = time.perf_counter()
        try:
            result = row.run(ctx, criteria[row.name])
        except Exception as e:  # noqa: BLE001 - a crashing row is a failed row
            result = RowResult(FAIL, f"error: {type(e).__name__}: {e}", details={"traceback": traceback.format_exc()})
        seconds = time.perf_counter() - t0
        report.rows.append(RowRecord(row.name, result.status, result.reason, result.metrics,
                                     thaw(criteria[row.name]), result.details, seconds))
        samples += result.audio
        tqdm.write(f"[{result.status.upper():4s}] {row.name} ({seconds:.1f} s): {result.reason}")
    if criteria_hash(criteria) != report.criteria_sha256:  # cannot happen with frozen criteria; checked anyway
        raise RuntimeError("the criteria changed during the run")
    return report, samples[:audio_limit]


# ---------------------------------------------------------------------------------------------------
# Entry point


def resolve_checkpoint_kind(kind: str, random_weights: bool) -> str:
    """auto -> random when the weights are noise by construction (runtime.ResolvedModel.random_weights:
    model.weights=random, the embedded tiny checkpoint, or a checkpoint whose config.json has
    "random_weights": true, as scripts/make_checkpoint.py writes); trained otherwise."""
    if kind in ("random", "trained"):
        return kind
    if kind != "auto":
        raise ValueError(f"eval.checkpoint_kind must be auto, random or trained, not {kind!r}")
    return "random" if random_weights else "trained"


def prepare_clips(clips_cfg: dict, out_dir: Path, only: list[str] | None) -> list[Clip]:
    """The configured folder of WAVs, or the espeak clips made fresh under <out>/clips."""
    cfg = ClipSetConfig.from_dict(clips_cfg)
    if cfg.dir:
        clips = load_clips(cfg.dir)
        if only is not None:
            clips = [c for c in clips if c.name in only]
        return clips
    return make_clips(out_dir / "clips", cfg, names=only)


def streaming_reply(models: ModelSet, clip: Clip, seed: int = 0) -> AgentReply:
    """The agent's answer to a whole clip: the configured model streaming it (spec 7.2), greedy text."""
    from nemo_duplex.serving.frame_step import stream_inference

    model = models.configured
    res = stream_inference(model, clip_audio(clip, model.cfg), seed=seed)
    return AgentReply(models.tokenizer.decode(res.text_tokens.tolist()), res.wav.float().cpu().numpy(),
                      model.cfg.target_sample_rate)


def gate_main(cfg, respond: Callable[[Clip], AgentReply] | None = None, show_progress: bool = True,
              models: ModelSet | None = None, overrides: list[str] | None = None) -> int:
    """The gate on a composed config (conf/gate.yaml; schema eval/settings.py GateApp). Returns the exit
    status. The checkpoint is resolved first (a missing one fails here, in seconds); the models are loaded
    from `cfg` when a row first needs them, unless given (`models`); agent replies come from `respond`, by
    default the configured model streaming each clip. `overrides`: the command line's (runtime.load)."""
    from omegaconf import OmegaConf

    from nemo_duplex import runtime

    ev = OmegaConf.to_container(cfg.eval, resolve=True)
    criteria = freeze(ev["criteria"])  # read once; rows only ever see read-only views
    rows = select_rows(ev["rows"], criteria)
    out_dir = Path(ev["out_dir"]) if ev.get("out_dir") else _hydra_run_dir()
    run_name = f"gate-{out_dir.parent.name}-{out_dir.name}"
    resolved = runtime.resolve_model(cfg, overrides)
    print(runtime.summary(cfg, resolved, "gate"), flush=True)
    runtime.write_settings(out_dir, cfg, resolved)
    kind = resolve_checkpoint_kind(ev["checkpoint_kind"], resolved.random_weights)
    clips = prepare_clips(ev["clips"], out_dir, ev.get("only_clips"))
    settings = freeze(ev["models"])
    device = str(OmegaConf.select(cfg, "device", default="cpu"))
    if device.startswith("cuda"):
        ieee_fp32()
    elif settings.get("cpu_threads"):
        import torch

        torch.set_num_threads(int(settings["cpu_threads"]))  # the tiny model's ops are too small to share
    ctx = GateContext(clips=clips, out_dir=out_dir, checkpoint_kind=kind, asr_backend=ev["asr"]["backend"],
                      asr_model_path=ev["asr"]["model_path"], respond=respond, show_progress=show_progress,
                      load_models=(lambda: models) if models is not None else
                      (lambda: load_model_set(cfg, settings["bf16_dtype"], resolved)),
                      settings=settings)
    if ctx.respond is None:
        ctx.respond = lambda clip: streaming_reply(ctx.models(), clip, int(settings.get("seed", 0)))
    config = {"eval": ev, "checkpoint": OmegaConf.select(cfg, "checkpoint"),
              "weights": resolved.source.describe() if resolved.source is not None else "random",
              "model": resolved.cfg.name, "checkpoint_kind": kind,
              "clips": [{"name": c.name, "kind": c.kind, "sha256": c.sha256} for c in clips]}
    report, samples = run_rows(rows, criteria, ctx, run_name, config, ev["audio_samples"])
    print(format_table(report))
    paths = write_report(report, out_dir, samples)
    wandb_dir = log_wandb(report, samples, OmegaConf.select(cfg, "wandb.mode", default="offline"),
                          OmegaConf.select(cfg, "wandb.project", default="nemo-duplex"), out_dir, tags=["gate"])
    print(f"wrote {paths['md']} and {paths['json']}" + (f"; W&B run in {wandb_dir}" if wandb_dir else ""))
    return report.exit_code


def _hydra_run_dir() -> Path:
    from hydra.core.hydra_config import HydraConfig

    return Path(HydraConfig.get().runtime.output_dir)


def main() -> None:
    """The gate as a Hydra app (conf/gate.yaml). Exits with the gate's status."""
    import hydra

    from eval.settings import register
    from nemo_duplex import runtime

    register()
    conf = Path(__file__).resolve().parents[1] / "conf"

    @hydra.main(version_base="1.3", config_path=str(conf), config_name="gate")
    def app(cfg) -> None:
        with runtime.refusals("gate"):
            status = gate_main(cfg)
        sys.exit(status)

    app()


if __name__ == "__main__":
    main()
