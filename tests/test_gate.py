"""The gate framework (eval/gate.py, eval/report.py): statuses, exit codes, frozen criteria, the report
files, the agent_wer row's n/a and pass/fail, and the Hydra entry point. Needs espeak-ng (no skip)."""
import json
import subprocess
import sys
from pathlib import Path
from types import MappingProxyType

import numpy as np
import pytest

from eval.audio import resample
from eval.clips.make_clips import make_clips
from eval.gate import (
    FAIL,
    NA,
    PASS,
    AgentReply,
    GateContext,
    Row,
    RowResult,
    agent_wer,
    freeze,
    gate_main,
    resolve_checkpoint_kind,
    run_rows,
    select_rows,
)
from eval.report import write_report

REPO = Path(__file__).resolve().parents[1]


def _ctx(tmp_path, clips=(), kind="random", respond=None):
    return GateContext(clips=list(clips), out_dir=tmp_path, checkpoint_kind=kind, respond=respond,
                       show_progress=False)


def _toy(status, reason="toy"):
    return lambda ctx, criteria: RowResult(status, reason, {"value": 1.0})


def _run(rows, tmp_path, criteria=None):
    criteria = freeze(criteria if criteria is not None else {r.name: {"bound": 1.0} for r in rows})
    report, _ = run_rows(rows, criteria, _ctx(tmp_path), "test", {})
    return report


# --- statuses and exit codes -----------------------------------------------------------------------

def test_exit_zero_when_all_pass_or_na(tmp_path):
    report = _run([Row("a", _toy(PASS)), Row("b", _toy(NA, "random weights")), Row("c", _toy(PASS))], tmp_path)
    assert report.exit_code == 0 and report.verdict == "pass"
    only_na = _run([Row("b", _toy(NA, "random weights"))], tmp_path)
    assert only_na.exit_code == 0


def test_exit_nonzero_when_a_row_fails(tmp_path):
    report = _run([Row("a", _toy(PASS)), Row("b", _toy(FAIL, "too high")), Row("c", _toy(NA, "n/a"))], tmp_path)
    assert report.exit_code == 1 and report.verdict == "fail"


def test_crashing_row_fails_and_later_rows_still_run(tmp_path):
    def crash(ctx, criteria):
        raise RuntimeError("boom")

    report = _run([Row("crash", crash), Row("after", _toy(PASS))], tmp_path)
    assert [r.status for r in report.rows] == [FAIL, PASS]
    assert "boom" in report.rows[0].reason and "Traceback" in report.rows[0].details["traceback"]
    assert report.exit_code == 1


def test_na_is_never_counted_as_passed(tmp_path):
    report = _run([Row("p", _toy(PASS)), Row("n", _toy(NA, "random weights"))], tmp_path)
    paths = write_report(report, tmp_path)
    data = json.loads(paths["json"].read_text())
    assert data["passed"] == ["p"] and data["not_applicable"] == ["n"]
    assert data["counts"] == {"pass": 1, "fail": 0, "n/a": 1}
    row = next(r for r in data["rows"] if r["name"] == "n")
    assert row["status"] == "n/a" and row["reason"] == "random weights"
    md = paths["md"].read_text()
    assert "| n | **n/a** |" in md and "1 passed, 0 failed, 1 not applicable" in md


def test_fail_and_na_need_a_reason():
    with pytest.raises(ValueError):
        RowResult(NA)
    with pytest.raises(ValueError):
        RowResult(FAIL)
    with pytest.raises(ValueError):
        RowResult("skipped", "no")
    RowResult(PASS)


# --- criteria --------------------------------------------------------------------------------------

def test_criteria_are_frozen_during_the_run(tmp_path):
    criteria = freeze({"loosen": {"max_wer": 0.1, "clips": ["a", "b"]}})
    assert isinstance(criteria["loosen"], MappingProxyType)
    with pytest.raises(TypeError):
        criteria["loosen"]["max_wer"] = 1.0
    with pytest.raises(TypeError):
        criteria["new_row"] = {}

    def loosen(ctx, row_criteria):
        row_criteria["max_wer"] = 1.0  # a row may not move its own goalposts
        return RowResult(PASS)

    report, _ = run_rows([Row("loosen", loosen)], criteria, _ctx(tmp_path), "t", {})
    assert report.rows[0].status == FAIL and "TypeError" in report.rows[0].reason
    assert report.criteria["loosen"]["max_wer"] == 0.1 and report.rows[0].criteria["max_wer"] == 0.1
    with pytest.raises(TypeError, match="frozen"):
        run_rows([Row("a", _toy(PASS))], {"a": {}}, _ctx(tmp_path), "t", {})  # a plain dict is refused


def test_criteria_hash_changes_with_the_criteria(tmp_path):
    rows = [Row("a", _toy(PASS))]
    h1 = _run(rows, tmp_path, {"a": {"bound": 1.0}}).criteria_sha256
    h2 = _run(rows, tmp_path, {"a": {"bound": 1.0}}).criteria_sha256
    h3 = _run(rows, tmp_path, {"a": {"bound": 1.5}}).criteria_sha256
    assert h1 == h2 != h3


