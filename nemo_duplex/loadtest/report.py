"""A load-test sweep's results: load.json and summary.md (rewritten after every run), the per-call packet
files, the lag and step-time plots, and the W&B run's scalars.
"""
from __future__ import annotations

import json
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from nemo_duplex.loadtest.callers import FRAME_S
from nemo_duplex.loadtest.judging import sustained


def _uploads_mode(meta: dict) -> str:
    if meta["uploads"]:
        return "on in every run"
    runs = meta.get("upload_runs") or []
    return f"in one more staggered run at N = {', '.join(map(str, runs))}" if runs else "off"


def stalls_said(row: dict) -> str:
    """What the server reported under way past its bounds in a run (row["stalled_s"]), e.g. "admission under
    way 31 s"; "" when nothing was."""
    return ", ".join(f"{part} under way {seconds:.0f} s" for part, seconds in row.get("stalled_s", {}).items()
                     if seconds)


def markdown(rows: list[dict], meta: dict) -> str:
    if meta.get("length_mix"):   # the input is the longest call's; each call sends a prefix of it
        lo, hi = meta["length_mix"]
        per_call = f"{lo:g} to {hi:g} s per call (uniform, seed {meta['length_seed']}, each its max_call_s)"
    else:
        per_call = f"{meta['duration_s']:g} s per call"
    lines = [f"input sha256 {meta['input_sha256'][:16]}, {per_call}, jitter buffer "
             f"{meta['jitter_buffer_ms']:g} ms, uploads {_uploads_mode(meta)}; server: "
             f"{' '.join(meta['server_overrides']) or meta['url']}", "",
             "| start | N | real time | failed | server lag p50 / p95 / p99 ms | p99 after frame 0 / 2 s | lateness p99 ms "
             "| late pkts "
             "| first audio p50 ms | drain p50 ms | step ms (mean / max) | gather + prep / device / dispatch ms "
             "| batch / padded (mean) | GPU MiB/call |",
             "|---|---:|---|---:|---|---:|---:|---:|---:|---:|---|---|---|---:|"]
    f = lambda x, d=1: "-" if x is None else f"{x:.{d}f}"   # noqa: E731
    for r in rows:
        if r.get("skipped"):
            lines.append(f"| {r['start']} | {r['n_calls']} | skipped: {r['skipped']} |" + " |" * 11)
            continue
        s = r["server_lag_ms"]
        lines.append(
            f"| {r['start']} | {r['n_calls']} | {'yes' if r['real_time'] else 'NO'} | {r['failed_calls']} | "
            f"{f(s['p50'])} / {f(s['p95'])} / {f(s['p99'])} | {f(r.get('server_lag_after_first_ms', {}).get('p99'))} / "
            f"{f(r.get('server_lag_after_2s_ms', {}).get('p99'))} | "
            f"{f(r['lateness_ms']['p99'])} | {r['late_packets']} | "
            f"{f(r['first_packet_ms']['p50'])} | {f(r['drain_ms']['p50'])} | "
            f"{f(r['step_ms']['mean'])} / {f(r['step_ms']['max_interval'])} | "
            f"{f(r.get('gather_ms'))} + {f(r.get('prep_ms'))} / {f(r.get('device_ms'))} / {f(r.get('dispatch_ms'))} | "
            f"{f(r['batch']['mean'])} / {f(r.get('padded_batch'))} | {f(r['gpu_memory_per_call_mib'])} |")
    lines += ["", "Sustained (largest N with every N' <= N real time): "
              + ", ".join(f"{k} {v}" for k, v in sustained([r for r in rows if not r.get("skipped")]).items())]
    for r in rows:
        if stalls := stalls_said(r):
            lines.append(f"The server stalled in the {r['start']} run at N={r['n_calls']}: {stalls} "
                         "(its /health said so: engine.max_step_s, engine.max_admission_s)")
        if "uploads" in r:
            u = r["uploads"]
            ratio = r.get("lag_p99_vs_without_uploads")
            lines.append(f"Uploads in the {r['start']} run at N={r['n_calls']}: {u['started']} started, {u['failed']} "
                         f"failed, median {u['seconds'].get('p50') if u['seconds'] else '-'} s each"
                         + (f"; live lag p99 {ratio}x the same N without uploads" if ratio is not None else ""))
        if "arrivals" in r:
            a = r["arrivals"]
            ratio = r.get("lag_p99_vs_without_arrivals")
            lines.append(f"Arrivals in the {r['start']} run at N={r['n_calls']}: {a['started']} started, {a['failed']} "
                         f"failed, first packet p50 / p99 {a['first_packet_ms'].get('p50')} / "
                         f"{a['first_packet_ms'].get('p99')} ms, catch-up (audio out per second, first packet to "
                         f"last) min / p50 {a['catch_up_x'].get('p0')} / {a['catch_up_x'].get('p50')}x real time"
                         + (f"; live lag p99 {ratio}x the same N without arrivals" if ratio is not None else "")
                         + (f"; admission pieces {a['pieces']['gap']} started in a gap between steps, "
                            f"{a['pieces']['waited']} after waiting engine.admission_gap_wait_ms for one"
                            if a.get("pieces") else "")
                         + (f"; errors: {a['errors']}" if a["errors"] else ""))
    return "\n".join(lines)


