"""Offline evaluation of a folder of clips: what the agent says to each, and when.

    python eval/clips.py dir=<wavs> [checkpoint=<dir>] [mode=offline] [prompt="..."] [out=<dir>]

Per clip (a WAV at any rate, resampled to 16 kHz; `<name>.txt` beside it, or the folder's clips.json
from make_clips.py, gives the user's words and when they end):
- the agent's WAV (22.05 kHz), its text, the user transcript (RNN-T head), the function calls;
- the response latency: from the moment the user stops (the clip's timing, else the end of the last
  input frame above `user_voiced_db`) to the first agent frame voiced after it (output RMS above
  `voiced_db`); 0 when the agent is already speaking then, None when it never speaks after;
- WER where it means something: the user transcript against the clip's words, and the agent's audio
  (ASR) against its own text, both only with trained weights;
- a per-frame timeline PNG: the user's waveform, the agent's waveform with its voiced frames, and the
  text and function tokens on the frame grid.
Plus summary.md / summary.json with a table over all clips.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from eval.audio import resample, write_wav
from eval.clips.make_clips import Clip, load_clips
from eval.settings import EvalSettings

FRAME_S = 0.08  # one frame of input and of output (spec 1.2)


@dataclass
class ClipReport:
    name: str
    seconds: float
    frames: int
    agent_wav: str
    agent_text: str
    user_transcript: str
    function_calls: list[dict] = field(default_factory=list)
    user_stop_s: float | None = None
    latency_s: float | None = None
    agent_voiced_s: float = 0.0
    user_wer: float | None = None
    agent_wer: float | None = None
    wer_note: str = ""
    timeline_png: str | None = None


# ---------------------------------------------------------------------------------------------------
# Measurements


def frame_db(wav: np.ndarray, frame: int) -> np.ndarray:
    """RMS per whole frame in dBFS (-inf for digital silence)."""
    n = len(wav) // frame
    x = np.asarray(wav[: n * frame], np.float64).reshape(n, frame)
    rms = np.sqrt(np.mean(x * x, axis=1))
    with np.errstate(divide="ignore"):
        return 20.0 * np.log10(rms)


def user_stop_s(clip: Clip, audio16k: np.ndarray, voiced_db: float) -> float | None:
    """When the user's last word ends: the clip's own timing when it has one, else the end of the last
    80 ms input frame louder than `voiced_db`; None when the user never speaks."""
    if clip.speech_end_s is not None:
        return float(clip.speech_end_s)
    if clip.text == "":
        return None  # a silence / noise clip with known content: nobody speaks
    voiced = np.nonzero(frame_db(audio16k, int(round(FRAME_S * 16000))) > voiced_db)[0]
    return None if voiced.size == 0 else float((voiced[-1] + 1) * FRAME_S)


def response_latency(agent_db: np.ndarray, stop_s: float | None, voiced_db: float) -> float | None:
    """Seconds from `stop_s` to the start of the first voiced agent frame that ends after it (0 when
    the agent is speaking at that moment); None without a stop or without a voiced frame after it."""
    if stop_s is None:
        return None
    for k in np.nonzero(agent_db > voiced_db)[0]:
        if (k + 1) * FRAME_S > stop_s + 1e-9:
            return max(0.0, k * FRAME_S - stop_s)
    return None


def function_calls(func_tokens: list[int], tokenizer, tokens) -> list[dict]:
    """Spans of the function channel between the tool-call start and end tokens (spec 3.9), decoded,
    with the frames where they start and end and the parsed calls (or why they do not parse)."""
    from nemo_duplex.server.tools import parse_tool_calls

    start, end = tokenizer.token_to_id(tokens.tool_call_start), tokenizer.token_to_id(tokens.tool_call_end)
    skip = getattr(tokenizer, "display_skip_ids", frozenset({tokens.pad_id}))
    calls, collecting, first = [], None, 0
    for k, f in enumerate(func_tokens):
        if start is not None and f == start:
            collecting, first = [], k
        elif collecting is None:
            continue
        elif f == end:
            text = tokenizer.decode(collecting)
            entry = {"start_frame": first, "end_frame": k, "text": text}
            try:
                entry["calls"] = [{"name": n, "arguments": a} for n, a in parse_tool_calls(text)]
            except ValueError as e:
                entry["error"] = str(e)
            calls.append(entry)
            collecting = None
        elif f not in skip:
            collecting.append(f)
    if collecting is not None:
        calls.append({"start_frame": first, "end_frame": None, "text": tokenizer.decode(collecting),
                      "error": "the clip ended inside the call"})
    return calls


# ---------------------------------------------------------------------------------------------------
# Plot


def plot_timeline(path: Path, name: str, user: np.ndarray, agent: np.ndarray, text_tokens: list[int],
                  func_tokens: list[int], tokenizer, pad_id: int, agent_db: np.ndarray, voiced_db: float,
                  stop_s: float | None, latency_s: float | None, max_labels: int, out_rate: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    frames = len(text_tokens)
    seconds = max(frames * FRAME_S, len(user) / 16000)
    fig, axes = plt.subplots(3, 1, figsize=(max(8.0, min(40.0, seconds * 1.2)), 6.5), sharex=True,
                             gridspec_kw={"height_ratios": [1, 1, 1.2]})
    t_user = np.arange(len(user)) / 16000
    axes[0].plot(t_user, user, lw=0.4, color="tab:blue")
    axes[0].set_ylabel("user")
    t_agent = np.arange(len(agent)) / out_rate
    axes[1].plot(t_agent, agent, lw=0.4, color="tab:green")
    for k in np.nonzero(agent_db > voiced_db)[0]:
        axes[1].axvspan(k * FRAME_S, (k + 1) * FRAME_S, color="tab:green", alpha=0.12, lw=0)
    axes[1].set_ylabel(f"agent\n(voiced > {voiced_db:g} dB)")
    labelled = 0
    for k, tok in enumerate(text_tokens):
        if tok == pad_id:
            continue
        axes[2].plot([k * FRAME_S], [1.0], "|", color="tab:purple", ms=10)
        if labelled < max_labels:
            axes[2].text(k * FRAME_S, 1.08, tokenizer.id_to_token(tok).replace("\u0120", " "), rotation=90,
                         fontsize=6, va="bottom", ha="center")
            labelled += 1
    for k, tok in enumerate(func_tokens):
        if tok != pad_id:
            axes[2].plot([k * FRAME_S], [0.3], "|", color="tab:orange", ms=10)
    axes[2].set_yticks([0.3, 1.0], ["function", "text"])
    axes[2].set_ylim(0, 2.2)
    axes[2].set_xlabel("seconds (one frame = 80 ms)")
    for ax in axes:
        if stop_s is not None:
            ax.axvline(stop_s, color="red", lw=1, ls="--")
        if stop_s is not None and latency_s is not None:
            ax.axvline(stop_s + latency_s, color="black", lw=1, ls=":")
    title = f"{name}: user stops {stop_s:.2f} s" if stop_s is not None else f"{name}: no user speech"
    if latency_s is not None:
        title += f", agent answers after {latency_s:.2f} s"
    axes[0].set_title(title)
    axes[-1].set_xlim(0, seconds)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------------
# One clip, all clips


def _wer_or_none(reference: str | None, hypothesis: str) -> float | None:
    from eval.wer import normalize_text, wer

    if not reference or not normalize_text(reference):
        return None
    return wer(reference, hypothesis)


@torch.no_grad()
def evaluate_clip(model, tokenizer, rnnt_vocab, clip: Clip, out_dir: Path, settings: EvalSettings,
                  mode: str = "streaming", prompt: str | None = None, seed: int = 0, sampling=None,
                  trained: bool = False, transcriber=None) -> ClipReport:
    from nemo_duplex.models.model import offline_inference
    from nemo_duplex.serving.frame_step import stream_inference

    wav, sr = clip.load()
    rate = model.cfg.source_sample_rate
    audio = resample(wav, sr, rate) if sr != rate else wav
    prompt_ids = model.prompt_ids(tokenizer, prompt)
    run = {"streaming": stream_inference, "offline": offline_inference}.get(mode)
    if run is None:
        raise ValueError(f"mode must be streaming or offline, not {mode!r}")
    res = run(model, torch.from_numpy(np.ascontiguousarray(audio, np.float32)), prompt_ids, seed=seed,
              sampling=sampling)
    out_rate, per_frame = model.cfg.target_sample_rate, model.cfg.samples_per_frame_out
    agent = res.wav.float().cpu().numpy()
    if mode == "offline" and prompt_ids is not None:   # spec 7.1: offline audio includes the prompt region
        agent = agent[prompt_ids.shape[0] * per_frame:]
    text_tokens, func_tokens = res.text_tokens.tolist(), res.function_tokens.tolist()

    clip_dir = out_dir / clip.name
    clip_dir.mkdir(parents=True, exist_ok=True)
    write_wav(clip_dir / "agent.wav", agent, out_rate)
    with open(clip_dir / "frames.tsv", "w") as f:
        f.write("frame\tseconds\ttext_token\tfunction_token\ttext_piece\n")
        for k, (t, fn) in enumerate(zip(text_tokens, func_tokens)):
            f.write(f"{k}\t{k * FRAME_S:.2f}\t{t}\t{fn}\t{tokenizer.id_to_token(t)!r}\n")

    agent_db = frame_db(agent, per_frame)
    stop = user_stop_s(clip, audio, settings.user_voiced_db)
    latency = response_latency(agent_db, stop, settings.voiced_db)
    agent_text = tokenizer.decode(text_tokens)
    user_text = rnnt_vocab.decode(res.user_tokens) if rnnt_vocab is not None else ""
    report = ClipReport(
        name=clip.name, seconds=len(audio) / rate, frames=len(text_tokens), agent_wav=str(clip_dir / "agent.wav"),
        agent_text=agent_text, user_transcript=user_text,
        function_calls=function_calls(func_tokens, tokenizer, model.cfg.tokens), user_stop_s=stop,
        latency_s=latency, agent_voiced_s=float(np.sum(agent_db > settings.voiced_db) * FRAME_S))
    if not trained:
        report.wer_note = "n/a: random weights (their text, transcript and audio are noise by construction)"
    else:
        notes = []
        if rnnt_vocab is not None:
            report.user_wer = _wer_or_none(clip.text, user_text)
            notes += [] if report.user_wer is not None else ["user WER: the clip's words are unknown"]
        else:
            notes.append("user WER: the checkpoint has no RNN-T head")
        if transcriber is not None and agent_text.strip():
            report.agent_wer = _wer_or_none(agent_text, transcriber(resample(agent, out_rate, 16000), 16000))
        else:
            notes.append("agent WER: " + ("no ASR configured" if transcriber is None else "the agent wrote nothing"))
        report.wer_note = "; ".join(notes)
    if settings.plots:
        png = clip_dir / "timeline.png"
        plot_timeline(png, clip.name, audio, agent, text_tokens, func_tokens, tokenizer, model.cfg.tokens.pad_id,
                      agent_db, settings.voiced_db, stop, latency, settings.max_labels, out_rate)
        report.timeline_png = str(png)
    return report


def _fmt(v, digits: int = 2) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, float):
        return "inf" if math.isinf(v) else f"{v:.{digits}f}"
    return str(v)


def _short(text: str, n: int = 60) -> str:
    text = text.replace("|", "\\|").replace("\n", " ")
    return text if len(text) <= n else text[: n - 3] + "..."


def summary_table(reports: list[ClipReport]) -> str:
    lines = ["| clip | seconds | user stops (s) | latency (s) | agent voiced (s) | agent text | user transcript | "
             "function calls | user WER | agent WER |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in reports:
        lines.append(f"| {r.name} | {r.seconds:.2f} | {_fmt(r.user_stop_s)} | {_fmt(r.latency_s)} | "
                     f"{r.agent_voiced_s:.2f} | {_short(r.agent_text)} | {_short(r.user_transcript)} | "
                     f"{len(r.function_calls)} | {_fmt(r.user_wer, 3)} | {_fmt(r.agent_wer, 3)} |")
    latencies = [r.latency_s for r in reports if r.latency_s is not None]
    lines += ["", f"{len(reports)} clips; response latency "
              + (f"median {np.median(latencies):.2f} s, max {max(latencies):.2f} s over {len(latencies)} clips"
                 if latencies else "n/a (no clip with both a user stop and a voiced agent frame after it)")]
    notes = sorted({r.wer_note for r in reports if r.wer_note})
    lines += [f"WER: {n}" for n in notes]
    return "\n".join(lines)


def evaluate_folder(model, tokenizer, rnnt_vocab, folder: str | Path, out_dir: str | Path,
                    settings: EvalSettings | None = None, show_progress: bool = True, **kw) -> list[ClipReport]:
    """Evaluate every clip of `folder` (see load_clips) into out_dir; writes summary.md and summary.json."""
    from tqdm import tqdm

    settings = settings or EvalSettings()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    clips = load_clips(folder)
    reports = [evaluate_clip(model, tokenizer, rnnt_vocab, c, out, settings, **kw)
               for c in tqdm(clips, desc="clips", disable=not show_progress)]
    table = summary_table(reports)
    (out / "summary.md").write_text(f"# Clip evaluation of {folder}\n\n{table}\n")
    (out / "summary.json").write_text(json.dumps({"folder": str(folder), "settings": asdict(settings),
                                                  "clips": [asdict(r) for r in reports]}, indent=2))
    return reports
