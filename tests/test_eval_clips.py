"""Offline clip evaluation (eval/clips.py, eval/clips/evaluate.py): latency, user stop, function-call
spans, and a folder run on the tiny model writing WAVs, frame tables, timelines and the summary."""
import json
from pathlib import Path

import numpy as np
import pytest

from eval.audio import read_wav, write_wav
from eval.clips.evaluate import FRAME_S, frame_db, function_calls, response_latency, user_stop_s
from eval.clips.make_clips import Clip

REPO = Path(__file__).resolve().parents[1]


def test_response_latency():
    rng = np.random.default_rng()
    quiet, loud = -60.0 - 10 * rng.random(30), -20.0 + 5 * rng.random(30)
    stop = 0.5                                       # user stops inside frame 6 (0.48 .. 0.56 s)
    db = quiet.copy()
    db[10:] = loud[10:]
    assert response_latency(db, stop, -40.0) == pytest.approx(10 * FRAME_S - stop)     # 0.30 s
    db = quiet.copy()
    db[6] = loud[6]                                  # speaking when the user stops: no wait
    assert response_latency(db, stop, -40.0) == 0.0
    db = quiet.copy()
    db[3] = loud[3]                                  # spoke only before the user stopped: no answer
    assert response_latency(db, stop, -40.0) is None
    assert response_latency(loud, None, -40.0) is None


def test_user_stop_from_timing_or_energy(tmp_path):
    rng = np.random.default_rng()
    wav = np.zeros(16000 * 2, np.float32)
    wav[3200: 15360] = 0.3 * rng.standard_normal(15360 - 3200)   # "speech" 0.2 s .. 0.96 s = end of frame 12
    clip = Clip("c", "user", str(tmp_path / "c.wav"), None, 2.0, 16000)
    assert user_stop_s(clip, wav, -40.0) == pytest.approx(0.96)
    clip.speech_end_s = 0.9                                        # a clip's own timing wins
    assert user_stop_s(clip, wav, -40.0) == 0.9
    silent = Clip("s", "silence", str(tmp_path / "s.wav"), "", 2.0, 16000)
    assert user_stop_s(silent, wav, -40.0) is None
    assert np.isneginf(frame_db(np.zeros(2560, np.float32), 1280)).all()


def test_function_calls_between_start_and_end_tokens(tiny):
    model, tok, *_ = tiny
    t = model.cfg.tokens
    start, end, pad = tok.token_to_id(t.tool_call_start), tok.token_to_id(t.tool_call_end), t.pad_id
    body = tok.encode('<TOOLCALL>[{"name": "weather", "arguments": {"city": "Paris"}}]</TOOLCALL>')
    spread = [x for b in body for x in (b, pad)]       # PAD between call tokens carries nothing
    func = [pad] * 3 + [start] + spread + [end] + [pad] * 2 + [start] + tok.encode("not json") + [end] + [start, 40]
    calls = function_calls(func, tok, t)
    assert calls[0]["start_frame"] == 3 and calls[0]["end_frame"] == 4 + len(spread)
    assert calls[0]["calls"] == [{"name": "weather", "arguments": '{"city": "Paris"}'}]
    assert "error" in calls[1] and calls[1]["text"] == "not json"
    assert calls[2]["end_frame"] is None and "ended inside" in calls[2]["error"]
    assert function_calls([pad] * 10, tok, t) == []


def test_folder_evaluation_writes_clip_outputs_and_summary(tmp_path, tiny, example_clip):
    import importlib.util

    from tests.apps import compose_app

    spec = importlib.util.spec_from_file_location("clips_app", REPO / "eval" / "clips.py")
    app = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(app)

    model, tok, rnnt_vocab, _ = tiny
    folder = tmp_path / "wavs"
    folder.mkdir()
    speech = example_clip[:12800].numpy() + 0.01 * np.random.default_rng().standard_normal(12800).astype(np.float32)
    write_wav(folder / "asks.wav", speech, 16000)
    (folder / "asks.txt").write_text("what is the capital of france")
    from eval.audio import resample

    write_wav(folder / "at22k.wav", resample(speech[:8000], 16000, 22050), 22050)   # resampled to 16 kHz
    out = tmp_path / "out"
    cfg = compose_app("eval_clips", [f"dir={folder}", f"out={out}"])
    app.run(cfg, loaded=(model, tok, rnnt_vocab), show_progress=False)

    summary = json.loads((out / "summary.json").read_text())
    by_name = {c["name"]: c for c in summary["clips"]}
    assert sorted(by_name) == ["asks", "at22k"]
    assert by_name["asks"]["frames"] == 10 and by_name["at22k"]["frames"] == 7   # 8000 samples -> 7 frames
    agent, sr = read_wav(out / "asks" / "agent.wav")
    assert sr == 22050 and agent.shape[0] == 10 * 1764
    assert "random weights" in by_name["asks"]["wer_note"] and by_name["asks"]["user_wer"] is None
    assert (out / "asks" / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = (out / "asks" / "frames.tsv").read_text().splitlines()
    assert len(rows) == 1 + 10
    md = (out / "summary.md").read_text()
    assert "| asks |" in md and "| at22k |" in md and "latency" in md