def plot(rows: list[dict], out: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [r for r in rows if not r.get("skipped")]
    starts = list(dict.fromkeys(r["start"] for r in done))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, start in enumerate(starts):
        rs = sorted((r for r in done if r["start"] == start), key=lambda r: r["n_calls"])
        n = [r["n_calls"] for r in rs]
        for q, style in (("p50", "-"), ("p95", "--"), ("p99", ":")):
            ax.plot(n, [r["server_lag_ms"][q] for r in rs], style, color=f"C{i}", marker="o", label=f"{start} {q}")
    ax.axhline(FRAME_S * 1000, color="grey", lw=0.8, label="one frame (80 ms)")
    ax.set(xlabel="concurrent calls N", ylabel="server lag per frame (ms)", yscale="log",
           title="Per-frame server lag vs N")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "lag_vs_n.png", dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, start in enumerate(starts):
        rs = sorted((r for r in done if r["start"] == start), key=lambda r: r["n_calls"])
        n = [r["n_calls"] for r in rs]
        ax.plot(n, [r["step_ms"]["mean"] for r in rs], "-", color=f"C{i}", marker="o", label=f"{start} mean")
        ax.plot(n, [r["step_ms"]["max_interval"] for r in rs], "--", color=f"C{i}", marker="x",
                label=f"{start} worst interval")
    ax.axhline(FRAME_S * 1000, color="red", lw=0.8, label="real-time budget (80 ms)")
    ax.set(xlabel="concurrent calls N", ylabel="batched step time (ms)", title="Step time vs N")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "step_vs_n.png", dpi=120)
    plt.close(fig)


def write_results(out: Path, rows: list[dict], meta: dict) -> None:
    summary = [{k: v for k, v in r.items() if k != "records"} for r in rows]
    result = {**meta, "sustained": sustained([r for r in rows if not r.get("skipped")]), "runs": summary}
    (out / "load.json").write_text(json.dumps(result, indent=1))
    (out / "summary.md").write_text(markdown(rows, meta) + "\n")


def save_calls(out: Path, row: dict) -> None:
    """Every packet of every call of a run: frame, arrival and send time (s from the call's origin), server lag."""
    calls = []
    for r in row["records"]:
        calls.append({"index": r.index, "error": r.error, "errors": r.errors, "ended": r.ended,
                      "output_sha256": r.output_sha256,
                      "sent_s": [round(s - r.origin, 5) for s in r.sent],
                      "frames": r.frames, "arrival_s": [round(a - r.origin, 5) for a in r.arrival],
                      "server_lag_ms": [round(x, 3) for x in r.server_lag_ms],
                      "drained_s": None if r.drained_at is None else round(r.drained_at - r.origin, 5)})
    (out / "calls").mkdir(exist_ok=True)
    (out / "calls" / f"{row['start']}_{row['n_calls']}.json").write_text(json.dumps(calls))


def wandb_run(cfg: DictConfig, out: Path, meta: dict):
    if cfg.wandb.mode == "disabled":
        return None
    try:
        import wandb
    except ImportError:
        print(f"wandb is not installed: no W&B run (wandb.mode={cfg.wandb.mode}); the results are in {out}", flush=True)
        return None
    return wandb.init(project=cfg.wandb.project, mode=cfg.wandb.mode, dir=str(out), job_type="load",
                      config={"loadtest": OmegaConf.to_container(cfg.loadtest, resolve=True), **meta})


def wandb_scalars(row: dict) -> dict:
    flat = {"n_calls": row["n_calls"], "real_time": int(row["real_time"]), "failed_calls": row["failed_calls"],
            "late_packets": row["late_packets"], "step_ms_mean": row["step_ms"]["mean"],
            "batch_mean": row["batch"]["mean"]}
    for q, v in row["server_lag_ms"].items():
        flat[f"server_lag_ms_{q}"] = v
    for key in ("server_lag_after_first_ms", "server_lag_after_2s_ms"):
        for q, v in row.get(key, {}).items():
            flat[f"{key}_{q}"] = v
    for q, v in row["lateness_ms"].items():
        flat[f"lateness_ms_{q}"] = v
    for part, v in row.get("stalled_s", {}).items():
        flat[f"stalled_{part}_s"] = v
    return {f"{row['start']}/{k}": v for k, v in flat.items()}