def test_select_rows_checks_names_and_criteria():
    known = {"a": _toy(PASS), "b": _toy(PASS)}
    assert [r.name for r in select_rows(["b", "a"], freeze({"a": {}, "b": {}}), known)] == ["b", "a"]
    with pytest.raises(KeyError, match="unknown gate rows"):
        select_rows(["c"], freeze({"c": {}}), known)
    with pytest.raises(KeyError, match="no criteria"):
        select_rows(["a", "b"], freeze({"a": {}}), known)


def test_resolve_checkpoint_kind(tmp_path, tiny_checkpoint):
    import shutil

    from nemo_duplex.runtime import resolve_model

    def kind(*overrides):
        cfg = _compose(list(overrides))
        return resolve_checkpoint_kind(cfg.eval.checkpoint_kind, resolve_model(cfg, list(overrides)).random_weights)

    assert kind() == "random"                                      # the embedded tiny checkpoint
    assert kind("model.weights=random") == "random"
    assert kind(f"checkpoint={tiny_checkpoint}") == "random"       # make_random_checkpoint marks config.json
    trained = tmp_path / "trained"
    shutil.copytree(tiny_checkpoint, trained)
    official = json.loads((trained / "config.json").read_text())
    del official["random_weights"]
    (trained / "config.json").write_text(json.dumps(official))
    assert kind(f"checkpoint={trained}") == "trained"
    assert kind(f"checkpoint={trained}", "eval.checkpoint_kind=random") == "random"
    assert resolve_checkpoint_kind("trained", True) == "trained"
    with pytest.raises(ValueError):
        resolve_checkpoint_kind("maybe", False)


# --- the agent_wer row -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    return make_clips(tmp_path_factory.mktemp("clips"), names=["question_capital", "tool_weather"],
                      trailing_silence_s=0.5)


CRITERIA = freeze({"max_corpus_wer": 0.5, "min_speech_fraction": 1.0})


def test_agent_wer_na_with_random_weights(tmp_path):
    result = agent_wer(_ctx(tmp_path, kind="random"), CRITERIA)
    assert result.status == NA and "random weights" in result.reason


def test_agent_wer_fails_without_a_model_runner(tmp_path):
    assert agent_wer(_ctx(tmp_path, kind="trained"), CRITERIA).status == FAIL


def test_agent_wer_judges_replies(tmp_path, clips):
    # A "talker" that says exactly its text (espeak audio at the agent's 22.05 kHz) passes ...
    def faithful(clip):
        wav, sr = clip.load()
        return AgentReply(clip.text, resample(wav, sr, 22050), 22050)

    good = agent_wer(_ctx(tmp_path, clips, "trained", faithful), CRITERIA)
    assert good.status == PASS, good.reason
    assert good.metrics["replies_scored"] == 2 and good.metrics["corpus_wer"] <= 0.5

    # ... one whose audio is hiss fails, however loud the hiss.
    rng = np.random.default_rng()

    def hissing(clip):
        return AgentReply(clip.text, (0.1 * rng.standard_normal(22050 * 2)).astype(np.float32), 22050)

    bad = agent_wer(_ctx(tmp_path, clips, "trained", hissing), CRITERIA)
    assert bad.status == FAIL and bad.metrics["speech_fraction"] == 0.0 and bad.metrics["corpus_wer"] == 1.0


# --- the entry point -------------------------------------------------------------------------------

def _compose(overrides):
    from tests.apps import compose_app

    return compose_app("gate", overrides)


def test_gate_main_writes_reports_and_exit_status(tmp_path):
    quick = ["eval.only_clips=[question_capital,noise_white]", "eval.rows=[wer_pipeline,agent_wer]", "wandb.mode=disabled"]
    ok = gate_main(_compose(quick + [f"eval.out_dir={tmp_path / 'ok'}"]), show_progress=False)
    assert ok == 0
    data = json.loads((tmp_path / "ok" / "gate.json").read_text())
    assert data["counts"] == {"pass": 1, "fail": 0, "n/a": 1}  # agent_wer: random tiny model
    assert (tmp_path / "ok" / "gate.md").exists() and list((tmp_path / "ok" / "audio").glob("*.wav"))
    # the same clips again, as a user's folder (its clips.json), under a criterion no ASR can meet
    strict = quick + [f"eval.out_dir={tmp_path / 'strict'}", f"eval.clips.dir={tmp_path / 'ok' / 'clips'}",
                      "eval.criteria.wer_pipeline.max_corpus_wer=-1"]
    assert gate_main(_compose(strict), show_progress=False) == 1


def _offline_run(out: Path) -> tuple[dict, dict, Path]:
    from tests.wandb_records import logged

    (run,) = (out / "wandb").glob("offline-run-*")
    history, summary = logged(run)
    return history, summary, run


