"""Writers for a gate report: the terminal table, gate.md, gate.json, and the W&B run.

They take the plain `GateReport` record from eval/gate.py and know nothing about rows or models.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

STATUSES = ("pass", "fail", "n/a")


@dataclass
class AudioSample:
    """A waveform a row wants a person to hear (logged to W&B and written under <out>/audio/)."""
    name: str
    wav: np.ndarray
    sample_rate: int
    caption: str = ""


@dataclass
class RowRecord:
    name: str
    status: str                 # pass | fail | n/a
    reason: str
    metrics: dict[str, float]
    criteria: dict
    details: dict
    seconds: float


@dataclass
class GateReport:
    run_name: str
    started: str                # ISO time
    criteria_sha256: str        # of the criteria as read once before the first row ran
    criteria: dict
    config: dict                # the resolved eval config
    rows: list[RowRecord] = field(default_factory=list)

    def count(self, status: str) -> int:
        return sum(r.status == status for r in self.rows)

    @property
    def failed(self) -> bool:
        return self.count("fail") > 0

    @property
    def verdict(self) -> str:
        """"fail" when any row failed. "pass" needs no failure; n/a rows are listed, never counted as passed."""
        return "fail" if self.failed else "pass"

    @property
    def exit_code(self) -> int:
        return 1 if self.failed else 0

    def to_json_dict(self) -> dict:
        return {
            "run_name": self.run_name,
            "started": self.started,
            "verdict": self.verdict,
            "counts": {s: self.count(s) for s in STATUSES},
            "passed": [r.name for r in self.rows if r.status == "pass"],
            "failed": [r.name for r in self.rows if r.status == "fail"],
            "not_applicable": [r.name for r in self.rows if r.status == "n/a"],
            "criteria_sha256": self.criteria_sha256,
            "criteria": self.criteria,
            "config": self.config,
            "rows": [asdict(r) for r in self.rows],
        }


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def _metrics_line(metrics: dict, limit: int = 4) -> str:
    items = [f"{k}={_fmt(v)}" for k, v in metrics.items()]
    return ", ".join(items[:limit]) + (", ..." if len(items) > limit else "")


def format_table(report: GateReport) -> str:
    """Fixed-width table for the terminal."""
    header = ("row", "status", "metrics", "reason")
    lines = [(r.name, r.status.upper(), _metrics_line(r.metrics), r.reason) for r in report.rows]
    widths = [max(len(h), *(len(line[i]) for line in lines)) if lines else len(h) for i, h in enumerate(header)]
    widths[3] = len(header[3])  # the reason runs to the end of the line
    fmt = lambda cols: "  ".join(c.ljust(w) for c, w in zip(cols, widths)).rstrip()  # noqa: E731
    out = [fmt(header), fmt(["-" * w for w in widths])] + [fmt(line) for line in lines]
    out.append(f"verdict: {report.verdict.upper()}  ({report.count('pass')} passed, {report.count('fail')} failed, "
               f"{report.count('n/a')} not applicable; criteria sha256 {report.criteria_sha256[:12]})")
    return "\n".join(out)


def _md_cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def to_markdown(report: GateReport) -> str:
    counts = {s: report.count(s) for s in STATUSES}
    out = [
        f"# Gate {report.run_name}: {report.verdict.upper()}",
        "",
        f"- started: {report.started}",
        f"- rows: {counts['pass']} passed, {counts['fail']} failed, {counts['n/a']} not applicable "
        "(not applicable is not a pass)",
        f"- criteria sha256: `{report.criteria_sha256}` (read once before the first row; never changed during the run)",
        "",
        "| row | status | metrics | reason | seconds |",
        "|---|---|---|---|---|",
    ]
    for r in report.rows:
        out.append(f"| {r.name} | **{r.status}** | {_md_cell(_metrics_line(r.metrics, limit=8))} | "
                   f"{_md_cell(r.reason)} | {r.seconds:.1f} |")
    for r in report.rows:
        out += ["", f"## {r.name}: {r.status}", "", r.reason or "", "",
                "criteria:", "```json", json.dumps(r.criteria, indent=2), "```",
                "metrics:", "```json", json.dumps(r.metrics, indent=2), "```"]
        if r.details:
            out += ["details:", "```json", json.dumps(r.details, indent=2, default=str), "```"]
    out += ["", "## config", "", "```json", json.dumps(report.config, indent=2, default=str), "```", ""]
    return "\n".join(out)


def write_report(report: GateReport, out_dir: str | Path, samples: list[AudioSample] = ()) -> dict[str, Path]:
    """Write gate.md, gate.json and the audio samples under out_dir. Returns the paths."""
    from eval.audio import write_wav

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"md": out / "gate.md", "json": out / "gate.json"}
    paths["md"].write_text(to_markdown(report))
    paths["json"].write_text(json.dumps(report.to_json_dict(), indent=2, default=str))
    for s in samples:
        (out / "audio").mkdir(exist_ok=True)
        write_wav(out / "audio" / f"{s.name}.wav", s.wav, s.sample_rate)
    return paths


def _flat_metrics(report: GateReport) -> dict[str, float]:
    flat = {}
    for r in report.rows:
        for k, v in r.metrics.items():
            if isinstance(v, (int, float, bool)):
                flat[f"{r.name}/{k}"] = float(v)
    return flat


def log_wandb(report: GateReport, samples: list[AudioSample], mode: str, project: str, out_dir: str | Path,
              tags: list[str] = ()) -> str | None:
    """One W&B run per gate run: config + criteria (with their hash), every numeric metric as
    `<row>/<metric>`, the result table, the audio samples, and the verdict in the summary.
    mode: offline (default, needs no account; `wandb sync` later), online, or disabled. Returns the
    run's local directory (None when disabled)."""
    if mode not in ("offline", "online", "disabled"):
        raise ValueError(f"wandb.mode must be offline, online or disabled, not {mode!r}")
    if mode == "disabled":
        return None
    import wandb

    run = wandb.init(mode=mode, project=project, name=report.run_name, dir=str(out_dir), tags=list(tags),
                     config={"eval": report.config, "criteria": report.criteria,
                             "criteria_sha256": report.criteria_sha256})
    try:
        run.log(_flat_metrics(report))
        table = wandb.Table(columns=["row", "status", "reason", "metrics", "seconds"],
                            data=[[r.name, r.status, r.reason, json.dumps(r.metrics), r.seconds] for r in report.rows])
        run.log({"gate/table": table})
        for s in samples:
            run.log({f"audio/{s.name}": wandb.Audio(np.asarray(s.wav, np.float32), sample_rate=s.sample_rate,
                                                    caption=s.caption or s.name)})
        run.summary["gate/verdict"] = report.verdict
        for status in STATUSES:
            run.summary[f"gate/{status}"] = report.count(status)
        return run.dir
    finally:
        run.finish()