def test_gate_script_exit_status_and_offline_wandb(tmp_path):
    # The Hydra app itself: a failed row reaches the shell as exit status 1 after the run completed (the report,
    # and an offline W&B run with the row's metrics and audio): not a crash, which exits 1 as well.
    out = tmp_path / "run"
    cmd = [sys.executable, "eval/gate.py", "eval.only_clips=[question_capital,noise_white]",
           "eval.rows=[wer_pipeline,agent_wer]",
           f"eval.out_dir={out}", "eval.criteria.wer_pipeline.max_corpus_wer=-1", "wandb.mode=offline",
           f"hydra.run.dir={tmp_path / 'hydra'}"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**__import__("os").environ, "WANDB_SILENT": "true"})
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "verdict: FAIL" in proc.stdout and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert json.loads((out / "gate.json").read_text())["failed"] == ["wer_pipeline"]
    history, summary, run = _offline_run(out)
    assert summary["gate/verdict"] == "fail" and summary["gate/fail"] == 1
    assert history["wer_pipeline/corpus_wer"][0] >= 0
    (audio,) = history["audio/wer_pipeline_question_capital/path"]
    assert (run / "files" / audio).stat().st_size > 0


def test_gate_at_its_defaults_completes_and_logs_to_wandb_offline(tmp_path):
    """`python eval/gate.py` as a user types it: every row on the default clips, to a verdict, with an offline
    W&B run holding every row's metrics, the verdict and the audio samples (wandb.Audio needs soundfile, which
    the `eval` extra installs)."""
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "eval/gate.py", f"eval.out_dir={out}", f"hydra.run.dir={tmp_path}"],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / "gate.json").read_text())
    rows = ["wer_pipeline", "encoder_parity", "margins", "consistency", "agent_wer"]
    assert [r["name"] for r in report["rows"]] == rows
    assert report["counts"] == {"pass": 4, "fail": 0, "n/a": 1}    # agent_wer: the embedded random weights
    history, summary, run = _offline_run(out)
    assert summary["gate/verdict"] == "pass" and summary["gate/pass"] == 4 and summary["gate/n/a"] == 1
    for r in report["rows"]:
        for k, v in r["metrics"].items():
            if isinstance(v, (int, float)):
                assert history[f"{r['name']}/{k}"] == [float(v)], (r["name"], k)
    audio = [v[0] for k, v in history.items() if k.startswith("audio/") and k.endswith("/path")]
    assert audio and all((run / "files" / a).stat().st_size > 0 for a in audio)
    assert (out / "settings.yaml").is_file()


def test_gate_runs_the_model_rows(tmp_path, tiny):
    # The model rows through gate_main on the tiny model (given, not reloaded), cut short: they pass,
    # and the report lists them with their metrics and criteria.
    from eval.models import ModelSet

    model, tok, rnnt_vocab, _ = tiny
    models = ModelSet.from_fp32(model, tok, rnnt_vocab, {"encoder": "bf16", "llm": "bf16", "talker": "bf16"})
    rows = ["encoder_parity", "margins", "consistency"]
    cfg = _compose(["eval.only_clips=[question_capital,noise_white]", f"eval.rows=[{','.join(rows)}]",
                    "eval.models.clips=[noise_white]", "eval.models.max_seconds=0.5", "eval.models.batch_calls=3",
                    "eval.models.chunk_sizes=[320,4000]",
                    "wandb.mode=disabled", f"eval.out_dir={tmp_path}"])
    assert gate_main(cfg, show_progress=False, models=models) == 0
    data = json.loads((tmp_path / "gate.json").read_text())
    assert data["passed"] == rows
    by_name = {r["name"]: r for r in data["rows"]}
    assert by_name["margins"]["metrics"]["frames"] == 6   # one clip of 0.5 s = 6 whole frames
    assert by_name["consistency"]["criteria"]["near_tie_margin"] == 1.0
    assert "| consistency | **pass** |" in (tmp_path / "gate.md").read_text()


def test_one_row_alone_fails_on_a_criterion_it_cannot_meet(tmp_path):
    # `python eval/gate.py eval.rows=[encoder_parity]`: that one row; a bound no encoder meets must fail it.
    # Composed as the script composes it and run in this process (the script's own exit status is
    # test_gate_script_exit_status_and_offline_wandb's), the model loaded from the config as the script does.
    out = tmp_path / "run"
    cfg = _compose(["eval.rows=[encoder_parity]", "eval.only_clips=[question_capital]",
                    "eval.models.max_seconds=0.5", "eval.models.chunk_sizes=[1280]", f"eval.out_dir={out}",
                    "eval.criteria.encoder_parity.fp32_min_cosine=1.1", "wandb.mode=disabled"])
    assert gate_main(cfg, show_progress=False) == 1
    data = json.loads((out / "gate.json").read_text())
    assert [r["name"] for r in data["rows"]] == ["encoder_parity"] and data["failed"] == ["encoder_parity"]
    assert "cosine" in data["rows"][0]["reason"]
